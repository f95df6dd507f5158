"""Outputs of a layer's finished linears, computed once per batch and replayed in the layer's later forwards.

A job with its own chain (GPTQ's true-sequential stages) runs the layer over every batch once per stage, each time
up to the next stage's linears, and the chain's forward runs it whole once more: the linears finished in an early
stage compute the same products in every later forward (q/k/v four times, gate/up twice on a dense decoder: about
half of a 7B layer's forward FLOPs). Once the job declares a linear finished (`OutputReplay.freeze`), its output for
a batch is kept the first time it is computed and handed back in the later forwards of the same batch, so each
product runs once. The replayed tensor is the one computing it again would give, bit for bit: the same kernel on
the same weights and the same input, which is what the checks below hold to:

- a batch is known by the layer input tensor the layer's forward was called with (the job's and the chain's
  forwards pass the same tensor objects) and by the linear's call count within that forward; a linear called
  outside a forward of the whole layer is computed as usual;
- the weight must still be the tensor, storage and dtype it was when the output was kept (the pass's float32
  retry after an overflow casts it: the kept output is then computed again);
- the kept output must not have been written in place since (its version counter), else it is computed again.

Memory: kept outputs take at most `BUDGET_SHARE` of what the device had free when the job first froze a linear
(`available_bytes`); past that, outputs are computed as without a replay. The caller closes the replay after the
chain's forward (`close`): the layer's linears are as they were and the outputs are released.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn as nn

# of the device's free memory at the layer's first freeze. Linears are frozen stage by stage, so what fits first is
# what is reused most (q/k/v's outputs three times, o's twice, gate/up's once). The 7B shape at 128 x 512 tokens
# keeps 6 GB (gate/up 5 GB of it) and fits whole on an 80 GB card; at 256 x 1024 tokens it would keep 24 GB. There,
# on an H100, the stage took 32.3 s with no replay at a peak of 18.9 GiB allocated, 30.3-30.4 s keeping all 24 GB
# (41.4 GiB) and 30.3 s at this share (35.7 GiB): the same saving for 6 GB less.
BUDGET_SHARE = 0.25


def available_bytes(device: torch.device) -> int:
    """Memory a layer's working tensors may still take on `device`: CUDA's free memory plus the allocator's
    reserved but unallocated blocks; the host's MemAvailable (or its free pages) for the CPU; 0 if unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return 0
    return 0


@dataclass
class _Kept:
    batch: torch.Tensor  # the layer input the output belongs to, held so that no other tensor takes its id
    weight: tuple  # (tensor id, storage pointer, dtype) of the weight that computed it
    out: torch.Tensor
    version: int  # out._version when kept


def _weight_key(w: torch.Tensor) -> tuple:
    return id(w), w.data_ptr(), w.dtype


class OutputReplay:
    """Replays the outputs of a layer's finished linears across the layer's forwards (see the module docstring).

    replay = OutputReplay(layer); replay.freeze(names) once their weights are final; every forward of the layer
    afterwards reuses what those linears computed for the same batch; replay.close() when done.
    """

    def __init__(self, layer: nn.Module, budget: int | None = None):  # budget: bytes (tests)
        self.layer = layer
        self.budget = budget  # set at the first freeze unless given
        self.used = self.peak = 0  # bytes kept now / at most
        self.hits = self.misses = 0
        self._batch: torch.Tensor | None = None
        self._calls: dict[str, int] = {}
        self._kept: dict[tuple[str, int, int], _Kept] = {}  # (linear, batch id, call) -> kept output
        self._frozen: set[str] = set()
        # modules whose forward is wrapped (the layer, then each frozen linear), with the instance-level forward
        # each had before (None: the class's), put back on close
        self._wrapped: list[tuple[nn.Module, object]] = []

    def _wrap(self, module: nn.Module, wrapper) -> None:
        """module.forward = wrapper(its current forward), undone by `close`."""
        self._wrapped.append((module, module.__dict__.get("forward")))
        module.forward = wrapper(module.forward)

    def _within(self, forward):
        """The layer's forward, knowing its batch while it runs: a linear called outside a forward of the whole
        layer (a block run alone) has no batch and is computed as usual."""
        def run(*args, **kwargs):
            self._batch = args[0] if args else kwargs.get("hidden_states")
            self._calls.clear()
            try:
                return forward(*args, **kwargs)
            finally:
                self._batch = None
        return run

    def freeze(self, names: list[str]) -> None:
        """The linears `names` (submodules of the layer) will not change: replay their outputs from now on."""
        if self.budget is None:
            self.budget = int(available_bytes(next(self.layer.parameters()).device) * BUDGET_SHARE)
        if not self._wrapped:
            self._wrap(self.layer, self._within)
        for name in names:
            if name not in self._frozen:
                self._frozen.add(name)
                fc = self.layer.get_submodule(name)
                self._wrap(fc, lambda compute, name=name, fc=fc: self._replaying(name, fc, compute))

    def _replaying(self, name: str, fc: nn.Module, compute):
        def forward(x, *args, **kwargs):
            batch = self._batch
            call = self._calls.get(name, 0)
            self._calls[name] = call + 1
            if batch is None or args or kwargs:
                return compute(x, *args, **kwargs)
            key = (name, id(batch), call)
            kept = self._kept.get(key)
            if kept is not None and kept.weight == _weight_key(fc.weight) and kept.out._version == kept.version:
                self.hits += 1
                return kept.out
            out = compute(x)
            self.misses += 1
            if kept is not None:  # stale: its place goes to the new output
                self.used -= kept.out.nbytes
                del self._kept[key]
            if self.used + out.nbytes <= self.budget:
                self._kept[key] = _Kept(batch, _weight_key(fc.weight), out, out._version)
                self.used += out.nbytes
                self.peak = max(self.peak, self.used)
            return out
        return forward

    def close(self) -> None:
        """Put the layer's and the linears' own forwards back and release every kept output."""
        for module, own in reversed(self._wrapped):
            if own is None:
                del module.forward
            else:
                module.forward = own
        self._wrapped.clear()
        self._frozen.clear()
        self._kept.clear()
        self.used = 0
        self._batch = None

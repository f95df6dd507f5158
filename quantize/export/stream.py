"""One artifact's weight files, written while the pass computes them.

The checkpoint's tensors an artifact keeps as they are (embeddings, final norm, lm_head) are written first, then
each decoder layer once its job has finished it: its converted linears packed in the format's layout and the
tensors it keeps 16-bit (norms, biases, skipped linears, as the method left them). On CUDA the pass's thread
packs each layer on its own stream and queues the copy to pinned host memory; a worker thread takes it from
there, and the shards go to disk, to their hashes and to fsync as soon as they are full, so at export only the
last shard is left instead of every shard's packing, writing and sealing with the GPU idle (docs/BENCHMARKS.md,
"Weights written while the pass runs"). On a CPU the same groups are written in the same order at export, since a
worker would take cores from
the pass: the bytes are the same either way, and the shard boundaries follow the order of the groups
(`write.ShardWriter`).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .. import formats
from ..files import usable_cores
from ..formats.pack import on_device
from ..recipe import parse_size
from ..source.arch import checkpoint_name, decoder_layers, layer_prefix
from .write import AtomicDir, ShardWriter, check_finite, nonfinite

GLOBAL = -1  # the group of the tensors outside the decoder layers


class WeightStream:
    """The weight files of one job's artifact (`methods.job.Job`), in `directory`.

    during_pass: `layer(i)` (called by the job once layer i is final) queues the layer at once; else every group
    is written by `finish`. drop: tensor names not written (a tied lm_head). origin: where a non-finite tensor
    should be looked for (the checkpoint), for the error that names it.
    """

    def __init__(self, job, model, directory: AtomicDir, dtype: torch.dtype, drop: set[str],
                 device: torch.device, origin: str, during_pass: bool):
        recipe = job.recipe
        self.job, self.dtype, self.origin, self.during_pass = job, dtype, origin, during_pass
        self.directory = directory
        fmt = formats.get(recipe.out_format)
        self.args = (recipe.w_bit, recipe.symmetric)
        self.device = device
        # on CUDA during the pass the pass's own thread packs (a few launches a layer, on its stream: a second
        # stream and thread doing it took the GIL and fresh device memory just as the next layer started, which
        # slowed that start more than packing costs) and leaves the result on the device for the pinned copy;
        # elsewhere the worker packs on the device and gets host tensors back
        self.staged = device.type == "cuda" and during_pass
        self.pack_on_device = fmt.pack
        self.pack_to_host = on_device(device, fmt.pack)
        self.writer = ShardWriter(directory.tmp, parse_size(recipe.max_shard_size), directory.sealer.add,
                                  directory.sealer.rename)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="weights")
        self.state = model.state_dict()  # references: the checkpoint's pages stay where they are until written
        n = len(decoder_layers(model, job.arch))
        prefixes = {f"{layer_prefix(job.arch, i)}.": i for i in range(n)}
        self.groups: dict[int, list[str]] = {i: [] for i in [GLOBAL, *range(n)]}
        self.modules: dict[int, list[str]] = {i: [] for i in [GLOBAL, *range(n)]}  # converted linears per group
        for name in self.state:
            if name in drop:
                continue
            head = name.split(".")
            i = next((prefixes[p] for p in (".".join(head[:k]) + "." for k in range(1, len(head))) if p in prefixes),
                     GLOBAL)
            self.groups[i].append(name)
            if name.endswith(".weight") and name.removesuffix(".weight") in job.convert:
                self.modules[i].append(name.removesuffix(".weight"))
        self.layers = n
        self.next = GLOBAL  # the next group to queue
        self.futures: list[Future] = []
        self.found: dict[str, str] = {}  # non-finite tensors, by name
        self.packed: set[str] = set()
        self.unconverted: list[str] = []
        if during_pass:
            self._queue(GLOBAL)

    def layer(self, index: int) -> None:
        """Decoder layer `index` (and every one before it not yet queued) is final: write it."""
        if self.during_pass:
            self._queue(index)

    def _queue(self, last: int) -> None:
        while self.next <= last:
            i, self.next = self.next, self.next + 1
            results, overrides = self._inputs(i)
            staged, copied = None, None
            if self.staged:  # packed here, on the pass's stream, and copied to pinned host memory without waiting
                staged = {m: {k: _to_pinned(t) for k, t in self._pack_here(r).items()} for m, r in results.items()}
                copied = torch.cuda.Event()
                copied.record()
                results = {}
            self.futures.append(self.pool.submit(self._write, i, results, overrides, staged, copied))

    def _inputs(self, i: int) -> tuple[dict, dict]:
        """Group i's converted linears' results and the tensors its job left (`Job.overrides`)."""
        return ({m: self.job.results[m] for m in sorted(self.modules[i])},
                {n: self.job.overrides[n] for n in self.groups[i] if n in self.job.overrides})

    def _write(self, i: int, results: dict, overrides: dict, staged: dict | None, copied) -> None:
        self.writer.add(self._tensors(i, results, overrides, staged, copied))

    def _pack_here(self, r) -> dict[str, torch.Tensor]:
        d = self.device
        return self.pack_on_device(r.codes.to(d), r.scales.to(d, self.dtype), r.zeros.to(d), *self.args)

    def _tensors(self, i: int, results: dict, overrides: dict, staged: dict | None, copied) -> dict:
        """Group i's tensors as the artifact holds them, in name order (non-finite ones noted in `found`)."""
        if staged is not None:
            copied.synchronize()
            packed = {m: {k: _to_pageable(t) for k, t in d.items()} for m, d in staged.items()}
            del staged  # the pinned blocks go back to torch's host cache for the next layers
        else:
            packed = {m: self.pack_to_host(r.codes, r.scales.to(self.dtype), r.zeros, *self.args)
                      for m, r in results.items()}
        arch = self.job.arch
        kept = {}
        for name in self.groups[i]:
            if name.endswith(".weight") and name.removesuffix(".weight") in self.job.convert:
                continue
            t = overrides.get(name, self.state[name]).detach()
            kept[checkpoint_name(arch, name)] = t.to("cpu", self.dtype) if t.is_floating_point() else t.cpu()
        made_here = {checkpoint_name(arch, f"{m}.{suffix}"): t.to(self.dtype) if t.is_floating_point() else t
                     for m, d in packed.items() for suffix, t in d.items()}
        self.found.update(nonfinite(kept))
        self.found.update(nonfinite(made_here))
        self.packed.update(packed)
        self.unconverted += [n.removesuffix(".weight") for n in kept if n.endswith(".weight")]
        tensors = {**kept, **made_here}
        return {n: tensors[n] for n in sorted(tensors)}

    def _rest(self) -> None:
        """The groups not queued during the pass, made by as many threads as there are cores (the pass is over:
        2-core box, SmolLM2 RTN: export 1.2-1.4 s in one thread, 0.9-1.3 s in two) and added to the shards in
        order."""
        groups = list(range(self.next, self.layers))
        self.next = self.layers
        if not groups:
            return
        args = [(i, *self._inputs(i)) for i in groups]
        # on CUDA one thread: `on_device` brings packed tensors to the host through one pinned buffer
        threads = 1 if self.device.type == "cuda" else max(1, min(len(groups), usable_cores()))
        with ThreadPoolExecutor(threads, thread_name_prefix="weights") as pool:
            made = [pool.submit(self._tensors, i, results, overrides, None, None) for i, results, overrides in args]
            for f in made:
                self.writer.add(f.result())

    def finish(self) -> list[str]:
        """Write every group not written yet, wait for all, refuse NaN/inf, name the shards -> the file names."""
        try:
            for f in self.futures:
                f.result()  # the first queued group's error, in order
            self._rest()
            missing = set(self.job.results) - self.packed
            if missing:
                raise RuntimeError(f"{len(missing)} converted modules were not written, e.g. {sorted(missing)[:3]}")
            check_finite({}, self.origin, self.found)
            return self.writer.finish()
        finally:
            self.close()

    def close(self) -> None:
        """Stop: queued groups are dropped, the one being written finishes, no shard writer is left running."""
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.writer.close()


def _to_pinned(t: torch.Tensor) -> torch.Tensor:
    """A device tensor's copy in pinned host memory, queued on the current stream (torch's host allocator caches
    the blocks: after the first layers no new pinned memory is made)."""
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


def _to_pageable(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype)
    out.copy_(t)
    return out

"""Turn quantization results into the tensors and config block of the recipe's on-disk format."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext

import torch

from .. import formats


class _ToHost:
    """Device tensors to ordinary host memory through one reused pinned buffer.

    A plain `.cpu()` into pageable memory ran at 1.1 GB/s on the H200 host (3 GiB in 2.6 s), a copy into pinned
    memory at ~50 GB/s, and pinning a 3 GiB destination took 1.7 s: so each tensor goes to the pinned buffer a
    chunk at a time, and from there into its host tensor by torch's multi-threaded host copy."""

    CHUNK = 256 << 20  # bytes

    def __init__(self, device: torch.device):
        self.buf = torch.empty(self.CHUNK, dtype=torch.uint8, pin_memory=True) if device.type == "cuda" else None

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if self.buf is None or t.device.type != "cuda" or t.numel() == 0:
            return t.cpu()
        t = t.contiguous()
        out = torch.empty(t.shape, dtype=t.dtype)
        src, dst = t.reshape(-1).view(torch.uint8), out.reshape(-1).view(torch.uint8)
        for start in range(0, src.numel(), self.CHUNK):
            n = min(self.CHUNK, src.numel() - start)
            self.buf[:n].copy_(src[start : start + n])  # blocking: the bytes are in the buffer when it returns
            dst[start : start + n].copy_(self.buf[:n])
        return out


def _on(device: torch.device, fn):
    """Run a pack function with its inputs on `device` (integer bit-twiddling is ~10x faster on a GPU than
    on a few CPU cores for a 7B model) and bring the packed tensors back to the CPU; results are identical."""
    to_host = _ToHost(device)

    def run(codes, scales, zeros, *args):
        out = fn(codes.to(device), scales.to(device), zeros.to(device), *args)
        return {k: to_host(v) for k, v in out.items()}
    return run


def pack_all(results: dict, recipe, skipped: list[str], dtype: torch.dtype,
             device: torch.device | str = "cpu", ready: dict[str, dict] | None = None) -> tuple[dict[str, dict], dict]:
    """results: module -> QuantResult -> ({module: {suffix: tensor}} on the CPU, quantization_config).

    skipped: full names of every quantizable linear the plan leaves in 16-bit, for modules_to_not_convert or an
    indivisible shape (the format must name each one where it needs to: AWQ's modules_to_not_convert,
    compressed-tensors' ignore, or vLLM expects packed tensors for it). device: where to pack. ready: modules
    a `Packer` packed already during the pass (the same function on the same inputs); the rest are packed here.
    """
    fmt = formats.get(recipe.out_format)
    pack = _on(torch.device(device), fmt.pack)
    ready = ready or {}
    packed = {m: ready[m] if m in ready else pack(r.codes, r.scales.to(dtype), r.zeros, recipe.w_bit,
                                                  recipe.symmetric)
              for m, r in results.items()}
    return packed, fmt.quantization_config(recipe, skipped)


class Packer:
    """Packs each decoder layer's results as soon as the pass has finished the layer, in a worker thread on a
    CUDA stream of its own, and brings them to the host, while the pass works on the next layers; export then
    takes them from `packed()` instead of packing every module at its start (H200, 7B shape: 1.5-2.7 s of
    export, the GPU otherwise idle then). The same function runs on the same tensors as `pack_all`, so the
    bytes are the same. The run uses it on CUDA devices (`runner.PACK_DURING_PASS`): on a CPU the worker would
    take cores from the pass."""

    def __init__(self, recipe, dtype: torch.dtype, device: torch.device):
        self.device, self.dtype, self.args = device, dtype, (recipe.w_bit, recipe.symmetric)
        self.fn = _on(device, formats.get(recipe.out_format).pack)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="pack")
        self.futures: list[Future] = []

    def submit(self, results: dict) -> None:
        """Pack these results (module -> QuantResult, final: nothing writes them again) in the background."""
        if not results:
            return
        made = None
        if self.stream is not None:
            made = torch.cuda.Event()
            made.record(torch.cuda.current_stream(self.device))  # the worker's stream waits for what made them
        self.futures.append(self.pool.submit(self._pack, dict(results), made))

    def _pack(self, results: dict, made) -> dict[str, dict]:
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            if made is not None:
                self.stream.wait_event(made)
            return {m: self.fn(r.codes, r.scales.to(self.dtype), r.zeros, *self.args) for m, r in results.items()}

    def packed(self) -> dict[str, dict]:
        """Every module packed so far (waits for the worker; its first error is raised here)."""
        out: dict[str, dict] = {}
        try:
            for f in self.futures:
                out.update(f.result())
        finally:
            self.close()
        return out

    def close(self) -> None:
        """Stop: queued layers are dropped, the one being packed finishes."""
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.futures = [f for f in self.futures if not f.cancelled()]

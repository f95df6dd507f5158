"""Run a format's pack function where packing is fast and bring its tensors to the host."""

from __future__ import annotations

import torch


class _ToHost:
    """Device tensors to ordinary host memory through one reused pinned buffer.

    A plain `.cpu()` into pageable memory is far slower than a copy into pinned memory, and pinning a
    destination as large as the tensors is nearly as slow again: so each tensor goes to the pinned buffer a
    chunk at a time, and from there into its host tensor by torch's multi-threaded host copy (figures:
    docs/BENCHMARKS.md)."""

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


def on_device(device: torch.device, fn):
    """Run a pack function with its inputs on `device` (integer bit-twiddling is ~10x faster on a GPU than
    on a few CPU cores for a 7B model) and bring the packed tensors back to the CPU; results are identical."""
    to_host = _ToHost(device)

    def run(codes, scales, zeros, *args):
        out = fn(codes.to(device), scales.to(device), zeros.to(device), *args)
        return {k: to_host(v) for k, v in out.items()}
    return run

"""The compute device: CUDA allocator settings, layer uploads on a side stream, the side stream GPTQ factorises
on, and a clock that waits for queued work.

Everything that knows about CUDA streams or the allocator lives here; the algorithm files (awq_search.py,
gptq_sweep.py) take what they need from it as arguments. Which kernel a method runs is chosen in
`methods.kernels`.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.nn as nn

from . import hostpages
from ..errors import UserError

log = logging.getLogger(__name__)


def clock(device: torch.device) -> float:
    """Wall clock after the device has finished its queued work (sub-stage timings on CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()



# The allocator's cached blocks are kept from layer to layer (every layer asks for the same block sizes; releasing
# them after each layer was slower, with a higher peak reserved: docs/BENCHMARKS.md, "GPU path settings"). A guard
# releases them when more than CACHE_SLACK_SHARE of the device's memory sits reserved but unused at a layer's end
# (a pool per CUDA stream can hold many times the allocated memory reserved).
CACHE_SLACK_SHARE = 0.10


# The CUDA allocator's expandable segments (one growing mapping per stream, not fixed-size blocks that fragment):
# a lower peak reserved for the same allocated memory and the same artifacts (docs/BENCHMARKS.md). Set for this
# process only, at run time: the environment variable would reach the vLLM the eval starts.
CUDA_ALLOCATOR = "expandable_segments:True"
ALLOC_ENV = "PYTORCH_CUDA_ALLOC_CONF"


class AllocatorSettingError(UserError, ValueError):
    """The user's allocator setting is one torch refuses; found in pre-flight, before the model loads."""


def configure_allocator(device: torch.device) -> str | None:
    """Use CUDA_ALLOCATOR for this process's CUDA allocations unless the user set ALLOC_ENV -> the settings in
    force (for the manifest), None off CUDA. Call before the run's first CUDA allocation."""
    if device.type != "cuda":
        return None
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or \
        torch.cuda.memory._set_allocator_settings  # torch >= 2.9; before: the cuda one
    if ALLOC_ENV in os.environ:
        user = os.environ[ALLOC_ENV]
        try:  # parsed again here, so that a typo stops the run before the model loads, not at its first tensor
            setter(user)
        except (ValueError, RuntimeError) as e:
            raise AllocatorSettingError(f"{ALLOC_ENV}={user!r} is not a setting torch's CUDA allocator accepts ({e}); "
                                        f"correct it, or unset it to use {CUDA_ALLOCATOR}") from e
        log.info("CUDA allocator: %s=%r (set by the user, kept)", ALLOC_ENV, user)
        return user
    setter(CUDA_ALLOCATOR)
    log.info("CUDA allocator: %s (%s unset)", CUDA_ALLOCATOR, ALLOC_ENV)
    return CUDA_ALLOCATOR


def release_cache(device: torch.device, reused: int = 0) -> None:
    """After a layer on CUDA: hand cached blocks back when too much sits reserved but unused. reused: bytes the
    next layer will ask for again in the same sizes (the outputs a replay kept), not counted as slack."""
    slack = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device) - reused
    if slack > CACHE_SLACK_SHARE * torch.cuda.get_device_properties(device).total_memory:
        torch.cuda.empty_cache()



def device_copy(module: nn.Module, device: torch.device, dtype: torch.dtype | None,
                staging: "Staging | None" = None) -> nn.Module:
    """The module with its floating tensors on `device` in `dtype` (None: their own); the original is not
    moved or changed. staging: the host buffer its CPU tensors pass through (`Staging`); None: copied directly.

    Where device and dtype already match, the copy shares the original's storage (CPU in float32): the
    single-job pass then modifies the model's layer in place, as it always did.
    """
    staged = staging.stage(module, device) if staging is not None else {}

    def cast(t: torch.Tensor) -> torch.Tensor:
        want = dtype if dtype is not None and t.is_floating_point() else t.dtype
        if id(t) in staged:
            return staged[id(t)].to(want)  # on the device already: the cast (if any) runs there
        return t.detach().to(device, want)

    memo: dict[int, object] = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(cast(p), requires_grad=False)
    for b in module.buffers():
        memo[id(b)] = cast(b)
    return copy.deepcopy(module, memo)


class Staging:
    """One host buffer, page-locked on CUDA, that a layer's CPU tensors are copied into before their upload.

    A copy from pageable memory goes through the driver's own staging, and the main stream's reads back to the host
    (the weight check, the FP forward's finiteness check, the jobs' own) wait behind the next layer's upload that
    crosses that way on the side stream. From a page-locked buffer the upload is a DMA the main stream's reads do
    not queue behind, with the same weights (docs/BENCHMARKS.md, "Layer uploads through a page-locked buffer").
    The buffer is reused from layer to layer (it grows to the largest layer) and is
    free again once the stream the uploads were queued on has finished them: the caller synchronises it.
    """

    ALIGN = 512  # bytes: every tensor's view starts where any dtype (and the DMA engine) is happy

    def __init__(self, pin: bool = True):
        self.pin = pin
        self.buffer: torch.Tensor | None = None
        self.off = False  # the host could not lend the memory: uploads go straight from the source tensors

    def _layout(self, module: nn.Module) -> tuple[dict[int, torch.Tensor], dict[int, int], int]:
        """module's contiguous CPU tensors by id, their byte offsets in the buffer, the bytes they need."""
        tensors = {id(t): t for t in [*module.parameters(), *module.buffers()]
                   if t.device.type == "cpu" and t.is_contiguous() and t.numel() > 0}
        offsets, total = {}, 0
        for key, t in tensors.items():
            offsets[key] = total
            total += -(-t.numel() * t.element_size() // self.ALIGN) * self.ALIGN
        return tensors, offsets, total

    def reserve(self, module: nn.Module) -> None:
        """Make the buffer large enough for module (page-locking half a gigabyte takes a few tenths of a second:
        done ahead, beside other work, the first upload does not wait for it)."""
        self._grow(self._layout(module)[2])

    def _grow(self, total: int) -> None:
        if self.off or not total or (self.buffer is not None and self.buffer.numel() >= total):
            return
        self.buffer = None  # the old one goes before the new one is allocated
        try:
            self.buffer = torch.empty(total, dtype=torch.uint8, pin_memory=self.pin)
        except RuntimeError as e:  # page-locked memory is scarcer than memory: the copies work without it, slower
            self.off = True
            log.warning("could not page-lock %.2f GB of host memory for layer uploads (%s); uploading from the "
                        "checkpoint's pages directly", total / 1e9, str(e).splitlines()[0] if str(e) else type(e).__name__)

    def stage(self, module: nn.Module, device: torch.device) -> dict[int, torch.Tensor]:
        """Copy module's contiguous CPU tensors into the buffer and queue their copies to `device` on the current
        stream -> {id(host tensor): device tensor}. Others are left to the caller's direct copy."""
        tensors, offsets, total = self._layout(module)
        if not tensors:
            return {}
        self._grow(total)
        if self.off:
            return {}
        out = {}
        for key, t in tensors.items():
            host = self.buffer[offsets[key]:offsets[key] + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            host.copy_(t.detach())
            out[key] = host.to(device, non_blocking=self.pin, copy=True)  # never the buffer itself
        return out

    def close(self) -> None:
        self.buffer = None


class Uploader:
    """Device copies of decoder layers, the next one made on a side CUDA stream by a worker thread while the
    current layer is worked on, so that the GPU does not wait for the host-to-device copies. On other devices the
    copy is made when asked for. Once a copy is made, the layer's
    memory-mapped checkpoint pages are unmapped from this process (`hostpages`): they are not read again but for
    the tensors export writes unconverted, which fault back in from the file."""

    def __init__(self, layers, device: torch.device):
        self.layers, self.device = layers, device
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="upload") if device.type == "cuda" else None
        self.stream = torch.cuda.Stream(device) if self.pool is not None else None
        self.staging = Staging() if self.pool is not None else None  # used by the worker thread only
        if self.pool is not None and len(layers):
            self.pool.submit(self.staging.reserve, layers[0])  # while the pass embeds its calibration tokens
        self.pending: dict[int, tuple[torch.dtype, Future]] = {}
        self.released = 0  # bytes of memory-mapped checkpoint pages unmapped once their layer was copied

    def request(self, i: int, dtype: torch.dtype) -> None:
        """Start copying layer i (if there is one) in the background."""
        if self.pool is not None and i < len(self.layers) and i not in self.pending:
            self.pending[i] = (dtype, self.pool.submit(self._copy, i, dtype))

    def _copy(self, i: int, dtype: torch.dtype) -> nn.Module:
        with torch.cuda.stream(self.stream):
            m = device_copy(self.layers[i], self.device, dtype, self.staging)
        self.stream.synchronize()  # complete before the main stream sees it, and before the buffer is reused
        return self._made(i, m)

    def _made(self, i: int, m: nn.Module) -> nn.Module:
        """Layer i's device copy `m` exists: unmap the host pages of the checkpoint it was read from."""
        self.released += hostpages.release_module(self.layers[i], m)
        return m

    def get(self, i: int, dtype: torch.dtype) -> nn.Module:
        """Layer i on the device in dtype (the background copy when it was made for this dtype)."""
        dt, fut = self.pending.pop(i, (None, None))
        if fut is not None:
            m = fut.result()
            if dt == dtype:
                main = torch.cuda.current_stream(self.device)
                for t in [*m.parameters(), *m.buffers()]:
                    t.record_stream(main)  # the allocator must not hand this memory to the side stream too early
                return m
        return self._made(i, device_copy(self.layers[i], self.device, dtype))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pending.clear()
            self.staging.close()


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> "torch.cuda.Stream | None":
    """One side stream per CUDA device for the whole process (None off CUDA). The caching allocator keeps a pool
    per stream: a new stream per layer left each layer's freed factorisation blocks unusable by the next, and the
    reserved memory grew far past the allocated (docs/BENCHMARKS.md)."""
    if device.type != "cuda":
        return None
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]

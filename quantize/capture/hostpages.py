"""Hand back the host pages of a checkpoint's tensors once a device copy of them exists.

On the GPU path the model's parameters are views of the memory-mapped safetensors files (no host copy is made).
Uploading a layer reads its pages, and they stay mapped in this process: by the last layer the whole checkpoint
counts in the process's resident memory (a 7B model: 15 GB more RSS than the run needs, on top of the packed
results). Once a layer's device copy exists its host pages are only read again for the few tensors export writes
unconverted (norms, biases), so they are unmapped with madvise(MADV_DONTNEED): a later read faults them back in
from the file (or from the page cache, which keeps them as long as the kernel likes), with the same bytes.

That is exact only for pages nobody wrote to. The mapping is private and writable, so a page written in place
became an anonymous copy that MADV_DONTNEED would throw away, silently bringing back the file's bytes. Each
range is therefore checked in /proc/self/pagemap first: a tensor any of whose pages is anonymous (written, or
swapped out) is left alone, as is every tensor outside a file mapping (the CPU path's converted model).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os

import numpy as np
import torch

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
MADV_DONTNEED = 4
_PRESENT, _SWAPPED, _FILE = 1 << 63, 1 << 62, 1 << 61  # /proc/<pid>/pagemap entry bits (Linux >= 3.5)


def _file_mappings() -> list[tuple[int, int]]:
    """This process's private mappings of regular files (from /proc/self/maps) -> [(start, end)]."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or not parts[5].startswith("/") or parts[1][3] != "p":
                continue
            start, end = (int(x, 16) for x in parts[0].split("-"))
            out.append((start, end))
    return out


def _inside(maps: list[tuple[int, int]], lo: int, hi: int) -> bool:
    return any(start <= lo and hi <= end for start, end in maps)


def _libc_madvise():
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def supported() -> bool:
    """Whether pages can be checked and released here (Linux's /proc/self/pagemap)."""
    return os.name == "posix" and os.path.exists("/proc/self/pagemap")


def in_file_mapping(t: torch.Tensor) -> bool:
    """Whether CPU tensor `t` lies wholly in a private mapping of a file."""
    ptr, n = t.data_ptr(), t.numel() * t.element_size()
    return t.device.type == "cpu" and _inside(_file_mappings(), ptr, ptr + n)


def release(tensors: list[torch.Tensor], keep: list[torch.Tensor] = ()) -> int:
    """Unmap the whole pages of each CPU tensor in `tensors` that lies in a private file mapping and whose mapped
    pages are all unwritten file pages -> bytes unmapped. Tensors sharing storage with one in `keep` (a device
    copy that is the same memory) are skipped. Off Linux, or where pagemap cannot be read, nothing is done."""
    if not supported():
        return 0
    kept = {t.untyped_storage().data_ptr() for t in keep if t.device.type == "cpu"}
    spans = []
    for t in tensors:
        if t.device.type != "cpu" or t.untyped_storage().data_ptr() in kept:
            continue
        ptr, n = t.data_ptr(), t.numel() * t.element_size()
        lo, hi = -(-ptr // PAGE) * PAGE, (ptr + n) // PAGE * PAGE  # whole pages inside the tensor only
        if hi > lo:
            spans.append((lo, hi))
    if not spans:
        return 0
    maps = _file_mappings()
    try:
        fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    except OSError as e:
        log.debug("host pages kept: /proc/self/pagemap unreadable (%s)", e)
        return 0
    madvise, freed = _libc_madvise(), 0
    try:
        for lo, hi in spans:
            if not _inside(maps, lo, hi):
                continue  # anonymous memory (a converted copy): MADV_DONTNEED would zero it
            count = (hi - lo) // PAGE
            raw = os.pread(fd, 8 * count, lo // PAGE * 8)
            if len(raw) != 8 * count:
                continue
            entries = np.frombuffer(raw, dtype=np.uint64)
            present = (entries & np.uint64(_PRESENT | _SWAPPED)) != 0
            if bool((present & ((entries & np.uint64(_FILE)) == 0)).any()):
                continue  # a page was written (now anonymous) or swapped: unmapping it would lose the write
            if madvise(lo, hi - lo, MADV_DONTNEED) == 0:
                freed += hi - lo
    finally:
        os.close(fd)
    return freed


def release_module(source: torch.nn.Module, copy: torch.nn.Module) -> int:
    """`release` for a module whose device copy `copy` has been made -> bytes unmapped."""
    return release([*source.parameters(), *source.buffers()], keep=[*copy.parameters(), *copy.buffers()])

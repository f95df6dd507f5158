"""File primitives every writer shares: sha256 of a file, fsync, a file replaced atomically, a full disk told
apart from other refused writes, and a size as disk tools print it."""

from __future__ import annotations

import errno
import hashlib
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from .errors import UserError


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    with open(path, "rb") as f:
        return sha256_of(f, chunk)


def sha256_of(f: BinaryIO, chunk: int = 1 << 22) -> str:
    """sha256 of an open file from its position to its end (the file is left open)."""
    h = hashlib.sha256()
    while block := f.read(chunk):
        h.update(block)
    return h.hexdigest()


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Call write(f) on a fsynced sibling temp file opened "wb", then rename it to `path`: readers see the old or
    the new file, never a part. A writer given a file object (torch.save) keeps a full disk's OSError as its own
    error's context, where `disk_full_errno` finds it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_text(path: Path, text: str) -> None:
    """`atomic_write` of UTF-8 text."""
    atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS has one, as a container or taskset sets
    it), which is what a pool of threads or processes should be sized by; os.cpu_count() counts the host's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class DiskFullError(UserError, OSError):
    """The disk filled up (or a quota was hit) while an artifact or checkpoint was written; nothing was left behind."""


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
# How libraries that wrap the OS error say it: safetensors (Rust) "... (os error 28)"; torch.save to a path
# loses the errno, to a file object keeps the OSError as the RuntimeError's __context__.
_DISK_FULL_TEXT = {errno.ENOSPC: ("No space left on device", f"(os error {errno.ENOSPC})"),
                   errno.EDQUOT: ("Disk quota exceeded", f"(os error {errno.EDQUOT})")}


def disk_full_errno(e: BaseException | None) -> int | None:
    """ENOSPC / EDQUOT if `e`, or an exception it was raised from, says the disk is full -> errno, else None."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in DISK_FULL:
            return e.errno
        for code, texts in _DISK_FULL_TEXT.items():
            if not isinstance(e, OSError) and any(t in str(e) for t in texts):
                return code
        e = e.__cause__ or e.__context__
    return None


def human_bytes(n: float) -> str:
    """12345678 -> '12.35 MB' (decimal units, as disk tools print them)."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"

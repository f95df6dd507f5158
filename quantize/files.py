"""File primitives every writer shares: sha256 of a file, fsync, and a file replaced atomically."""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


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
    error's context, where `export.disk_full_errno` finds it."""
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

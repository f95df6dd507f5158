"""Paths built from names a user controls (recipe names, --name, --out) stay where they are meant to be."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

from .errors import UserError


def cache_dir() -> Path:
    """The tool's cache root: $QUANTIZE_CACHE_DIR, or ~/.cache/quantize (GGUF conversions, reference perplexities,
    vLLM's kernel answers, bytecode, each in its own folder)."""
    return Path(os.environ.get("QUANTIZE_CACHE_DIR", Path.home() / ".cache" / "quantize"))


class UnsafePathError(UserError, ValueError):
    """A name from a recipe or a flag would put a file outside its parent directory, or the parent is unusable."""


def child(parent: str | Path, name: str, what: str) -> Path:
    """`parent / name`, after checking that it resolves to a direct child of `parent` -> the unresolved path.

    Resolved, not pattern-matched: `.`, `..`, `a/../..`, an absolute path, or a symlink inside `parent` leading
    elsewhere all fail. what: how the name was given (e.g. "recipe name"), for the message.
    """
    parent = Path(parent)
    path = parent / name
    base = parent.resolve()
    if not name or path.resolve().parent != base:
        shown = name if len(name) <= 80 else name[:77] + "..."
        raise UnsafePathError(f"{what} {shown!r} does not name a file or directory inside {parent} (it resolves to "
                              f"{path.resolve()}); use a plain name without '/', '.' or '..'")
    return path


def check_output_parent(parent: str | Path, flag: str = "--out") -> None:
    """Refuse a parent directory that is a file, or that this process cannot create files in (read-only, permissions).

    Probed by creating (and removing) a temporary file: permission bits do not tell for root or read-only mounts.
    """
    parent = Path(parent)
    probe = parent
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise UnsafePathError(f"{flag} {parent}: {probe} is a file, not a directory; pass a directory for {flag}")
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        why = "is on a read-only file system" if e.errno == errno.EROFS else "is not writable by this user"
        raise UnsafePathError(f"{flag} {parent}: {probe} {why} ({os.strerror(e.errno)}); pass a directory you can "
                              f"write to with {flag} DIR") from None

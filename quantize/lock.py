"""One writer per output: an OS file lock (`filelock`, flock on Unix) on `<out>.lock` next to the artifact.

The operating system releases the lock when its process ends, however it ends (SIGKILL included), so a lock can
never outlive its run and nothing has to be deleted by hand. The lock file itself stays (waiters must share its
inode); while held it records the holder's pid, host and start time, so a refused run can say who holds it. The
record is best effort: writing it needs disk space, and a full disk must not turn into a lock that blocks.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock, Timeout

from .errors import UserError

log = logging.getLogger(__name__)


class OutputLockedError(UserError, RuntimeError):
    """Another live run is writing the same output."""


def lock_path(out: Path) -> Path:
    """artifacts/<name> -> artifacts/<name>.lock (a sibling, so it never ends up inside the artifact)."""
    out = Path(out)
    return out.parent / f"{out.name}.lock"


def _write_record(fd: int, data: bytes) -> None:
    os.pwrite(fd, data, 0)
    os.fsync(fd)


def _record_holder(fd: int) -> None:
    """on_acquired: replace the lock file's content with this process's record (empty if it cannot be written)."""
    record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    os.ftruncate(fd, 0)  # a previous holder's record must never describe this one
    try:
        _write_record(fd, json.dumps(record).encode())
    except OSError as e:
        log.warning("output lock: could not record this run in the lock file (%s); the lock holds all the same", e)


def _holder(path: Path) -> str:
    try:
        h = json.loads(path.read_text())
        return f"pid {h['pid']} on host {h['host']} since {h['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process whose record in the lock file cannot be read"


def acquire(out: Path) -> FileLock:
    """Take the lock of `out` -> the held FileLock; OutputLockedError naming the holder if a live run has it."""
    path = lock_path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(path, timeout=0, on_acquired=_record_holder)
    try:
        lock.acquire()
    except Timeout:
        raise OutputLockedError(
            f"output {out} is locked by another run: {_holder(path)} (the operating system holds that lock until "
            f"the process exits; lock file {path}). Wait for that run to finish or write elsewhere with --out DIR"
        ) from None
    return lock


@contextmanager
def output_lock(out: Path) -> Iterator[Path]:
    """Hold `<out>.lock` for the duration of the block; released however the block ends (or the process)."""
    lock = acquire(out)
    try:
        yield lock_path(out)
    finally:
        lock.release()

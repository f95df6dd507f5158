"""One writer per output: an OS file lock (`filelock`, flock on Unix) on `<out>.lock` next to the artifact.

The operating system releases the lock when its process ends, however it ends (SIGKILL included), so a lock can
never outlive its run and nothing has to be deleted by hand. While held, the lock file records the holder's pid,
host and start time, so a refused run can say who holds it. The record is best effort: writing it needs disk
space, and a full disk must not turn into a lock that blocks.

A released lock leaves nothing beside the artifacts: the holder unlinks the file while still holding it, then
unlocks. A process that opened the file before the unlink and locks it afterwards holds a lock on a name that
no longer exists; it sees that (the path no longer leads to its file) and starts over on a new file. Only a
killed run leaves its lock file, which the next run of that output takes over and removes.
"""

from __future__ import annotations

import functools
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


class _Unlinked(Exception):
    """The file was locked after its previous holder had unlinked it: that lock guards nothing."""


def _same_file(path: Path, fd: int) -> bool:
    try:
        return os.path.samestat(os.stat(path), os.fstat(fd))
    except FileNotFoundError:
        return False


def _record_holder(path: Path, fd: int) -> None:
    """on_acquired: refuse a lock on an unlinked file (_Unlinked rolls it back), then replace the lock file's
    content with this process's record (empty if it cannot be written)."""
    if not _same_file(path, fd):
        raise _Unlinked(path)
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
    for _ in range(100):  # each retry follows a holder that released meanwhile: a few at most
        lock = FileLock(path, timeout=0, on_acquired=functools.partial(_record_holder, path))
        try:
            lock.acquire()
        except Timeout:
            raise OutputLockedError(
                f"output {out} is locked by another run: {_holder(path)} (the operating system holds that lock "
                f"until the process exits; lock file {path}). Wait for that run to finish or write elsewhere with "
                f"--out DIR") from None
        except _Unlinked:
            continue
        return lock
    raise OutputLockedError(f"output {out}: its lock file {path} keeps being replaced by other runs; wait for them "
                            f"to finish or write elsewhere with --out DIR")


def release(lock: FileLock) -> None:
    """Unlink the lock file, then unlock: a released lock leaves no file (see the module's docstring)."""
    try:
        Path(lock.lock_file).unlink(missing_ok=True)
    finally:
        lock.release()


@contextmanager
def output_lock(out: Path) -> Iterator[Path]:
    """Hold `<out>.lock` for the duration of the block; released however the block ends (or the process)."""
    lock = acquire(out)
    try:
        yield lock_path(out)
    finally:
        release(lock)

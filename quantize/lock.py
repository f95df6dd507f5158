"""One writer per output: `<out>.lock` next to the artifact directory, created with O_CREAT|O_EXCL.

The lock file holds the writer's pid, host and start time. A lock whose process is gone (same host, pid
not alive, or alive but started at another time, i.e. the pid was reused) is stale: it is taken over with
a warning, so a run killed with SIGKILL does not block the next one. A lock held by a live process, or by
another host (whose processes we cannot see), is refused with a message naming the holder.
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

log = logging.getLogger(__name__)


class OutputLockedError(RuntimeError):
    """Another live run is writing the same output."""


def lock_path(out: Path) -> Path:
    """artifacts/<name> -> artifacts/<name>.lock (a sibling, so it never ends up inside the artifact)."""
    out = Path(out)
    return out.parent / f"{out.name}.lock"


def _proc_start(pid: int) -> str | None:
    """Start time of `pid` in clock ticks since boot (Linux /proc), or None where /proc is not available."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22 of stat; fields after the ')' of comm start at 3


def _alive(holder: dict) -> bool:
    """Is the process recorded in a lock (on this host) still the one that wrote it?"""
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    recorded, now = holder.get("proc_start"), _proc_start(pid)
    return recorded is None or now is None or recorded == now


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # unreadable or half-written: treated as held by an unknown process


def _create(path: Path, record: dict) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    return True


def _refuse(path: Path, out: Path, holder: dict) -> OutputLockedError:
    who = f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} since {holder.get('started', '?')}"
    if not holder:
        why = "the lock file cannot be read"
    elif holder.get("host") != socket.gethostname():
        why = "that host's processes cannot be checked from here"
    else:
        why = "that process is still running"
    return OutputLockedError(
        f"output {out} is locked by another run: {who} ({why}; lock file {path}). Wait for that run to "
        f"finish or write elsewhere with --out DIR; if you are sure no run is writing it, delete {path}")


def acquire(out: Path) -> tuple[Path, dict]:
    """Take the lock of `out` -> (lock file, its record); OutputLockedError if a live run holds it."""
    path = lock_path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"pid": os.getpid(), "host": socket.gethostname(), "proc_start": _proc_start(os.getpid()),
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    for _ in range(2):  # a second attempt only after removing a stale lock
        if _create(path, record):
            return path, record
        holder = _read(path)
        if holder is None:  # released between our create and read
            continue
        if holder.get("host") != socket.gethostname() or _alive(holder):
            raise _refuse(path, Path(out), holder)
        log.warning("output lock %s is stale (pid %s on this host is gone, started %s); taking it over",
                    path, holder.get("pid"), holder.get("started"))
        path.unlink(missing_ok=True)
    holder = _read(path) or {}
    raise _refuse(path, Path(out), holder)


def release(path: Path, record: dict) -> None:
    """Remove the lock if it is still ours (never someone else's that took over)."""
    if _read(path) == record:
        path.unlink(missing_ok=True)


@contextmanager
def output_lock(out: Path) -> Iterator[Path]:
    """Hold `<out>.lock` for the duration of the block; released however the block ends."""
    path, record = acquire(out)
    try:
        yield path
    finally:
        release(path, record)

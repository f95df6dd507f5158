"""The output lock: a live holder (a real second process) is refused by pid; a dead or foreign-looking one is not."""

import json
import os
import socket
import subprocess
import sys

import pytest

from quantize import lock

HOLDER = """
import sys, time
from quantize.lock import output_lock
with output_lock(sys.argv[1]):
    print("locked", flush=True)
    time.sleep(120)
"""


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_live_lock_in_another_process_refused(tmp_path):
    out = tmp_path / "artifacts" / "m"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE, text=True,
                            cwd=os.getcwd())
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(lock.OutputLockedError, match=rf"locked by another run: pid {proc.pid} on host"):
            with lock.output_lock(out):
                pass
        assert json.loads(lock.lock_path(out).read_text())["pid"] == proc.pid  # the holder's lock is left alone
    finally:
        proc.kill()
        proc.wait()


def test_stale_lock_taken_over_and_released(tmp_path, caplog):
    out = tmp_path / "m"
    path = lock.lock_path(out)
    path.write_text(json.dumps({"pid": _dead_pid(), "host": socket.gethostname(), "started": "earlier"}))
    with lock.output_lock(out):
        assert json.loads(path.read_text())["pid"] == os.getpid()
    assert "is stale" in caplog.text and "taking it over" in caplog.text
    assert not path.exists()


def test_reused_pid_is_stale(tmp_path):
    """The recorded pid is alive but started at another time: another process got that pid, the lock is stale."""
    if lock._proc_start(os.getpid()) is None:
        pytest.skip("no /proc: start times cannot be compared")
    path = lock.lock_path(tmp_path / "m")
    path.write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname(), "proc_start": "1"}))
    with lock.output_lock(tmp_path / "m"):
        assert json.loads(path.read_text())["pid"] == os.getpid()


def test_other_host_and_unreadable_locks_refused(tmp_path):
    path = lock.lock_path(tmp_path / "m")
    path.write_text(json.dumps({"pid": 1, "host": "elsewhere.example", "started": "then"}))
    with pytest.raises(lock.OutputLockedError, match="pid 1 on host elsewhere.example.*cannot be checked"):
        lock.acquire(tmp_path / "m")
    path.write_text("{half-writ")
    with pytest.raises(lock.OutputLockedError, match=f"cannot be read.*delete {path}"):
        lock.acquire(tmp_path / "m")


def test_release_leaves_a_lock_that_is_not_ours(tmp_path):
    path, record = lock.acquire(tmp_path / "m")
    path.write_text(json.dumps({**record, "pid": record["pid"] + 1}))  # someone took it over
    lock.release(path, record)
    assert path.exists()

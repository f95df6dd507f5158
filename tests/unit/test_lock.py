"""The output lock: a live holder (a real second process) is refused by pid; a killed one's lock is gone with it."""

import errno
import json
import os
import signal
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


def _holder(out):
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE, text=True,
                            cwd=os.getcwd())
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_live_lock_in_another_process_refused(tmp_path):
    out = tmp_path / "artifacts" / "m"
    proc = _holder(out)
    try:
        with pytest.raises(lock.OutputLockedError, match=rf"locked by another run: pid {proc.pid} on host .* since "
                                                         r".*lock file .*m.lock\)\. Wait for that run"):
            with lock.output_lock(out):
                pass
        assert json.loads(lock.lock_path(out).read_text())["pid"] == proc.pid  # the holder's record is left alone
    finally:
        proc.kill()
        proc.wait()


def test_lock_of_a_killed_run_is_free_at_once(tmp_path):
    """SIGKILL gives no chance to clean up: the operating system releases the lock with the process."""
    out = tmp_path / "m"
    proc = _holder(out)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert lock.lock_path(out).is_file()  # the file stays; the lock does not
    with lock.output_lock(out):
        assert json.loads(lock.lock_path(out).read_text())["pid"] == os.getpid()
    assert not lock.lock_path(out).exists()  # the next run took it over and removed it


def test_released_lock_leaves_no_file(tmp_path):
    out = tmp_path / "m"
    with lock.output_lock(out) as path:
        assert path.is_file()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RuntimeError, match="boom"):
        with lock.output_lock(out):
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_lock_taken_on_an_unlinked_file_is_taken_again(tmp_path, monkeypatch):
    """A process that opened the file before its holder unlinked it, and locked it after, holds a lock on a name
    that no longer exists: it must start over on the new file, not run beside the next holder."""
    seen = []
    real = lock._same_file
    monkeypatch.setattr(lock, "_same_file", lambda p, fd: bool(seen.append(fd)) or len(seen) > 1 and real(p, fd))
    with lock.output_lock(tmp_path / "m"):
        assert len(seen) == 2
        proc = subprocess.run([sys.executable, "-c", "import sys; from quantize.lock import acquire; "
                               "acquire(sys.argv[1])", str(tmp_path / "m")], capture_output=True, text=True)
        assert "locked by another run" in proc.stderr  # the second attempt holds it


def test_empty_or_garbage_lock_file_does_not_block(tmp_path):
    """What a run that hit a full disk while taking the lock leaves behind never refuses the next run."""
    for content in ("", "{half-writ"):
        lock.lock_path(tmp_path / "m").write_text(content)
        with lock.output_lock(tmp_path / "m"):
            assert json.loads(lock.lock_path(tmp_path / "m").read_text())["pid"] == os.getpid()


def test_disk_full_while_recording_holder_still_locks(tmp_path, monkeypatch):
    out = tmp_path / "m"

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(lock, "_write_record", full)
    with lock.output_lock(out):
        assert lock.lock_path(out).read_text() == ""
        proc = subprocess.run([sys.executable, "-c", "import sys; from quantize.lock import acquire; acquire(sys.argv[1])",
                               str(out)], capture_output=True, text=True)
        assert proc.returncode != 0
        assert "locked by another run: a process whose record in the lock file cannot be read" in proc.stderr
    with lock.output_lock(out):  # released: the next run proceeds
        pass


def test_lock_released_after_the_block(tmp_path):
    out = tmp_path / "m"
    with lock.output_lock(out):
        pass
    proc = subprocess.run([sys.executable, "-c", HOLDER.replace("time.sleep(120)", "pass"), str(out)],
                          capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "locked"

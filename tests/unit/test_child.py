"""`eval.child`: a child's whole process group dies with the parent however the parent dies, and with the
child's end; shown on `sleep` grandchildren (the vLLM cases are in tests/integration/test_orphans.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eval import child
from tests.conftest import process_group

ROOT = Path(__file__).resolve().parents[2]

# the child: the guard (or not), a grandchild that would outlive it, then wait
CHILD = ("import subprocess, sys, time\nfrom eval.child import watch_parent\n"
         "if sys.argv[1] == 'guarded':\n    watch_parent()\n"
         "subprocess.Popen(['sleep', '300'])\nprint('up', flush=True)\ntime.sleep(float(sys.argv[2]))\n")

# the parent: starts the child through eval.child, says its pid, waits to be killed
PARENT = ("import os, subprocess, sys, time\nfrom eval import child\n"
          "p = child.start([sys.executable, '-c', sys.argv[1], sys.argv[2], '300'], dict(os.environ),"
          " cwd=sys.argv[3], stdout=subprocess.PIPE, text=True)\n"
          "p.stdout.readline()\nprint(p.pid, flush=True)\ntime.sleep(300)\n")


def _gone_within(pgid: int, seconds: float) -> list[str]:
    deadline = time.monotonic() + seconds
    while process_group(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return process_group(pgid)


def _kill_parent(sig: signal.Signals, mode: str) -> tuple[int, list[str]]:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, mode, str(ROOT)], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    pgid = int(parent.stdout.readline())
    assert len(process_group(pgid)) >= 2  # the child and its grandchild (and the watchdog, when guarded)
    os.kill(parent.pid, sig)
    parent.wait(timeout=30)
    left = _gone_within(pgid, 10)
    if left:
        os.killpg(pgid, signal.SIGKILL)
    return pgid, left


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_group_dies_with_the_parent(sig):
    _, left = _kill_parent(sig, "guarded")
    assert not left, left


def test_without_the_guard_the_grandchildren_outlive_the_parent():
    """Negative control: the same kill leaves the group alive when the child does not watch its parent."""
    _, left = _kill_parent(signal.SIGKILL, "unguarded")
    assert any("sleep 300" in p for p in left), left


def test_run_timeout_kills_the_whole_group():
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        child.run([sys.executable, "-c", CHILD, "guarded", "300"], dict(os.environ), timeout=3, cwd=ROOT)
    # subprocess.run kills the child alone: its grandchild would hold the output pipe open, and run wait, 300 s
    assert time.monotonic() - t0 < 30


def test_what_the_child_leaves_behind_goes_at_release():
    """A child that exits leaving a grandchild: `run` releases the pipe, the watchdog clears the group."""
    p = child.start([sys.executable, "-c", CHILD, "guarded", "0"], dict(os.environ), cwd=ROOT,
                    stdout=subprocess.PIPE, text=True)
    p.stdout.readline()
    p.wait(timeout=30)
    assert any("sleep 300" in x for x in process_group(p.pid))  # left behind by the child's exit
    child.release(p)
    left = _gone_within(p.pid, 10)
    assert not left, left

"""No vLLM outlives the process that started it: a parent serving a tiny 16-bit model through `eval.serve.Server`
is killed (SIGKILL, SIGTERM, SIGINT) while its child vLLM starts and while it serves; within 10 s of the parent's
death no process of the child's process group may be alive (server, EngineCore, worker, resource tracker)."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import process_group as group

ROOT = Path(__file__).resolve().parents[2]
GRACE_S = 10

# SIGKILL is the case no handler can answer, so it stands for the others in the default suite: six vLLM starts
# would add minutes on 2 cores
CASES = [pytest.param(sig, phase, id=f"{sig.name}-{phase}",
                      marks=() if sig == signal.SIGKILL else pytest.mark.slow)
         for phase in ("start", "serve") for sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT)]


def _lines(proc: subprocess.Popen) -> queue.Queue:
    q: queue.Queue = queue.Queue()

    def read():
        for line in proc.stdout:
            q.put(line.strip())
    threading.Thread(target=read, daemon=True).start()
    return q


def _wait_line(q: queue.Queue, prefix: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = q.get(timeout=1)
        except queue.Empty:
            continue
        if line.startswith(prefix):
            return line
    raise AssertionError(f"the parent printed no {prefix!r} line within {timeout:.0f} s")


def _engine_started(pgid: int, timeout: float) -> None:
    """Wait until vLLM has started its engine process (a grandchild of the parent): the start is under way."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any("spawn_main" in p or "EngineCore" in p for p in group(pgid)):
            return
        time.sleep(0.2)
    raise AssertionError(f"vLLM started no engine process within {timeout:.0f} s: {group(pgid)}")


@pytest.mark.vllm
@pytest.mark.vllm_no_4bit
@pytest.mark.parametrize("sig,phase", CASES)
def test_child_vllm_group_dies_with_its_parent(tiny_llama, tmp_path, sig, phase):
    parent = subprocess.Popen([sys.executable, "-m", "tests.integration.vllm_parent", str(tiny_llama),
                               str(tmp_path / "server.log")], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    pgid = None
    try:
        lines = _lines(parent)
        pgid = int(_wait_line(lines, "child ", 120).split()[1])
        if phase == "start":
            _engine_started(pgid, 300)
            assert not any(x == "ready" for x in list(lines.queue)), "the server was ready before the kill"
        else:
            _wait_line(lines, "ready", 400)
        os.kill(parent.pid, sig)
        parent.wait(timeout=120)  # SIGINT: the parent stops its server first (up to 30 s of vLLM's shutdown)
        deadline = time.monotonic() + GRACE_S
        while group(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = group(pgid)
        assert not left, f"{len(left)} process(es) of the child's group alive {GRACE_S} s after the parent died " \
                         f"of {sig.name} during {phase}:\n" + "\n".join(left)
    finally:
        for pg in (parent.pid, pgid):  # what this test started, whatever the outcome
            if pg is not None:
                try:
                    os.killpg(pg, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        parent.wait()

"""How a command's process ends (pipeline/__main__.py): `exit_now` keeps what the interpreter's exit promises
(other threads finished, exit handlers run, output flushed, the status) and skips the module teardown; a reader that
closes the pipe early ends the command without a traceback."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import ROOT

CHILD = r"""
import atexit, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from pipeline.__main__ import exit_now
out = Path(sys.argv[1])
atexit.register(lambda: (out / "handler").write_text("ran"))
def late():
    time.sleep(0.3)
    (out / "thread").write_text("done")
threading.Thread(target=late).start()  # not a daemon: the exit waits for it
pool = ThreadPoolExecutor(2)  # never shut down: its idle workers must not hold the exit
pool.submit(lambda: None).result()
f = open(out / "unclosed-but-flushed.txt", "w")
f.write("x")
f.flush()
sys.stdout.write("no newline at the end")  # still in the buffer
exit_now(int(sys.argv[2]))
"""


def _env():
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def test_exit_now_keeps_threads_handlers_output_and_status(tmp_path):
    p = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), "3"], env=_env(), cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 3, p.stderr[-2000:]
    assert p.stdout == "no newline at the end"
    assert (tmp_path / "handler").read_text() == "ran"
    assert (tmp_path / "thread").read_text() == "done"
    assert p.stderr == ""


def test_a_profiled_command_exits_as_usual(tmp_path):
    """`python -m cProfile -o P -m pipeline list`: cProfile writes P after the command returns, so the command
    must return rather than end the process itself."""
    prof = tmp_path / "list.prof"
    p = subprocess.run([sys.executable, "-m", "cProfile", "-o", str(prof), "-m", "pipeline", "list"], env=_env(),
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert prof.stat().st_size > 0


def test_a_reader_that_goes_away_ends_the_command_quietly():
    """`quantize list | head -1` with head gone before the output: the read end is closed before the command
    writes anything, so its first write finds no reader (not a race with a reader that might still read)."""
    p = subprocess.Popen([sys.executable, "-m", "pipeline", "list"], env=_env(), cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    p.stdout.close()
    err = p.stderr.read()
    assert p.wait(timeout=300) == 141
    assert "Traceback" not in err and "BrokenPipe" not in err, err

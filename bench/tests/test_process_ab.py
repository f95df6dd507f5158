"""bench/process_ab.py: two trees timed in turns, each run a fresh `python -m pipeline` process; a directory that
is no tree of this repository, or no command, is refused with a one-line error and exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

from bench.build_checkpoint import ROOT

SCRIPT = str(ROOT / "bench" / "process_ab.py")


def test_two_trees_in_turns_with_their_figures(tmp_path):
    out = tmp_path / "ab.json"
    p = subprocess.run([sys.executable, SCRIPT, "--against", str(ROOT), "--runs", "2", "--json", str(out), "--",
                        "list"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    labels = [line.split(":")[0] for line in p.stdout.splitlines() if " run " in line or line.startswith("run ")]
    assert labels == [f"{ROOT} run 1", "run 1", f"{ROOT} run 2", "run 2"]  # the other tree first each round
    record = json.loads(out.read_text())
    assert record["command"] == ["python", "-m", "pipeline", "list"]
    for side in ("this", "against"):
        walls = [r["wall_s"] for r in record[side]["runs"]]
        assert len(walls) == 2 and all(w > 0 for w in walls)
        assert record[side]["min_wall_s"] <= record[side]["median_wall_s"] <= record[side]["max_wall_s"]


def test_refusals_are_one_line_and_exit_2(tmp_path):
    for args, says in ((["--against", str(tmp_path), "--", "list"], "holds no pipeline/__main__.py"),
                       (["--against", str(ROOT)], "give the command after --"),
                       (["--against", str(ROOT), "--runs", "0", "--", "list"], "give at least 1")):
        p = subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and p.stderr.startswith("error: ") and says in p.stderr
        assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr

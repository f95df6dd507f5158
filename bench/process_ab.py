"""A command of this tool timed as a process, this tree against another, runs alternating (the other tree first
each round) so that a busy machine weighs on both alike:

    git worktree add --detach /tmp/old REV
    python bench/process_ab.py --against /tmp/old --runs 4 [--json OUT.json] -- run RECIPE --out DIR --force

Each run is `python -m pipeline ARGS...` in a fresh process with the tree as its code (same venv, same
environment; HF_HUB_OFFLINE=1 unless set): wall seconds from start to exit, the exit code, and each `stage NAME:
done in S s` the log shows. A run that fails stops the benchmark with its output's tail.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import NoReturn

ROOT = Path(__file__).resolve().parents[1]


def fail(message: str) -> NoReturn:
    """A one-line `error:` on stderr and exit 2, as the command line answers a user's mistake."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def check_tree(tree: Path) -> None:
    """Refuse a directory that is no tree of this repository, saying how to make one."""
    if not (tree / "pipeline" / "__main__.py").is_file():
        fail(f"--against {tree} holds no pipeline/__main__.py; give a tree of this repository "
                 f"(git worktree add --detach DIR REV)")


def timed(tree: Path, args: list[str], label: str) -> tuple[float, str]:
    """`python -m pipeline ARGS` in a fresh process with `tree` as the code -> (wall seconds, its output)."""
    # the tree first on the path, anything already there (e.g. wheels unpacked on a GPU host) after it
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(x for x in (str(tree), os.environ.get("PYTHONPATH")) if x)}
    env.setdefault("HF_HUB_OFFLINE", "1")
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "pipeline", *args], env=env, cwd=tree, capture_output=True, text=True)
    wall = round(time.perf_counter() - t0, 2)
    if p.returncode != 0:
        fail(f"{label} exited {p.returncode}: {(p.stderr or p.stdout)[-1500:]}")
    return wall, p.stdout + p.stderr


def one(tree: Path, args: list[str], label: str) -> dict:
    wall, log = timed(tree, args, label)
    stages = {m.group(1): float(m.group(2)) for m in re.finditer(r"stage (\w+): done in ([\d.]+) s", log)}
    print(f"{label}: {wall} s, stages {stages}", flush=True)
    return {"wall_s": wall, "stages_s": stages}


def commit(tree: Path) -> str | None:
    out = subprocess.run(["git", "log", "-1", "--format=%h"], cwd=tree, capture_output=True, text=True)
    return out.stdout.strip() or None


def summary(runs: list[dict]) -> dict:
    walls = [r["wall_s"] for r in runs]
    return {"median_wall_s": round(statistics.median(walls), 2), "min_wall_s": min(walls), "max_wall_s": max(walls)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", type=Path, required=True, metavar="DIR", help="another tree of this repository")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the arguments of `python -m pipeline`")
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        fail("give the command after --, e.g. -- run RECIPE --out DIR --force")
    if args.runs < 1:
        fail(f"--runs {args.runs}: give at least 1")
    check_tree(args.against)
    this, other = [], []
    for i in range(args.runs):
        other.append(one(args.against, command, f"{args.against} run {i + 1}"))
        this.append(one(ROOT, command, f"run {i + 1}"))
    record = {"date": time.strftime("%Y-%m-%d"), "machine": platform.machine(), "cpus": os.cpu_count(),
              "command": ["python", "-m", "pipeline", *command],
              "this": {"commit": commit(ROOT), "runs": this, **summary(this)},
              "against": {"dir": str(args.against), "commit": commit(args.against), "runs": other, **summary(other)}}
    print(json.dumps(record))
    if args.json:
        args.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()

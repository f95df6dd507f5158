"""A process's start-up, case against case: `python -m pipeline ARGS` in fresh processes, the cases alternating.

    python bench/startup_ab.py --case before:/tmp/base:.venv/bin/python \
        --case after:.:.venv/bin/python:QUANTIZE_BYTECODE=off [--runs 5] --json OUT.json -- preflight RECIPE --out DIR

A case is LABEL:TREE:PYTHON[:VAR=VALUE,...]: the tree of this repository that runs (a `git archive` of another
commit will do), the interpreter (a venv's, or a copy of one without bytecode: what an image that ships none looks
like to Python), and variables set for it. Each round runs every case once, in the order given, so that a busy
machine weighs on all alike. `{label}` in the arguments becomes the case's label (an output directory per case).
Recorded per run: wall seconds from the interpreter's start to its exit, its CPU seconds (user + system, with
its child processes: steadier than wall on a shared machine), the load average before it, and the seconds of the
`stage <name>: done in X s` lines of its log (pre-flight's and the others').
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

STAGE = re.compile(r"stage (\w+): done in ([0-9.]+) s")


def parse_case(text: str) -> dict:
    label, tree, python, *rest = text.split(":", 3)
    env = dict(kv.split("=", 1) for kv in rest[0].split(",")) if rest and rest[0] else {}
    return {"label": label, "tree": str(Path(tree).resolve()), "python": str(Path(python).absolute()), "env": env}


def timed(case: dict, args: list[str]) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **case["env"]}
    argv = [case["python"], "-m", "pipeline", *(a.replace("{label}", case["label"]) for a in args)]
    load = os.getloadavg()[0]
    r0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    p = subprocess.run(argv, env=env, cwd=case["tree"], capture_output=True, text=True)
    wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    if p.returncode != 0:
        sys.exit(f"error: {case['label']} exited {p.returncode}: {(p.stderr or p.stdout)[-1500:]}")
    stages = {name: float(s) for name, s in STAGE.findall(p.stdout + p.stderr)}
    return {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "load_1m": load, "stages_s": stages}


def summary(values: list[float]) -> dict:
    return {"n": len(values), "median": round(statistics.median(values), 3), "min": round(min(values), 3),
            "max": round(max(values), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", action="append", required=True, help="LABEL:TREE:PYTHON[:VAR=VALUE,...]")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", required=True)
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    args = a.args[1:] if a.args[:1] == ["--"] else a.args
    cases = [parse_case(c) for c in a.case]
    runs: dict[str, list[dict]] = {c["label"]: [] for c in cases}
    for i in range(a.runs):
        for case in cases:
            r = timed(case, args)
            runs[case["label"]].append(r)
            print(f"round {i + 1} {case['label']}: {r['wall_s']:.2f} s {r['stages_s'] or ''}", file=sys.stderr)
    out = {"args": args, "cases": cases, "runs": runs, "summary": {}}
    for label, rs in runs.items():
        out["summary"][label] = {"wall_s": summary([r["wall_s"] for r in rs]),
                                 "cpu_s": summary([r["cpu_s"] for r in rs])}
        for stage in rs[0]["stages_s"]:
            out["summary"][label][f"{stage}_s"] = summary([r["stages_s"][stage] for r in rs])
    Path(a.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

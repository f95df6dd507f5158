"""How vLLM's child processes end: eval.vllm_run's child started N times on one artifact, each time once with one
directory (vLLM's engine in a process of its own) and once with the directory twice in one process (the engine in
that process, as the agreement tests run it), and each exit status recorded: 0 when `shut_down` leaves no vLLM
thread to abort at interpreter exit, -6 (SIGABRT, "terminate called without an active exception") when one does.

    python bench/vllm_child_exit.py ARTIFACT [--runs 4] [--record NAME]   -> bench/results/NAME.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.serve_load import machine  # noqa: E402
from eval.vllm_run import vllm_env  # noqa: E402


def one(models: list[str], in_process: bool, dtype: str) -> dict:
    """One child on `models` -> its exit status, whether it wrote its whole result, and whether vLLM's teardown
    printed the abort's line."""
    with tempfile.TemporaryDirectory(prefix="vllm-exit-") as w:
        work = Path(w)
        (work / "p.json").write_text(json.dumps({
            "models": models, "token_ids": [[1, 2, 3, 4]], "top_k": 5, "max_tokens": 4, "dtype": dtype,
            "max_model_len": 512, "gpu_memory_utilization": 0.3}))
        env = vllm_env(work)
        if in_process:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "eval.vllm_run", "--prompts", str(work / "p.json"),
                            "--out", str(work / "o.json")], env=env, capture_output=True, text=True, cwd=ROOT)
        return {"directories": len(models), "in_process_engine": in_process, "exit": p.returncode,
                "result_written": (work / "o.json").is_file(),
                "abort_line": "terminate called without an active exception" in p.stdout + p.stderr,
                "seconds": round(time.perf_counter() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--record", default=None, help="write bench/results/NAME.json")
    args = ap.parse_args()
    art = str(args.artifact.resolve())
    rows = []
    for i in range(args.runs):
        for models, in_process in (([art], False), ([art, art], True)):
            rows.append({"run": i, **one(models, in_process, args.dtype)})
            print(json.dumps(rows[-1]), flush=True)
    rec = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "machine": machine(Path("/proc/cpuinfo").read_text()),
           "command": "python bench/vllm_child_exit.py " + " ".join(sys.argv[1:]), "artifact": art, "runs": rows,
           "aborts": sum(r["exit"] != 0 for r in rows)}
    if args.record:
        out = ROOT / "bench" / "results" / f"{args.record}.json"
        out.write_text(json.dumps(rec, indent=1) + "\n")
        print(f"record: {out}")


if __name__ == "__main__":
    main()

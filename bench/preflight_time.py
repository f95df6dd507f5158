"""Pre-flight time on a full-size checkpoint directory, on any machine: `python -m pipeline preflight`, each run
in a fresh process, on a directory of the Qwen2.5-7B shape whose weight files hold only their safetensors headers
(the data is a sparse hole: pre-flight reads headers, never weights, so a 15 GB directory costs no disk).

    python bench/preflight_time.py [--config bench/configs/qwen2.5-7b] [--runs 3] [--json OUT.json]
                                   [--against DIR]

The recipe is the shipped qwen7b-awq-g128 with `model` pointing at that directory and `device: cpu`. Each run's
`stage preflight` seconds (from its log) and process wall seconds are recorded. `--same-process N` adds one more
process that runs the same pre-flight N times in a row: its first call pays the imports as a run does, the later
ones show what pre-flight's own checks cost once transformers and torch are imported. The first run may also fill the
deploy table's cache (vLLM's kernel selection, asked once per vLLM version); it is reported, not dropped.
`--against DIR` times another tree of this repository the same way (e.g. `git worktree add --detach DIR REV`), with
the same venv and directory, its runs alternating with this tree's (the other tree first each round), so that a
busy machine weighs on both alike; the record gets its runs under `against`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NoReturn

import torch
import yaml
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.build_checkpoint import copy_tokenizer, shaped_config  # noqa: E402

SHARDS = 4


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


def commit(tree: Path) -> str | None:
    out = subprocess.run(["git", "log", "-1", "--format=%h"], cwd=tree, capture_output=True, text=True)
    return out.stdout.strip() or None


def headers_only(config_dir: Path, out: Path, tiny: bool = False) -> dict:
    """A checkpoint directory of config_dir's shape (bf16, SHARDS shards and their index) whose files hold real
    safetensors headers and sparse data -> {"tensors", "bytes"}. tiny: build_checkpoint's tiny shape (tests)."""
    cfg = shaped_config(config_dir, None, tiny)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    sd = model.state_dict()
    names = sorted(sd)
    weight_map, total = {}, 0
    out.mkdir(parents=True, exist_ok=True)
    for i in range(SHARDS):
        fname = f"model-{i + 1:05d}-of-{SHARDS:05d}.safetensors"
        header, offset = {}, 0
        for n in names[i::SHARDS]:
            nbytes = sd[n].numel() * 2
            header[n] = {"dtype": "BF16", "shape": list(sd[n].shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[n] = fname
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(out / fname, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            f.truncate(8 + len(raw) + offset)
        total += offset
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}, indent=2))
    cfg.save_pretrained(out)
    copy_tokenizer(out)
    return {"tensors": len(names), "bytes": total}


# pre-flight n times in one fresh process that has imported nothing else first (this script imports torch and
# transformers): per call its seconds and its `preflight` stage's
SAME_PROCESS = """
import json, logging, re, sys, time
recipe, out, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
stages = []
class Stage(logging.Handler):
    def emit(self, record):
        m = re.search(r"stage preflight: done in ([\\d.]+) s", record.getMessage())
        if m:
            stages.append(float(m.group(1)))
log = logging.getLogger("quantize")  # the stage lines: quantize.runlog's, quantize.runner's in older trees
log.addHandler(Stage())
log.setLevel(logging.INFO)
calls = []
for i in range(n):
    t0 = time.perf_counter()
    from quantize import runner  # the first call pays this import, as a run does
    runner.preflight_only(recipe, out_root=out, json_path=f"{out}/plan-{i}.json")
    calls.append({"call_s": round(time.perf_counter() - t0, 2), "preflight_s": stages[-1]})
print(json.dumps(calls))
"""


def parts(log: str) -> dict[str, float]:
    """The stage's parts from its log line `stage preflight: config 3.1 s, checkpoint 0.1 s, ...`."""
    m = re.search(r"stage preflight: (config [\d.]+ s.*)$", log, re.M)
    return {k.strip(): float(v) for k, v in re.findall(r"([a-z ]+) ([\d.]+) s", m.group(1))} if m else {}


def one_run(tree: Path, recipe: Path, work: Path, i: int, label: str) -> dict:
    """`python -m pipeline preflight` of `recipe` in a fresh process, with `tree` as the code -> the run's figures."""
    wall, log = timed(tree, ["preflight", str(recipe), "--out", str(work / "a"), "--json", str(work / f"plan-{i}.json")],
                      f"pre-flight {label}")
    m = re.search(r"stage preflight: done in ([\d.]+) s", log)
    if m is None:
        fail(f"pre-flight {label} logged no `stage preflight: done`: {log[-800:]}")
    run = {"preflight_s": float(m.group(1)), "process_s": wall, "parts_s": parts(log)}
    print(f"{label}: stage preflight {m.group(1)} s, process {wall:.1f} s, {run['parts_s']}", flush=True)
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=ROOT / "bench" / "configs" / "qwen2.5-7b")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--same-process", type=int, default=0, metavar="N",
                    help="also run pre-flight N times in one process (0: not)")
    ap.add_argument("--against", type=Path, default=None, metavar="DIR",
                    help="another tree of this repository, timed alternately with this one")
    args = ap.parse_args()
    if args.against:
        check_tree(args.against)
    with tempfile.TemporaryDirectory(prefix="preflight-time-") as work_s:
        work = Path(work_s)
        ckpt = headers_only(args.config, work / "ckpt")
        recipe = yaml.safe_load((ROOT / "recipes" / "qwen7b-awq-g128.yaml").read_text())
        recipe.update(model=str(work / "ckpt"), device="cpu")
        path = work / "qwen7b-awq-g128.yaml"
        path.write_text(yaml.safe_dump(recipe, sort_keys=False))
        env = {**os.environ, "HF_HUB_OFFLINE": "1",
               "PYTHONPATH": os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH")) if x)}
        runs, against = [], []
        for i in range(args.runs):
            if args.against:
                against.append(one_run(args.against, path, work, i, f"{args.against} run {i + 1}"))
            runs.append(one_run(ROOT, path, work, i, f"run {i + 1}"))
        same = []
        if args.same_process:
            (work / "s").mkdir()
            p = subprocess.run([sys.executable, "-c", SAME_PROCESS, str(path), str(work / "s"), str(args.same_process)],
                               env=env, cwd=ROOT, capture_output=True, text=True)
            if p.returncode != 0:
                sys.exit(f"error: the same-process run failed (exit {p.returncode}): {p.stderr[-800:]}")
            same = json.loads(p.stdout.strip().splitlines()[-1])
            for i, c in enumerate(same):
                print(f"same process, call {i + 1}: stage preflight {c['preflight_s']} s, call {c['call_s']} s")
    record = {"date": time.strftime("%Y-%m-%d"), "commit": commit(ROOT), "machine": platform.machine(),
              "cpus": os.cpu_count(), "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "config": str(args.config.resolve().relative_to(ROOT)) if args.config.resolve().is_relative_to(ROOT)
              else str(args.config), "checkpoint": ckpt, "runs": runs}
    if same:
        record["same_process"] = same
    if against:
        record["against"] = {"dir": str(args.against), "commit": commit(args.against), "runs": against}
    print(json.dumps(record))
    if args.json:
        args.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()

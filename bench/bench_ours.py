"""One timed run of our pipeline (quantize.runner.run, eval off) for bench/gpu_bench.py, in its own process.

    python bench/bench_ours.py RECIPE.yaml --out-root DIR --json RESULT.json
    python bench/bench_ours.py A.yaml B.yaml C.yaml --out-root DIR --json RESULT.json   # one shared pass

Several recipes run as `pipeline compare` runs them (`quantize.runner.run_many`: one load, one calibration set,
one layer-by-layer pass); the record then also holds each variant's share of the pass and its weights' sha256.

Records the process's wall time (imports included), the run's `quantize.runlog.RunLog` (stage seconds:
preflight/calibrate/load/quantize/export; per decoder layer its seconds, the pass's parts - device upload, FP
forward, jobs - and each method stage's seconds: GPTQ's Hessian and sweep per linear group, AWQ's scale
search, clip and quantize; the device code's own facts under `device`), the peak GPU memory of this process
(torch.cuda.max_memory_allocated and max_memory_reserved, from the RunLog) and its peak RSS. Writes the record
to --json and prints it as the last line.

Under torchrun (bench/gpu_dist.py: `torchrun --nproc-per-node 2 bench/bench_ours.py ...`) every rank runs its share
(`quantize.capture.distributed`); rank 0 writes the record, with every rank's peak GPU memory under "ranks".
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import sys
import time
from contextlib import nullcontext
from pathlib import Path

T0 = time.perf_counter()
LOAD0 = os.getloadavg()  # a busy host (the previous run's process still ending, writeback) slows imports
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pipeline import bytecode  # noqa: E402
from pipeline.__main__ import exit_now  # noqa: E402

BYTECODE = bytecode.prepare()  # before torch, as `python -m pipeline run` does

import torch  # noqa: E402

from bench.kernel_profile import KernelProfile  # noqa: E402
from bench.versions import installed  # noqa: E402
from quantize import manifest, runner
from quantize.capture import distributed  # noqa: E402
from quantize.recipe import load_recipe  # noqa: E402
from quantize.runlog import RunLog  # noqa: E402

PACKAGES = ("torch", "transformers", "accelerate", "safetensors", "pydantic", "compressed-tensors")
GIB = 2**30



def per_layer(runlog: RunLog) -> dict:
    """Each decoder layer's seconds, their mean, and the mean after the first layer (its one-time costs)."""
    seconds = [r.seconds for r in runlog.layers]
    rest = seconds[1:] or seconds
    return {"seconds": seconds, "n": len(seconds),
            "mean_s": round(sum(seconds) / len(seconds), 4) if seconds else None,
            "mean_after_first_s": round(sum(rest) / len(rest), 4) if rest else None}


def method_seconds(runlog: RunLog) -> dict[str, float]:
    """The method stages' seconds summed over layers and stages (AWQ: scale_search/clip/quantize; GPTQ:
    hessian/sweep)."""
    out: dict[str, float] = {}
    for layer in runlog.layers:
        for stage in layer.stages:
            for k, v in stage.seconds.items():
                out[k] = round(out.get(k, 0.0) + v, 4)
    return out


def gib(n: int | None) -> float | None:
    return None if n is None else round(n / GIB, 2)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe", nargs="+", help="recipe YAML path or name; several: one shared pass")
    ap.add_argument("--out-root", required=True, help="parent directory of the artifact")
    ap.add_argument("--json", type=Path, required=True, help="where the record is written")
    ap.add_argument("--profile", type=Path, default=None,
                    help="also run torch.profiler over the run and write its kernel summary here "
                         "(bench/kernel_profile.py; one process, no torchrun)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s.%(msecs)03d %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    dist = distributed.init_from_env()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    runlog = RunLog()
    t1 = time.perf_counter()
    profile = KernelProfile() if args.profile is not None and dist is None else nullcontext()
    try:
        with profile:
            if len(args.recipe) == 1:
                arts = [runner.run(args.recipe[0], out_root=args.out_root, force=True, runlog=runlog, dist=dist)]
            else:
                arts = runner.run_many([load_recipe(r) for r in args.recipe], args.out_root, force=True,
                                       runlog=runlog, dist=dist)
        art = arts[0]
        run_s = time.perf_counter() - t1
        ranks = None
        if dist is not None:  # each rank's own peaks: rank 0's runlog holds only its own
            mine = {"rank": dist.rank, "device": str(dist.device), "layer_s": [r.seconds for r in runlog.layers],
                    "peak_gpu_alloc_gib": gib(torch.cuda.max_memory_allocated(dist.device)) if cuda else None,
                    "peak_gpu_reserved_gib": gib(torch.cuda.max_memory_reserved(dist.device)) if cuda else None,
                    "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}
            ranks = dist.gather(mine)
            if dist.rank != 0:
                return {}
    finally:
        distributed.shutdown()
    man = manifest.read(art)
    record = {
        "runner": "ours", "recipe": man.recipe.name, "method": man.recipe.method,
        "artifact": str(art), "device": man.device, "compute_dtype": man.compute_dtype,
        "gpu": torch.cuda.get_device_name(0) if cuda else None, "versions": installed(PACKAGES),
        "gpu_total_gib": gib(torch.cuda.get_device_properties(0).total_memory) if cuda else None,
        "calibration": man.calibration.to_json() if man.calibration else None, "cuda_allocator": man.cuda_allocator,
        "stages_s": runlog.stages, "run_s": round(run_s, 3), "process_s": round(time.perf_counter() - T0, 2),
        "preflight_parts_s": runlog.preflight_parts, "loadavg_at_start": [round(x, 2) for x in LOAD0],
        "bytecode": None if BYTECODE is None else {"compiled": BYTECODE.compiled, "present": BYTECODE.present,
                                                   "workers": BYTECODE.workers,
                                                   "seconds": round(BYTECODE.seconds, 2)},
        "per_layer": per_layer(runlog), "method_seconds": method_seconds(runlog),
        "peak_gpu_alloc_gib": gib(runlog.peak_allocated_bytes),
        "peak_gpu_reserved_gib": gib(runlog.peak_reserved_bytes),
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "artifact_bytes": sum(f.stat().st_size for f in art.iterdir() if f.is_file()),
        "weights_sha256": {n: f.sha256 for n, f in man.files.items() if n.endswith(".safetensors")},
        "runlog": runlog.to_dict(), "pass_seconds": man.pass_seconds,
        "world_size": 1 if ranks is None else len(ranks), "ranks": ranks,
    }
    if len(arts) > 1:  # a shared pass: every variant's share of it and its weights
        mans = [manifest.read(a) for a in arts]
        record.update(recipes=[m.recipe.name for m in mans], artifacts=[str(a) for a in arts],
                      shared_pass=man.shared_pass,
                      variants_weights_sha256={m.recipe.name: {n: f.sha256 for n, f in m.files.items()
                                                               if n.endswith(".safetensors")} for m in mans})
    if ranks is not None and cuda:  # the busiest GPU's peak
        record["peak_gpu_alloc_gib"] = max(r["peak_gpu_alloc_gib"] for r in ranks)
        record["peak_gpu_reserved_gib"] = max(r["peak_gpu_reserved_gib"] for r in ranks)
    if isinstance(profile, KernelProfile):  # its busy share is of the quantize stage: most kernels run there
        summary = profile.summary(runlog.stages.get("quantize") or run_s)
        args.profile.write_text(json.dumps(summary, indent=2) + "\n")
        record["profile"] = {k: summary[k] for k in ("wall_s", "kernel_seconds", "busy_s", "busy_share_of_wall",
                                                      "by_kind_s")}
    args.json.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record), flush=True)
    return record


if __name__ == "__main__":
    main()
    if distributed.world_size() > 1:  # a torchrun worker: see `distributed.leave`
        distributed.leave(0)
    exit_now(0)  # as `python -m pipeline run` ends: no module teardown after the record

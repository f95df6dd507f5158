"""One timed run of our pipeline (quantize.runner.run, eval off) for bench/gpu_bench.py, in its own process.

    python bench/bench_ours.py RECIPE.yaml --out-root DIR --json RESULT.json

Records the process's wall time (imports included), the manifest's stage timings
(preflight/load/calibrate/quantize/export), each decoder layer's time (from the "layer i/N done in X s"
log records of quantize.capture), the first layers' breakdown (DEBUG records: upload, FP forward, jobs; GPTQ's
Hessian and sweep per stage), the stage stamps and the CUDA warm-up's parts on one timeline, the peak GPU
memory of this process (torch.cuda.max_memory_allocated and max_memory_reserved) and its peak RSS. Writes the
record to --json and prints it as the last line.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import resource
import sys
import time
from importlib import metadata
from pathlib import Path

T0 = time.perf_counter()
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from quantize import precompile  # noqa: E402 - standard library only

if __name__ == "__main__" and len(sys.argv) > 1 and not sys.argv[1].startswith("-"):
    precompile.spawn(["run", sys.argv[1]])  # as `python -m quantize run` does, before torch is imported

import torch  # noqa: E402

from quantize import runner, warmup  # noqa: E402

LAYER_DONE = re.compile(r"layer (\d+)/(\d+) done in ([0-9.]+) s")
# DEBUG records of quantize.capture / quantize.engine that break a layer's time down (kept for the first layers)
LAYER_PART = re.compile(r"^layer (\d+) (parts|stage \S+): (.*)$")
SECONDS = re.compile(r"(\w+) ([0-9.]+) s")
STAGE = re.compile(r"^stage (\w+): (start|done)")
FIRST_LAYERS = 2
PACKAGES = ("torch", "transformers", "accelerate", "safetensors", "pydantic", "compressed-tensors")


class LogTimes(logging.Handler):
    """Collects the per-layer records of the calibration loop (layer, seconds, wall-clock stamp); the stage
    times (export included) come from the manifest."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.layers: list[dict] = []
        self.parts: dict[int, dict] = {}  # the first layers' seconds: {"to_device": s, ..., "<stage>": {...}}
        self.stamps: dict[str, float] = {}  # "<stage> start|done" -> time.time()

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if m := LAYER_DONE.search(msg):
            self.layers.append({"layer": int(m[1]), "of": int(m[2]), "s": float(m[3]), "at": record.created})
        elif (m := LAYER_PART.match(msg)) and int(m[1]) <= FIRST_LAYERS:
            seconds = {k: float(v) for k, v in SECONDS.findall(m[3])}
            layer = self.parts.setdefault(int(m[1]), {})
            if m[2] == "parts":
                layer.update(seconds)
            else:
                layer[m[2]] = seconds
        elif m := STAGE.match(msg):
            self.stamps[f"{m[1]} {m[2]}"] = record.created

    def timeline(self, t_run: float, warm: dict) -> dict:
        """Stage stamps and the warm-up's start/end in seconds after the run began (time.time() t_run)."""
        out = {k: round(v - t_run, 3) for k, v in self.stamps.items()}
        for k in ("started_at", "done_at"):
            if k in warm:
                out[f"warmup {k.removesuffix('_at')}"] = round(warm[k] - t_run, 3)
        return dict(sorted(out.items(), key=lambda kv: kv[1]))


def versions() -> dict[str, str]:
    out = {}
    for p in PACKAGES:
        try:
            out[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            out[p] = "absent"
    return out


def per_layer(layers: list[dict]) -> dict:
    """Logged seconds per layer (0.1 s resolution) and the finer gaps between successive log stamps."""
    logged = [r["s"] for r in layers]
    gaps = [round(b["at"] - a["at"], 3) for a, b in zip(layers, layers[1:])]
    rest = gaps if gaps else logged
    return {"logged_s": logged, "stamp_gaps_s": gaps, "n": len(logged),
            "mean_s": round(sum(logged) / len(logged), 3) if logged else None,
            "mean_after_first_s": round(sum(rest) / len(rest), 3) if rest else None}


def method_seconds(stats: dict) -> dict:
    """Per-layer stats' "seconds" (AWQ: scale_search/clip/quantize; GPTQ: hessian/sweep) summed over layers."""
    out: dict[str, float] = {}
    for layer in stats.values():
        for k, v in (layer.get("seconds") or {}).items():
            out[k] = round(out.get(k, 0.0) + v, 3)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe", help="recipe YAML path or name")
    ap.add_argument("--out-root", required=True, help="parent directory of the artifact")
    ap.add_argument("--json", type=Path, required=True, help="where the record is written")
    args = ap.parse_args(argv)
    console = logging.StreamHandler()
    console.setLevel(logging.INFO)  # the DEBUG records below reach LogTimes, not the log
    logging.basicConfig(level=logging.INFO, format="%(asctime)s.%(msecs)03d %(name)s: %(message)s",
                        datefmt="%H:%M:%S", handlers=[console])
    log_times, qlog = LogTimes(), logging.getLogger("quantize")
    qlog.addHandler(log_times)
    qlog.setLevel(logging.DEBUG)  # the first layers' breakdown
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t1, t_run = time.perf_counter(), time.time()
    try:
        art = runner.run(args.recipe, out_root=args.out_root, force=True)
    finally:
        qlog.removeHandler(log_times)
    run_s = time.perf_counter() - t1
    man = json.loads((art / "manifest.json").read_text())
    gib = 2**30
    record = {
        "runner": "ours", "recipe": man["recipe"]["name"], "method": man["recipe"]["method"],
        "artifact": str(art), "device": man["device"], "compute_dtype": man["compute_dtype"],
        "gpu": torch.cuda.get_device_name(0) if cuda else None, "versions": versions(),
        "gpu_total_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 2) if cuda else None,
        "calibration": man["calibration"], "stages_s": man["timings_s"], "cuda_allocator": man.get("cuda_allocator"),
        "run_s": round(run_s, 2),
        "process_s": round(time.perf_counter() - T0, 2), "per_layer": per_layer(log_times.layers),
        "precompile": precompile.outcome,
        "warmup": {k: v for k, v in warmup.outcome.items() if not k.endswith("_at")},
        "timeline_s": log_times.timeline(t_run, warmup.outcome),
        "first_layers": {str(k): v for k, v in sorted(log_times.parts.items())},
        "peak_gpu_alloc_gib": round(torch.cuda.max_memory_allocated() / gib, 2) if cuda else None,
        "peak_gpu_reserved_gib": round(torch.cuda.max_memory_reserved() / gib, 2) if cuda else None,
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "artifact_bytes": sum(f.stat().st_size for f in art.iterdir() if f.is_file()),
        "weights_sha256": {n: f["sha256"] for n, f in man["files"].items() if n.endswith(".safetensors")},
        "pass_seconds": man.get("pass_seconds"),
        "method_seconds": method_seconds(man.get(f"{man['recipe']['method']}_stats") or {}),
    }
    args.json.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record), flush=True)
    return record


if __name__ == "__main__":
    main()

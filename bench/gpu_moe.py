"""MoE benchmark: our AWQ/GPTQ against llm-compressor 0.14 on a few layers of the Qwen3-30B-A3B shape.

On the GPU host (offline; wheels collected by bench/peers/collect_wheels.sh into .whl/):

    python3 bench/gpu_moe.py --wheels .whl                     # 2 layers, all four jobs, JSON + table in $OUT
    python3 bench/gpu_moe.py --wheels .whl --layers 4 --only ours-gptq,llmc-gptq
    python3 bench/gpu_moe.py --tiny --device cpu               # CPU test of the code paths (8 tiny experts)

1. Builds the checkpoint once (bench/build_checkpoint.py on bench/configs/qwen3-30b-a3b: 128 experts of
   moe_intermediate_size 768, top-8, hidden 2048; --layers decoder layers, random init on the device, bf16).
2. Runs each job in its own process, so its peak GPU memory is its own, on the same calibration token blocks:
   ours-awq / ours-gptq     bench/bench_ours.py on bench/recipes/bench-{awq,gptq}-g128.yaml (eval off)
   llmc-awq / llmc-gptq     bench/peers/llmc_bench.py (oneshot; routers `mlp.gate` left 16-bit, as ours)
3. Writes $OUT/gpu_moe.json (or --out) after every job, copies each job's log tail beside it, and prints a
   table: per-layer seconds (ours: each layer as measured; llm-compressor: its oneshot time / layers), the
   quantize or oneshot stage, and peak GPU memory (allocated / reserved).
A job that fails (crash, timeout) is recorded with its exit code and log tail; the others still run.
The peer's interpreter is --peer-python (default: .cache/venv-llmcompressor/bin/python when it exists).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import gpu_bench  # noqa: E402

CONFIG = "qwen3-30b-a3b"
JOBS = ("ours-awq", "ours-gptq", "llmc-awq", "llmc-gptq")
PEER_VENV_PYTHON = ROOT / ".cache" / "venv-llmcompressor" / "bin" / "python"
ROUTERS = "re:.*mlp.gate$"  # llm-compressor's MoE examples keep the routers 16-bit too


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--only", default=",".join(JOBS), help=f"comma-separated jobs: {', '.join(JOBS)} (default all)")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers of the Qwen3-30B-A3B shape (default 2)")
    ap.add_argument("--tiny", action="store_true", help="2 layers of hidden 256, 8 experts (tests on a CPU)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--n-samples", type=int, default=None, help="calibration blocks (default 128; tiny 8)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per block (default 512; tiny 128)")
    ap.add_argument("--peer-batch-size", type=int, default=1, help="oneshot batch_size (its default: 1)")
    ap.add_argument("--batch-size", type=int, default=None, help="our recipes' batch_size (default: the recipe's)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/gpu-moe"), help="checkpoints, artifacts, logs")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "/tmp/gpu-moe/out"))
    ap.add_argument("--wheels", type=Path, default=None, help="install these wheels into WORK/site first and "
                                                              "put it on every job's PYTHONPATH")
    ap.add_argument("--ours-python", default=sys.executable)
    ap.add_argument("--peer-python", default=str(PEER_VENV_PYTHON) if PEER_VENV_PYTHON.is_file() else sys.executable)
    ap.add_argument("--ours-extra", default="", help="extra arguments for bench/bench_ours.py")
    ap.add_argument("--job-timeout", type=int, default=0, help="seconds per job, 0 = none")
    args = ap.parse_args(argv)
    args.jobs = [j for j in (s.strip() for s in args.only.split(",")) if j]
    bad = [j for j in args.jobs if j not in JOBS]
    if bad:
        ap.error(f"--only: unknown job {bad[0]!r}; use {', '.join(JOBS)}")
    if args.layers < 1:
        ap.error("--layers must be at least 1")
    args.work, args.out = args.work.resolve(), args.out.resolve()
    if args.wheels is not None:
        args.wheels = args.wheels.resolve()
    args.n_samples = args.n_samples or (8 if args.tiny else 128)
    args.seq_len = args.seq_len or (128 if args.tiny else 512)
    return args


def job_command(job: str, model: str, args) -> list[str]:
    cmd = gpu_bench.job_command(job, model, args)
    return cmd + ["--ignore", ROUTERS] if job.startswith("llmc") else cmd


def summary(record: dict) -> dict:
    """A job's record -> per-layer seconds, the stage that quantized, peak GPU memory (GiB)."""
    if not record.get("ok"):
        return {"ok": False, "rc": record.get("rc")}
    if record.get("runner") == "ours":
        per, stage = record["per_layer"]["seconds"], record["stages_s"].get("quantize")
    else:
        per, stage = [record["oneshot_per_layer_s"]] * record["layers"], record["stages_s"]["oneshot"]
    return {"ok": True, "per_layer_s": per, "mean_per_layer_s": round(sum(per) / len(per), 3) if per else None,
            "quantize_s": stage, "peak_gpu_alloc_gib": record.get("peak_gpu_alloc_gib"),
            "peak_gpu_reserved_gib": record.get("peak_gpu_reserved_gib"), "wall_s": record.get("wall_s")}


def table(report: dict) -> str:
    head = f"{'job':10s} {'per layer (s)':>24s} {'mean (s)':>9s} {'quantize (s)':>12s} {'peak alloc':>10s} " \
           f"{'peak resv':>9s}  (GiB)"
    lines = [f"Qwen3-30B-A3B shape, {report['layers']} layers, {report['device']}, "
             f"{report['calibration']['n_samples']} x {report['calibration']['seq_len']} tokens", head, "-" * len(head)]
    for job, s in report["summary"].items():
        if not s["ok"]:
            lines.append(f"{job:10s} FAILED (rc {s['rc']})")
            continue
        per = " ".join(f"{x:.2f}" for x in s["per_layer_s"][:4])
        fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        lines.append(f"{job:10s} {per:>24s} {fmt(s['mean_per_layer_s']):>9s} {fmt(s['quantize_s']):>12s} "
                     f"{fmt(s['peak_gpu_alloc_gib']):>10s} {fmt(s['peak_gpu_reserved_gib']):>9s}")
    lines.append("llm-compressor's per-layer time is its oneshot time / layers (it reports no per-layer time)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report, env = gpu_bench.start(args, config=CONFIG, layers=2 if args.tiny else args.layers, jobs=args.jobs,
                                  device=args.device, tiny=args.tiny, peer_python=args.peer_python)
    report.update(runs={}, summary={})

    def save() -> None:
        (args.out / "gpu_moe.json").write_text(json.dumps(report, indent=2, default=str) + "\n")

    name = "tiny-qwen3-moe" if args.tiny else f"{CONFIG}-L{args.layers}"
    report["build"] = gpu_bench.build(CONFIG, name, None if args.tiny else args.layers, args, env)
    save()
    if not report["build"]["ok"]:
        print(f"error: building the checkpoint failed:\n{report['build']['log_tail']}", file=sys.stderr)
        return 1
    for job in args.jobs:
        record = gpu_bench.run_job(job, job_command(job, report["build"]["path"], args), env, args.work, args.out,
                                   args.job_timeout)
        report["runs"][job] = record
        report["summary"][job] = summary(record)
        save()
    return gpu_bench.finish(report, table(report), save, all(s["ok"] for s in report["summary"].values()))


if __name__ == "__main__":
    raise SystemExit(main())

"""Several GPUs against one: our AWQ and GPTQ per decoder layer at 1 and 2 ranks on the 7B and 72B shapes, with
llm-compressor's distributed oneshot on the same layers where its version has it.

On the 2-GPU host (offline; wheels from bench/peers/collect_wheels.sh), in one command of at most 10 minutes:

    python3 bench/gpu_dist.py --wheels .whl                      # 4 layers of 7B, 2 of 72B; JSON + logs in $OUT
    python3 bench/gpu_dist.py --wheels .whl --only ours-72b      # our 72B jobs only
    python3 bench/gpu_dist.py --tiny --device cpu                # the CPU test: 2 gloo ranks on tiny shapes

Each job is its own process (tree): ours at 1 GPU is bench/bench_ours.py, at 2 GPUs the same under
`torchrun --standalone --nproc-per-node 2` (quantize.capture.distributed: batches split over the ranks, owners per unit of
work); llm-compressor's is bench/peers/llmc_dist.py under torchrun (its `init_dist` + `load_offloaded_model`
guide), recorded as unsupported when the installed version lacks them. Checkpoints come from
bench/build_checkpoint.py (random init, bf16, bench/configs shapes cut to --layers-7b / --layers-72b layers).

Written after every job: $OUT/gpu_dist.json (or --out), each job's log tail beside it; printed at the end: a
table per shape and method of seconds per layer (mean after the first layer: its one-time costs stay out), the
2-GPU speedup, and the peak GPU memory of the busiest rank.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu_bench import build, finish, run_job, start, write_recipe  # noqa: E402

SHAPES = ("7b", "72b")
METHODS = ("awq", "gptq")
GPUS = (1, 2)
OURS = tuple(f"ours-{s}-{m}-{g}gpu" for s in SHAPES for m in METHODS for g in GPUS)
PEER = tuple(f"llmc-{s}-{m}-{g}gpu" for s in SHAPES for m in METHODS for g in GPUS)
# the default fits one 10-minute command on 2 H200s: every run of ours, the peer on the 72B shape at 2 GPUs
DEFAULT = OURS + ("llmc-72b-gptq-2gpu", "llmc-72b-awq-2gpu")
ALIASES = {"ours-7b": tuple(j for j in OURS if "-7b-" in j), "ours-72b": tuple(j for j in OURS if "-72b-" in j),
           "ours": OURS, "llmc": PEER, "default": DEFAULT}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--only", default="default", help="comma-separated jobs (ours|llmc)-(7b|72b)-(awq|gptq)-(1|2)gpu, "
                                                      f"or {', '.join(ALIASES)} (default: default)")
    ap.add_argument("--gpus", type=int, default=2, help="the ranks of the '2gpu' jobs (default 2)")
    ap.add_argument("--layers-7b", type=int, default=4, help="decoder layers of the 7B shape (default 4)")
    ap.add_argument("--layers-72b", type=int, default=2, help="decoder layers of the 72B shape (default 2)")
    ap.add_argument("--tiny", action="store_true", help="hidden 256, 2 layers per shape (tests the bench on a CPU)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--n-samples", type=int, default=None, help="calibration blocks (default 128; tiny 8)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per block (default 512; tiny 64)")
    ap.add_argument("--batch-size", type=int, default=None, help="our recipes' batch_size (default: the recipe's)")
    ap.add_argument("--peer-batch-size", type=int, default=1, help="oneshot batch_size (its default: 1)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/gpu-dist"), help="checkpoints, artifacts, logs")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "/tmp/gpu-dist/out"))
    ap.add_argument("--wheels", type=Path, default=None, help="install these wheels into WORK/site first")
    ap.add_argument("--ours-python", default=sys.executable)
    ap.add_argument("--peer-python", default=sys.executable)
    ap.add_argument("--job-timeout", type=int, default=240, help="seconds per job, 0 = none (default 240)")
    args = ap.parse_args(argv)
    jobs: list[str] = []
    for name in filter(None, (s.strip() for s in args.only.split(","))):
        if name not in OURS + PEER and name not in ALIASES:
            ap.error(f"--only: unknown job {name!r}; use one of {', '.join(OURS + PEER)} or {', '.join(ALIASES)}")
        jobs += [j for j in ALIASES.get(name, (name,)) if j not in jobs]
    args.jobs = jobs
    args.work, args.out = args.work.resolve(), args.out.resolve()
    if args.wheels is not None:
        args.wheels = args.wheels.resolve()
    args.n_samples = args.n_samples or (8 if args.tiny else 128)
    args.seq_len = args.seq_len or (64 if args.tiny else 512)
    return args


def job_parts(job: str) -> tuple[str, str, str, int]:
    """'ours-72b-gptq-2gpu' -> ('ours', '72b', 'gptq', 2)."""
    runner, shape, method, gpus = job.split("-")
    return runner, shape, method, int(gpus.removesuffix("gpu"))


def torchrun(python: str, ranks: int) -> list[str]:
    return [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]


def job_command(job: str, model: str, args) -> list[str]:
    runner, _, method, gpus = job_parts(job)
    ranks = args.gpus if gpus > 1 else 1
    if runner == "ours":
        script = [str(ROOT / "bench" / "bench_ours.py"), str(write_recipe(method, model, args)),
                  "--out-root", str(args.work / "artifacts" / f"{ranks}")]
        return [*torchrun(args.ours_python, ranks), *script] if ranks > 1 else [args.ours_python, *script]
    return [*torchrun(args.peer_python, ranks), str(ROOT / "bench" / "peers" / "llmc_dist.py"), "--method", method,
            "--model", model, "--out", str(args.work / "artifacts" / f"llmc-{method}-{ranks}"),
            "--n-samples", str(args.n_samples), "--seq-len", str(args.seq_len),
            "--batch-size", str(args.peer_batch_size)]


def per_layer_s(record: dict) -> float | None:
    """Seconds per decoder layer: ours from its run log (after the first layer), the peer's oneshot / layers."""
    if not record.get("ok") or record.get("supported") is False:
        return None
    if record.get("runner") == "ours":
        return record["per_layer"]["mean_after_first_s"]
    return record.get("oneshot_per_layer_s")


def summary(report: dict) -> list[dict]:
    """One row per shape, method and runner: seconds per layer and peak GPU memory at 1 and N ranks, speedup."""
    rows = []
    for shape in SHAPES:
        for method in METHODS:
            for runner in ("ours", "llmc"):
                runs = {g: report["runs"].get(f"{runner}-{shape}-{method}-{g}gpu") for g in GPUS}
                if not any(runs.values()):
                    continue
                row = {"shape": shape, "method": method, "runner": runner}
                for g, r in runs.items():
                    row[f"s_per_layer_{g}"] = per_layer_s(r) if r else None
                    row[f"peak_gib_{g}"] = r.get("peak_gpu_alloc_gib") if r and r.get("ok") else None
                    row[f"status_{g}"] = None if r is None else (
                        "unsupported" if r.get("supported") is False else ("ok" if r.get("ok") else "FAILED"))
                one, two = row["s_per_layer_1"], row["s_per_layer_2"]
                row["speedup"] = round(one / two, 2) if one and two else None
                rows.append(row)
    return rows


def table(report: dict) -> str:
    lines = [f"gpu_dist {report['date']}  device {report['device']}  ranks {report['gpus']}  calibration "
             f"{report['calibration']['n_samples']} x {report['calibration']['seq_len']} tokens",
             f"{'shape':5} {'method':6} {'runner':6} {'s/layer 1':>10} {'s/layer N':>10} {'speedup':>8} "
             f"{'peak GiB 1':>11} {'peak GiB N':>11}"]

    def cell(v, status, width):
        if status in ("unsupported", "FAILED"):
            return f"{status:>{width}}"
        return f"{'-' if v is None else v:>{width}}"

    for r in report["summary"]:
        speedup = "-" if r["speedup"] is None else r["speedup"]
        lines.append(f"{r['shape']:5} {r['method']:6} {r['runner']:6} {cell(r['s_per_layer_1'], r['status_1'], 10)} "
                     f"{cell(r['s_per_layer_2'], r['status_2'], 10)} {speedup:>8} "
                     f"{cell(r['peak_gib_1'], r['status_1'], 11)} {cell(r['peak_gib_2'], r['status_2'], 11)}")
    for name, r in report["runs"].items():
        if r.get("supported") is False:
            lines.append(f"{name}: {r['reason']}")
        elif not r.get("ok"):
            lines.append(f"{name}: FAILED (rc {r.get('rc')})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report, env = start(args, jobs=args.jobs, device=args.device, tiny=args.tiny, gpus=args.gpus)
    report.update(builds={}, runs={})
    if args.device == "cpu":  # torchrun gives each rank one thread; one rank gets one too, or it would use them all
        env["OMP_NUM_THREADS"] = "1"

    def save() -> None:
        report["summary"] = summary(report)
        (args.out / "gpu_dist.json").write_text(json.dumps(report, indent=2, default=str) + "\n")

    for job in args.jobs:
        _, shape, _, _ = job_parts(job)
        big = shape == "72b"
        layers = args.layers_72b if big else args.layers_7b
        name = f"tiny-{shape}" if args.tiny else f"qwen2.5-{shape}-L{layers}"
        if name not in report["builds"]:
            report["builds"][name] = build("qwen2.5-72b" if big else "qwen2.5-7b", name, layers, args, env)
            save()
        b = report["builds"][name]
        if not b["ok"]:
            report["runs"][job] = {"ok": False, "rc": "build failed", "log_tail": b["log_tail"]}
            continue
        report["runs"][job] = run_job(job, job_command(job, b["path"], args), env, args.work, args.out,
                                      args.job_timeout)
        save()
    return finish(report, table(report), save, all(r["ok"] for r in report["runs"].values()))


if __name__ == "__main__":
    raise SystemExit(main())

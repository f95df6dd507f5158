"""Side-by-side GPU benchmark: our AWQ/GPTQ against llm-compressor 0.14 on one random-init model.

On the GPU host (offline; wheels collected by bench/peers/collect_wheels.sh into .whl/):

    python3 bench/gpu_bench.py --wheels .whl                           # the 7B runs (all-7b), logs+JSON in $OUT
    python3 bench/gpu_bench.py --wheels .whl --only ours-awq,llmc-awq  # a subset (fit 10-minute commands)
    python3 bench/gpu_bench.py --wheels .whl --only ours-72b --layers-72b 2   # 72B shape, extrapolated
    python3 bench/gpu_bench.py --tiny --device cpu --peer-python .cache/venv-llmcompressor/bin/python  # CPU test

1. Builds the checkpoint once (bench/build_checkpoint.py: Qwen2.5-7B shape from bench/configs, random init
   on the device, bf16 safetensors under --work; reused when already there with the same spec).
2. Runs each selected job in its own process, so peak GPU memory is that job's alone:
   ours-awq / ours-gptq   bench/bench_ours.py on bench/recipes/bench-{awq,gptq}-g128.yaml (eval off)
   ours-gptq-onepass      the same on bench-gptq-onepass-g128.yaml: true_sequential false, every Hessian of
                          a layer from one forward, as llm-compressor does
   ours-gptq-tf32         the same on bench-gptq-tf32-g128.yaml: advanced.gptq.update tf32 (approximate cross-block update)
   ours-gptq-warm         ours-gptq again: after it, Triton's on-disk cache holds the compiled sweep (steady state)
   ours-awq-warm          ours-awq again: Triton's cache then holds the compiled clip search (a host's later runs)
   ours-awq-classic       AWQ with AutoAWQ's clip search and round-to-nearest (bench-awq-classic-g128.yaml: no
                          per-side clip, no scale refit): the shipped defaults' time against it
   ours-awq-gptq          AWQ's scales and clip grid, GPTQ's rounding (bench-awq-gptq-g128.yaml)
   ours-awq-g32 / -g64 / -g128, ours-gptq-g32 / -g64 / -g128
                          one group size alone (bench-{awq,gptq}-g128.yaml with q_group_size set)
   ours-awq-compare / ours-gptq-compare
                          g32 + g64 + g128 in one shared pass, as `pipeline compare` runs them (bench_ours.py
                          with three recipes); with the three runs alone (aliases compare-awq, compare-gptq,
                          compare) the record's "compare" says: the pass against one run's quantize stage and
                          against the three runs' sum, each variant's share, its checkpoint seconds, and whether
                          every variant's weights are byte-identical to its run alone
   ours-awq-shared-g32 / -g64 / -g128, ours-awq-shared-compare (alias compare-awq-shared)
                          the same with awq.search_group_size 128 (bench-awq-shared-g128.yaml): one scale search
                          for the three variants; its g128 is ours-awq-g128
   llmc-awq / llmc-gptq   bench/peers/llmc_bench.py (oneshot, same calibration token blocks)
   autoround-awq          bench/peers/autoround_quant.py: AutoRound 0.16.1's default recipe (200 iterations a
                          block, batch 8), w4 g128 asymmetric, same calibration token blocks, bfloat16 weights
                          (AutoRound tunes them under autocast on a GPU), exported AutoAWQ GEMM; needs auto-round
                          and py-cpuinfo among the wheels. With --layers its seconds a layer are extrapolated to
                          the config's layers (tuning, packing and saving all count: its one timed call does all)
   ours-72b-awq / -gptq   our pipeline on --layers-72b layers of the Qwen2.5-72B shape, extrapolated to all
                          layers of that config (ours-72b selects both)
3. Writes $OUT/gpu_bench.json (or --out) after every job, so a command cut off at its limit keeps what
   finished, copies each job's log tail beside it, and prints a table: ours vs llm-compressor per stage,
   per layer, peak GPU memory, and the ratio (peer / ours: above 1 means ours is faster or smaller).
A job that fails (crash, timeout) is recorded with its exit code and log tail; the others still run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_table import table  # noqa: E402
COMPARE_GROUPS = (32, 64, 128)  # the group sizes of the comparison jobs
_ALONE = {m: tuple(f"ours-{m}-g{g}" for g in COMPARE_GROUPS) for m in ("awq", "gptq", "awq-shared")}
JOBS = ("ours-awq", "ours-gptq", "llmc-awq", "llmc-gptq", "ours-72b-awq", "ours-72b-gptq", "ours-gptq-onepass",
        "ours-gptq-tf32", "ours-gptq-warm", "ours-awq-warm", "ours-awq-classic", "ours-awq-gptq", *_ALONE["awq"],
        *_ALONE["gptq"], "ours-awq-compare", "ours-gptq-compare", *_ALONE["awq-shared"], "ours-awq-shared-compare",
        "autoround-awq")
# ours first (ours-gptq and ours-awq compile their Triton kernels on a fresh machine, the -warm jobs run them from
# Triton's cache);
# a comparison after its runs alone, so neither side pays a compile the other does not
ALIASES = {"ours-72b": ("ours-72b-awq", "ours-72b-gptq"),
           "all-7b": ("ours-gptq", "ours-gptq-warm", "ours-gptq-onepass", "ours-awq", "llmc-gptq", "llmc-awq"),
           "compare-awq": (*_ALONE["awq"], "ours-awq-compare"), "compare-gptq": (*_ALONE["gptq"], "ours-gptq-compare"),
           "compare-awq-shared": (*_ALONE["awq-shared"], "ours-awq-shared-compare"),
           "compare": (*_ALONE["gptq"], "ours-gptq-compare", *_ALONE["awq"], "ours-awq-compare")}
LOG_TAIL_BYTES = 256 * 1024


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--only", default="all-7b", help=f"comma-separated jobs: {', '.join(JOBS)}; "
                                                     f"aliases: {', '.join(ALIASES)} (default all-7b)")
    ap.add_argument("--layers", type=int, default=None, help="cut the 7B shape to N decoder layers")
    ap.add_argument("--layers-72b", type=int, default=2, help="decoder layers of the 72B shape to run")
    ap.add_argument("--tiny", action="store_true", help="2 layers of hidden 256 (tests the bench on a CPU)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--n-samples", type=int, default=None, help="calibration blocks (default 128; tiny 8)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per block (default 512; tiny 128)")
    ap.add_argument("--peer-batch-size", type=int, default=1, help="oneshot batch_size (its default: 1)")
    ap.add_argument("--batch-size", type=int, default=None, help="our recipes' batch_size (default: the recipe's)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/gpu-bench"), help="checkpoints, artifacts, logs")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "/tmp/gpu-bench/out"))
    ap.add_argument("--wheels", type=Path, default=None, help="install these wheels into WORK/site first and "
                                                              "put it on every job's PYTHONPATH")
    ap.add_argument("--ours-python", default=sys.executable)
    ap.add_argument("--peer-python", default=sys.executable)
    ap.add_argument("--ours-extra", default="", help="extra arguments for bench/bench_ours.py")
    ap.add_argument("--job-timeout", type=int, default=0, help="seconds per job, 0 = none")
    args = ap.parse_args(argv)
    jobs: list[str] = []
    for name in filter(None, (s.strip() for s in args.only.split(","))):
        if name not in JOBS and name not in ALIASES:
            ap.error(f"--only: unknown job {name!r}; use {', '.join(JOBS)} or {', '.join(ALIASES)}")
        jobs += [j for j in ALIASES.get(name, (name,)) if j not in jobs]
    args.jobs = jobs
    args.work, args.out = args.work.resolve(), args.out.resolve()  # jobs run with cwd = the repository root
    if args.wheels is not None:
        args.wheels = args.wheels.resolve()
    args.n_samples = args.n_samples or (8 if args.tiny else 128)
    args.seq_len = args.seq_len or (128 if args.tiny else 512)
    return args


def install_wheels(wheels: Path, site: Path) -> dict:
    """pip install --no-index --no-deps every wheel in `wheels` into `site` (skipped when already done)."""
    files = sorted(p.name for p in wheels.glob("*.whl"))
    if not files:
        raise SystemExit(f"error: --wheels {wheels} holds no .whl files; run bench/peers/collect_wheels.sh {wheels}")
    stamp = site / ".installed.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == files:
        return {"wheels": files, "reused": True}
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--no-cache-dir", "--upgrade", "--target", str(site), *(str(wheels / f) for f in files)]
    subprocess.run(cmd, check=True)
    stamp.write_text(json.dumps(files))
    return {"wheels": files, "reused": False}


def child_env(site: Path | None) -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", TQDM_DISABLE="1",
               TOKENIZERS_PARALLELISM="false")
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH", "")]))
    return env


def run_job(name: str, cmd: list[str], env: dict, work: Path, out: Path, timeout: int) -> dict:
    """Run one job's process; its log goes to WORK/logs and its tail to OUT -> the job's record."""
    log = work / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    result = work / "results" / f"{name}.json"
    result.parent.mkdir(parents=True, exist_ok=True)
    result.unlink(missing_ok=True)
    print(f"== {name}: {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    with log.open("wb") as fh:
        try:
            rc = subprocess.run([*cmd, "--json", str(result)], stdout=fh, stderr=subprocess.STDOUT, env=env,
                                cwd=ROOT, timeout=timeout or None).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = round(time.perf_counter() - t0, 2)
    tail = log.read_bytes()[-LOG_TAIL_BYTES:]
    (out / f"{name}.log").write_bytes(tail)
    if rc == 0 and result.is_file():
        record = {"ok": True, "wall_s": wall, **json.loads(result.read_text())}
    else:
        record = {"ok": False, "rc": rc, "wall_s": wall, "log_tail": tail[-4000:].decode(errors="replace")}
    print(f"== {name}: {'ok' if record['ok'] else 'FAILED rc=' + str(rc)} in {wall} s", flush=True)
    return record


def build(config: str, name: str, layers: int | None, args, env: dict) -> dict:
    """Build (or reuse) the checkpoint WORK/ckpt/<name> -> build record (path, spec, params, build_s)."""
    out = args.work / "ckpt" / name
    cmd = [args.ours_python, str(ROOT / "bench" / "build_checkpoint.py"), "--config",
           str(ROOT / "bench" / "configs" / config), "--out", str(out), "--device", args.device]
    cmd += ["--tiny"] if args.tiny else []
    cmd += ["--layers", str(layers)] if layers is not None else []
    print(f"== build {name}", flush=True)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if p.returncode != 0:
        return {"ok": False, "rc": p.returncode, "log_tail": (p.stdout + p.stderr)[-4000:]}
    record = json.loads(p.stdout.strip().splitlines()[-1])
    print(f"== build {name}: {record['params'] / 1e9:.2f} B params, {'reused' if record['reused'] else 'built'} "
          f"in {time.perf_counter() - t0:.1f} s", flush=True)
    return {"ok": True, **record}


def write_recipe(method: str, model: str, args, group: int | None = None) -> Path:
    """A recipe inheriting bench/recipes/bench-<method>-g128.yaml with this run's model, device and sizes (and
    group size: the recipe is then named ...-g<group>, the same for its run alone and in a comparison)."""
    base = ROOT / "bench" / "recipes" / f"bench-{method}-g128.yaml"
    name = f"bench-{method}-{Path(model).name}" + (f"-g{group}" if group else "")
    path = args.work / "recipes" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    recipe = {"name": name, "base": str(base), "model": model, "device": args.device,
              "calibration": {"n_samples": args.n_samples, "seq_len": args.seq_len}}
    if group:
        recipe["q_group_size"] = group
    if args.batch_size is not None:
        recipe["batch_size"] = args.batch_size
    path.write_text(yaml.safe_dump(recipe))
    return path


def job_command(job: str, model: str, args) -> list[str]:
    method = job.split("-", 1)[1].removeprefix("72b-").removesuffix("-warm")  # awq | gptq | gptq-onepass | ...
    groups = _groups(job)
    if groups:  # a group size alone, or the comparison of all three in one pass
        method = job.removeprefix("ours-").removesuffix("-compare").rsplit("-g", 1)[0]
        return [args.ours_python, str(ROOT / "bench" / "bench_ours.py"),
                *(str(write_recipe(method, model, args, g)) for g in groups),
                "--out-root", str(args.work / "artifacts"), *args.ours_extra.split()]
    if job.startswith("ours"):
        return [args.ours_python, str(ROOT / "bench" / "bench_ours.py"), str(write_recipe(method, model, args)),
                "--out-root", str(args.work / "artifacts"), *args.ours_extra.split()]
    if job == "autoround-awq":
        return [args.peer_python, str(ROOT / "bench" / "peers" / "autoround_quant.py"), "--recipe", "default",
                "--model", model, "--out", str(args.work / "artifacts" / f"autoround-{Path(model).name}"),
                "--device", args.device, "--n-samples", str(args.n_samples), "--seq-len", str(args.seq_len),
                "--group-size", "128", "--compute-dtype", "bfloat16"]
    return [args.peer_python, str(ROOT / "bench" / "peers" / "llmc_bench.py"), "--method", method,
            "--model", model, "--out", str(args.work / "artifacts" / f"llmc-{method}-{Path(model).name}"),
            "--device", args.device, "--n-samples", str(args.n_samples), "--seq-len", str(args.seq_len),
            "--batch-size", str(args.peer_batch_size)]


def _groups(job: str) -> tuple[int, ...]:
    """The group sizes a comparison job (or one of its runs alone) quantizes; () for every other job."""
    if job.endswith("-compare"):
        return COMPARE_GROUPS
    alone = [g for m, jobs in _ALONE.items() for j, g in zip(jobs, COMPARE_GROUPS) if j == job]
    return tuple(alone)


def compare_summary(runs: dict) -> dict:
    """Each method's shared pass against its runs alone (the jobs' records) -> per method: the pass's quantize
    stage, one run's (g128) and the three runs' sum, the ratios the goals name, each variant's share, the
    checkpoint seconds, and per variant whether its weights equal its run alone's."""
    out = {}
    for method, alone_jobs in _ALONE.items():
        shared = runs.get(f"ours-{method}-compare")
        alone = [runs.get(j) for j in alone_jobs]
        if not shared or not shared.get("ok") or not all(a and a.get("ok") for a in alone):
            continue
        q_alone = {a["recipe"]: a["stages_s"]["quantize"] for a in alone}
        one, total, q = alone[-1]["stages_s"]["quantize"], sum(q_alone.values()), shared["stages_s"]["quantize"]
        out[method] = {
            "compare_quantize_s": q, "one_run_quantize_s": one, "separate_quantize_s": round(total, 3),
            "compare_over_one_run": round(q / one, 3), "compare_over_separate": round(q / total, 3),
            "alone_quantize_s": q_alone, "per_variant_s": shared["shared_pass"]["per_variant_s"],
            "pass_seconds": shared.get("pass_seconds"),
            "compare_process_s": shared["process_s"], "separate_process_s": round(sum(a["process_s"] for a in alone), 2),
            "byte_identical": {a["recipe"]: shared["variants_weights_sha256"].get(a["recipe"]) == a["weights_sha256"]
                               for a in alone}}
    return out


def extrapolate(record: dict, total_layers: int) -> dict:
    """Our per-layer time on a few layers -> the quantize stage for all `total_layers` layers, and a bound on the
    whole pass's peak GPU memory: one layer is on the GPU at a time, but the results (codes, scales, zeros) stay
    on the device until they fill `methods.layer.RESULTS_DEVICE_SHARE` of it, then go to the host."""
    from quantize.methods.layer import RESULTS_DEVICE_SHARE

    per = record["per_layer"]["mean_after_first_s"]
    total = record.get("gpu_total_gib")
    bound = round(record["peak_gpu_alloc_gib"] + RESULTS_DEVICE_SHARE * total, 2) \
        if total and record.get("peak_gpu_alloc_gib") is not None else None
    return {"total_layers": total_layers, "measured_layers": record["per_layer"]["n"], "per_layer_s": per,
            "quantize_s": round(per * total_layers, 1), "peak_gpu_alloc_bound_gib": bound,
            "note": "quantize stage only: per-layer mean (after the first layer when more than one ran) x "
                    "layers; load and export grow with the checkpoint and are not extrapolated. Layers whose "
                    "results no longer fit the device share copy them to the host, which the few measured "
                    "layers never do: the time is a lower estimate. Peak GPU memory: at most the measured peak "
                    f"plus {RESULTS_DEVICE_SHARE:.0%} of the device (the results kept there)"}


def start(args, **header) -> tuple[dict, dict]:
    """A benchmark's folders, its record's header and its children's environment (the wheels installed first when
    --wheels names them) -> (record, environment)."""
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": sys.argv, **header,
                    "calibration": {"n_samples": args.n_samples, "seq_len": args.seq_len}}
    site = None
    if args.wheels is not None:
        site = args.work / "site"
        report["wheels"] = install_wheels(args.wheels, site)
    return report, child_env(site)


def finish(report: dict, text: str, save, ok: bool) -> int:
    """The printed table also goes into the JSON record (saved once more) -> the command's exit status."""
    report["table"] = text.splitlines()
    save()
    print(text)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report, env = start(args, jobs=args.jobs, device=args.device, tiny=args.tiny)
    report.update(builds={}, runs={})

    def save() -> None:
        (args.out / "gpu_bench.json").write_text(json.dumps(report, indent=2, default=str) + "\n")

    for job in args.jobs:
        big = "72b" in job
        name = ("tiny-72b" if big else "tiny-7b") if args.tiny else \
            (f"qwen2.5-72b-L{args.layers_72b}" if big else f"qwen2.5-7b-L{args.layers or 28}")
        if name not in report["builds"]:
            layers = args.layers_72b if big else args.layers
            report["builds"][name] = build("qwen2.5-72b" if big else "qwen2.5-7b", name, layers, args, env)
            save()
        b = report["builds"][name]
        if not b["ok"]:
            report["runs"][job] = {"ok": False, "rc": "build failed", "log_tail": b["log_tail"]}
            continue
        record = run_job(job, job_command(job, b["path"], args), env, args.work, args.out, args.job_timeout)
        # the record holds each artifact's hashes; the next job needs the disk (a 7B checkpoint plus three
        # artifacts fill the GPU host's)
        shutil.rmtree(args.work / "artifacts", ignore_errors=True)
        if big and record["ok"] and record["per_layer"]["n"]:
            cfg = json.loads((ROOT / "bench" / "configs" / "qwen2.5-72b" / "config.json").read_text())
            record["extrapolated"] = extrapolate(record, cfg["num_hidden_layers"])
        if job.startswith("autoround") and record["ok"] and not args.tiny:
            cfg = json.loads((Path(b["path"]) / "config.json").read_text())
            full = json.loads((ROOT / "bench" / "configs" / "qwen2.5-7b" / "config.json").read_text())
            per = record["quantize_and_save_s"] / cfg["num_hidden_layers"]
            record["extrapolated"] = {"measured_layers": cfg["num_hidden_layers"],
                                      "total_layers": full["num_hidden_layers"], "per_layer_s": round(per, 2),
                                      "quantize_and_save_s": round(per * full["num_hidden_layers"], 1)}
        report["runs"][job] = record
        report["compare"] = compare_summary(report["runs"])
        save()
    return finish(report, table(report), save, all(r["ok"] for r in report["runs"].values()))


if __name__ == "__main__":
    raise SystemExit(main())

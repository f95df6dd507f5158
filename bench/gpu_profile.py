"""Where the GPU time goes (issue 6): linear-algebra micro-timings and a torch.profiler trace of our pass.

On the GPU host (offline):

    python3 bench/gpu_profile.py --layers 5 --methods gptq,awq

1. Micro-timings at Qwen2.5-7B sizes (65,536 tokens): the Hessian product XᵀX for the 3584- and 18944-wide
   inputs (TF32 on fp32 copies, as `gptq.HessianAccumulator` did before, vs a bf16 GEMM with fp32 output), and
   the GPTQ inverse's parts for n = 18944 (Cholesky, triangular inverse).
2. Builds a random-init Qwen2.5-7B-shaped checkpoint cut to --layers decoder layers and runs our pipeline
   (eval off) on it once per method under torch.profiler; writes the top operators by device time and by
   host time, and the manifest's per-stage seconds, to $OUT/profile-<method>.txt and $OUT/gpu_profile.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402


def _time(fn, reps: int = 3) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


def micro(tokens: int = 65536) -> dict:
    out: dict = {}
    g = torch.Generator(device="cuda").manual_seed(0)
    for n in (3584, 18944):
        x = torch.randn(tokens, n, device="cuda", generator=g).to(torch.bfloat16)

        def tf32():
            xf = x.float()
            torch.set_float32_matmul_precision("high")
            h = torch.zeros(n, n, device="cuda")
            h.addmm_(xf.t(), xf, alpha=2.0 / tokens)
            torch.set_float32_matmul_precision("highest")
            return h

        def bf16_out32():
            return torch.mm(x.t(), x, out_dtype=torch.float32)

        rec = {"tf32_s": _time(tf32)}
        try:
            rec["bf16_out_fp32_s"] = _time(bf16_out32)
            a, b = tf32(), bf16_out32() * (2.0 / tokens)
            rec["max_rel_diff"] = ((a - b).abs().max() / a.abs().max()).item()
        except Exception as e:  # noqa: BLE001
            rec["bf16_out_fp32_error"] = repr(e)[:300]
        out[f"hessian_{n}"] = rec
        del x
    n = 18944
    a = torch.randn(n, n, device="cuda", generator=g) / n**0.5
    H = a @ a.t() + 0.01 * torch.eye(n, device="cuda")
    eye = torch.eye(n, device="cuda")
    rec = {"cholesky_s": _time(lambda: torch.linalg.cholesky_ex(H.flip(0, 1)), 2)}
    L = torch.linalg.cholesky_ex(H.flip(0, 1))[0]
    rec["solve_triangular_eye_s"] = _time(lambda: torch.linalg.solve_triangular(L, eye, upper=False), 2)
    rec["flip_s"] = _time(lambda: H.flip(0, 1), 2)
    out["inverse_18944"] = rec
    del a, H, eye, L
    torch.cuda.empty_cache()
    return {k: {kk: (round(vv, 5) if isinstance(vv, float) else vv) for kk, vv in v.items()} for k, v in out.items()}


def profile_run(method: str, model: str, bench_args, out: Path) -> dict:
    """Our run of bench/recipes/bench-<method>-g128.yaml on `model` (recipe written as gpu_bench writes it)
    under torch.profiler -> timings; the operator tables go to out/profile-<method>.txt."""
    from torch.profiler import ProfilerActivity, profile

    from bench import gpu_bench
    from quantize import runner

    recipe = gpu_bench.write_recipe(method, model, bench_args)
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        art = runner.run(str(recipe), out_root=str(bench_args.work / "artifacts"), force=True)
    wall = time.perf_counter() - t
    man = json.loads((art / "manifest.json").read_text())
    ka = prof.key_averages()
    text = [f"{method}: wall {wall:.1f} s under the profiler", json.dumps(man.get("timings_s")),
            json.dumps(man.get("pass_seconds")), "",
            ka.table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=60), "",
            ka.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=60)]
    (out / f"profile-{method}.txt").write_text("\n".join(text) + "\n")
    return {"wall_s": round(wall, 2), "timings_s": man.get("timings_s"), "pass_seconds": man.get("pass_seconds")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--methods", default="gptq,awq")
    ap.add_argument("--n-samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--skip-micro", action="store_true")
    ap.add_argument("--work", type=Path, default=Path("/tmp/gpu-profile"))
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "/tmp/gpu-profile/out"))
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    if not args.skip_micro:
        report["micro"] = micro()
        print(json.dumps(report["micro"], indent=1), flush=True)
    from bench import gpu_bench

    bench_args = gpu_bench.parse_args(["--work", str(args.work), "--layers", str(args.layers),
                                       "--n-samples", str(args.n_samples), "--seq-len", str(args.seq_len)])
    built = gpu_bench.build("qwen2.5-7b", f"qwen2.5-7b-L{args.layers}", args.layers, bench_args,
                            gpu_bench.child_env(None))
    if not built["ok"]:
        raise SystemExit(f"building the checkpoint failed:\n{built['log_tail']}")
    for m in args.methods.split(","):
        report[m] = profile_run(m, built["path"], bench_args, args.out)
        print(m, json.dumps(report[m]), flush=True)
        (args.out / "gpu_profile.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

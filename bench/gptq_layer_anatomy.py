"""Where one decoder layer's GPTQ time goes, part by part, on a model's shapes: the product's own functions on
random inputs of a Qwen2.5-7B layer's sizes (or `--tiny`), each part timed alone after a warm-up.

Parts, per linear group of a layer (q/k/v, o, gate/up, down):
- the Hessian's Gram products (`gptq_sweep.HessianAccumulator`), beside other ways to form the same XᵀX: one
  product, a transposed copy first, other block sizes, and a bfloat16-output product (a speed reference only:
  its H is not float32-exact);
- the sweep (`gptq_sweep.gptq_quantize` with the device's sweep), and within it the factorisation
  (`_factor_launch`) and the cross-block updates (`lazy_update`'s GEMMs alone, in float32);
- the relative output error's products (`output_error.from_hessian`), and the same numerator taken from the
  sweep's own loss: tr(ΔW H ΔWᵀ) = 2·Σ row_loss − λ·mean(diag H')·‖D‖² − ‖D_dead‖² (exact for both of GPTQ's
  feedback forms; D = W − Q with dead columns zeroed, H' the sweep's H), and the denominator's product alone.

    python3 bench/gptq_layer_anatomy.py --json OUT.json            (GPU host: Qwen2.5-7B shapes)
    python bench/gptq_layer_anatomy.py --tiny --device cpu         (the same parts on small shapes)

Figures are medians over --reps timed calls after one untimed call; on CUDA each call is bracketed by
synchronisations, so parts that overlap in a run (the side stream's factorisation) are timed alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from quantize.methods.kernels import gptq_sweep  # noqa: E402
from quantize.methods import gptq_sweep as gptq, output_error  # noqa: E402
from quantize.methods.primitives import dequantize  # noqa: E402

# name -> (out_features, in_features); Qwen2.5-7B: hidden 3584, intermediate 18944, 28 query / 4 key-value heads of 128
SHAPES_7B = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}
SHAPES_TINY = {"qkv": (96, 64), "o": (64, 64), "gate_up": (256, 64), "down": (64, 128)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, reps: int) -> float:
    """Median seconds of `reps` calls of fn after one untimed call."""
    fn()
    _sync(device)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def _blocked_gram(x: torch.Tensor, block: int) -> torch.Tensor:
    n = x.shape[1]
    h = torch.zeros(n, n, dtype=torch.float32, device=x.device)
    for i in range(0, n, block):
        for j in range(i, n, block):
            h[i : i + block, j : j + block].add_(torch.mm(x[:, i : i + block].t(), x[:, j : j + block],
                                                          out_dtype=torch.float32))
    return h


def grams(x: torch.Tensor, reps: int) -> dict:
    """Seconds (and TFLOP/s on the products' useful work, 2·tokens·in² for the whole XᵀX) per way of forming XᵀX."""
    device, (t, n) = x.device, x.shape
    flop = 2.0 * t * n * n

    def current():
        acc = gptq.HessianAccumulator(n, device)
        acc.add(x)
        return acc.H
    ways = {"current": current}
    if x.is_cuda and x.dtype in (torch.float16, torch.bfloat16):
        ways["one_product"] = lambda: torch.mm(x.t(), x, out_dtype=torch.float32)
        ways["transposed_copy"] = lambda: torch.mm(x.t().contiguous(), x, out_dtype=torch.float32)
        ways["bf16_output_reference"] = lambda: torch.mm(x.t(), x)
        for b in (2048, 8192):
            if n >= 2 * b:
                ways[f"upper_blocks_{b}"] = lambda b=b: _blocked_gram(x, b)
    out = {}
    for name, fn in ways.items():
        s = timed(fn, device, reps)
        out[name] = {"s": round(s, 5), "tflops_useful": round(flop / s / 1e12, 1)}
    ref = current()
    if "one_product" in ways:
        other = torch.mm(x.t(), x, out_dtype=torch.float32).mul_(2.0 / t)
        out["one_product"]["max_rel_diff_vs_current"] = float((other - ref).abs().max() / ref.abs().max())
    return out


def numerator_from_sweep(w: torch.Tensor, r: gptq.GptqResult, H: torch.Tensor) -> torch.Tensor:
    """tr(ΔW H ΔWᵀ) from the sweep's loss (see the module's docstring)."""
    diag = H.diagonal()
    dead = diag == 0
    swept = torch.where(dead, torch.ones_like(diag), diag)
    d = w.float().masked_fill(dead, 0) - dequantize(r.codes, r.scales, r.zeros)
    sq = d.square()
    return 2 * r.row_loss.sum() - r.damp_used * swept.mean() * sq.sum() - sq[:, dead].sum()


def lazy_updates(w: torch.Tensor, block: int, device: torch.device, reps: int) -> float:
    """Seconds of the sweep's cross-block updates alone: every block's W[:, i2:] += D1 @ A[i1:i2, i2:] (float32)."""
    out_f, in_f = w.shape
    W = w.float().clone()
    A = torch.randn(in_f, in_f, device=device).triu_().mul_(1e-3)
    D1 = torch.randn(out_f, block, device=device)

    def run():
        for i1 in range(0, in_f, block):
            i2 = min(i1 + block, in_f)
            if i2 < in_f:
                W[:, i2:].addmm_(D1[:, : i2 - i1], A[i1:i2, i2:])
    return timed(run, device, reps)


def problem(shape: tuple[int, int], H: torch.Tensor, spec: gptq.GptqSpec, sweep, dtype, reps: int) -> dict:
    device = H.device
    out_f, in_f = shape
    w = (torch.randn(out_f, in_f, device=device) * 0.02).to(dtype)
    res = {"shape": list(shape)}
    res["factorisation_s"] = round(timed(lambda: gptq._factor_launch(H, spec.damp, not spec.act_order), device,
                                         reps), 5)
    res["sweep_total_s"] = round(timed(lambda: gptq.gptq_quantize(w, H, spec, sweep=sweep), device, reps), 5)
    res["lazy_updates_float32_s"] = round(lazy_updates(w, spec.block_size, device, reps), 5)
    r = gptq.gptq_quantize(w, H, spec, sweep=sweep)
    q32 = dequantize(r.codes, r.scales, r.zeros)
    q = q32.to(dtype)
    res["output_error_s"] = round(timed(lambda: output_error.from_hessian(w, q, H), device, reps), 5)
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    w32 = w.float()
    res["denominator_only_s"] = round(timed(lambda: ((w32.to(dt) @ H.to(dt)).float() * w32).sum(), device, reps), 5)
    res["numerator_from_sweep_s"] = round(timed(lambda: numerator_from_sweep(w, r, H), device, reps), 5)
    d64 = (w32 - q32).double()
    exact = torch.einsum("oi,ij,oj->", d64, H.double(), d64)
    res["numerator_rel_diff_vs_float64"] = float((numerator_from_sweep(w, r, H).double() - exact).abs() / exact)
    res["sweep_kernel"] = r.kernel
    return res


def table(record: dict) -> str:
    """The record's parts in milliseconds, one column per linear group (Markdown)."""
    rows = [("Gram XᵀX of the input", lambda p: record["grams"][str(p["shape"][1])]["current"]["s"]),
            ("factorisation", lambda p: p["factorisation_s"]), ("whole sweep", lambda p: p["sweep_total_s"]),
            ("float32 cross-block updates", lambda p: p["lazy_updates_float32_s"]),
            ("output error's products", lambda p: p["output_error_s"]),
            ("its numerator from the sweep's loss", lambda p: p["numerator_from_sweep_s"])]
    names = list(record["problems"])
    out = [f"| ms, {record['device']} | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for label, get in rows:
        out.append(f"| {label} | " + " | ".join(f"{1e3 * get(record['problems'][n]):.1f}" for n in names) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="small shapes (a CPU check of the script)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=None, help="calibration tokens (default 65536; --tiny 512)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    try:
        device = torch.device(a.device)
    except RuntimeError:
        print(f"error: --device {a.device!r} is not a torch device; use cuda or cpu", file=sys.stderr)
        return 2
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device here; run on the GPU host or pass --tiny --device cpu", file=sys.stderr)
        return 2
    if a.reps < 1:
        print("error: --reps must be at least 1", file=sys.stderr)
        return 2
    if a.tokens is not None and a.tokens < 1:
        print("error: --tokens must be at least 1 (or leave it out: 65536, --tiny 512)", file=sys.stderr)
        return 2
    if a.json is not None and not a.json.parent.is_dir():
        print(f"error: --json {a.json}: its folder {a.json.parent} does not exist; create it or name another file",
              file=sys.stderr)
        return 2
    shapes = SHAPES_TINY if a.tiny else SHAPES_7B
    tokens = a.tokens or (512 if a.tiny else 65536)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    spec = gptq.GptqSpec(4, 32 if a.tiny else 128, False, 32 if a.tiny else 128, 0.01, True, dtype, "float32")
    sweep = gptq_sweep("auto", device)
    record: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "tokens": tokens, "dtype": str(dtype), "group": spec.group,
                    "grams": {}, "problems": {}}
    hessians = {}
    for width in sorted({s[1] for s in shapes.values()}):
        x = (torch.randn(tokens, width, device=device) * torch.rand(width, device=device).add_(0.1)).to(dtype)
        record["grams"][str(width)] = grams(x, a.reps)
        acc = gptq.HessianAccumulator(width, device)
        acc.add(x)
        hessians[width] = acc.H.clone()
        del x, acc
        print(json.dumps({"gram": width, **record["grams"][str(width)]}), flush=True)
    for name, shape in shapes.items():
        record["problems"][name] = problem(shape, hessians[shape[1]], spec, sweep, dtype, a.reps)
        print(json.dumps({"problem": name, **record["problems"][name]}), flush=True)
    print(table(record), flush=True)
    if a.json:
        a.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""GPTQ column sweep, torch vs Triton, on Qwen2.5-7B-shaped matrices: time per matrix, identical codes, loss.

Self-contained: needs only torch (+ triton for the Triton sweep) and this repository; no model, no network.
Per decoder layer of Qwen2.5-7B, the linears sharing a Hessian are quantized together (as `engine.gptq_layer`
does), so one layer is four sweeps: q/k/v [4608, 3584], o [3584, 3584], gate/up [37888, 3584], down
[3584, 18944]. Each Hessian comes from random correlated activations (65,536 tokens, fp32); its
accumulation time is reported too (the other half of GPTQ's per-layer cost).

    python bench/gptq_kernel_check.py                        # CUDA, full shapes (< 3 min on an H200)
    python bench/gptq_kernel_check.py --device cpu --small   # CPU smoke (Triton under TRITON_INTERPRET=1)

Writes gptq_kernel_check.json to $OUT (or /tmp) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from quantize import gptq  # noqa: E402

FULL = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}
SMALL = {"qkv": (160, 128), "o": (128, 128), "gate_up": (320, 128), "down": (128, 256)}
LAYERS = 28  # Qwen2.5-7B


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hessian(in_f: int, tokens: int, device: torch.device, seed: int) -> tuple[torch.Tensor, float]:
    """Random correlated activations [tokens, in_f] (heavy-tailed channel scales, low-rank mixing, as in
    real hidden states) -> (H [in_f, in_f] fp32, seconds spent accumulating it)."""
    g = torch.Generator(device=device).manual_seed(seed)
    col_scale = torch.exp(torch.randn(in_f, generator=g, device=device))  # [in]
    mix = torch.randn(32, in_f, generator=g, device=device) / 4  # [32, in]
    acc = gptq.HessianAccumulator(in_f, device)
    spent = 0.0
    chunk = 8192
    for t0 in range(0, tokens, chunk):
        n = min(chunk, tokens - t0)
        x = torch.randn(n, in_f, generator=g, device=device) * col_scale + torch.randn(n, 32, generator=g,
                                                                                       device=device) @ mix
        x = x.to(torch.bfloat16)  # [n, in]: the compute dtype the capture loop hands over
        _sync(device)
        t = time.perf_counter()
        acc.add(x)
        _sync(device)
        spent += time.perf_counter() - t
    return acc.H, spent


def timed(W: torch.Tensor, H: torch.Tensor, spec: gptq.GptqSpec) -> tuple[gptq.GptqResult, float]:
    _sync(W.device)
    t = time.perf_counter()
    r = gptq.gptq_quantize(W, H, spec)
    _sync(W.device)
    return r, time.perf_counter() - t


def compare(name: str, W: torch.Tensor, H: torch.Tensor, spec: gptq.GptqSpec, kernels: list[str]) -> dict:
    """Quantize W with each kernel -> times, losses and agreement with the first kernel."""
    row: dict = {"matrix": name, "shape": list(W.shape), "spec": {k: str(v) for k, v in asdict(spec).items()}}
    results = {}
    for k in kernels:
        try:
            results[k], row[f"{k}_s"] = timed(W, H, replace(spec, kernel=k))
            row[f"{k}_loss"] = results[k].loss
        except Exception as e:  # record and go on: one failing kernel must not hide the others' numbers
            row[f"{k}_error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
    if len(results) == 2:
        a, b = results.values()
        row["codes_equal_frac"] = (a.codes == b.codes).float().mean().item()
        row["codes_max_abs_diff"] = (a.codes.int() - b.codes.int()).abs().max().item()
        row["scales_equal"] = torch.equal(a.scales, b.scales)
        row["zeros_equal"] = torch.equal(a.zeros, b.zeros)
        row["speedup"] = row[f"{kernels[0]}_s"] / row[f"{kernels[1]}_s"]
    return row


def warm_up(device: torch.device, specs: list[gptq.GptqSpec]) -> None:
    """Compile the Triton kernel once per configuration, outside the timings."""
    W = torch.randn(64, 256, device=device)
    x = torch.randn(512, 256, device=device)
    H = x.t() @ x  # a real SPD H: its Cholesky factor has the strides (hence the compiled variant) of the runs
    for spec in specs:
        gptq.gptq_quantize(W, H, replace(spec, kernel="triton"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke)")
    ap.add_argument("--tokens", type=int, default=None, help="calibration tokens (default 65536; 2048 with --small)")
    ap.add_argument("--kernels", default="torch,triton")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device; run with --device cpu --small (and TRITON_INTERPRET=1 for the Triton sweep)")
    shapes = SMALL if args.small else FULL
    tokens = args.tokens or (2048 if args.small else 65536)
    kernels = args.kernels.split(",")
    main_spec = gptq.GptqSpec(4, 128, True, 128, 0.01, act_order=True, scale_dtype=torch.float16)  # qwen7b recipe
    extra = {  # the kernel's other paths, on the o shape: groups computed during the sweep, per-channel
        "o/no-act-order-g128": replace(main_spec, act_order=False),
        "o/no-act-order-g32-asym-bf16": replace(main_spec, act_order=False, group=32, sym=False,
                                                scale_dtype=torch.bfloat16),
        "o/no-act-order-g64-sym-fp16": replace(main_spec, act_order=False, group=64),
        "o/act-order-g64": replace(main_spec, group=64),
        "o/per-channel": replace(main_spec, group=-1),
    }
    report: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
                    "torch": torch.__version__, "tokens": tokens, "rows": [], "hessian_s": {}}
    try:
        import triton

        report["triton"] = triton.__version__
        if "triton" in kernels:
            warm_up(device, [main_spec, *extra.values()])
    except Exception as e:
        report["triton_error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    t_all = time.perf_counter()
    Hs = {}
    for name, (out_f, in_f) in shapes.items():
        if in_f not in Hs:
            Hs[in_f], report["hessian_s"][str(in_f)] = hessian(in_f, tokens, device, seed=in_f)
            _sync(device)
            t = time.perf_counter()
            gptq._feedback_factor(Hs[in_f], main_spec.damp, textbook=not main_spec.act_order)  # in every sweep's time
            _sync(device)
            report.setdefault("feedback_factor_s", {})[str(in_f)] = time.perf_counter() - t
        W = (torch.randn(out_f, in_f, device=device) * 0.02).half()
        report["rows"].append(compare(name, W, Hs[in_f], main_spec, kernels))
        print(json.dumps(report["rows"][-1]), flush=True)
    o_out, o_in = shapes["o"]
    W = (torch.randn(o_out, o_in, device=device) * 0.02).half()
    for name, spec in extra.items():
        report["rows"].append(compare(name, W, Hs[o_in], spec, kernels))
        print(json.dumps(report["rows"][-1]), flush=True)
    main_rows = report["rows"][: len(shapes)]
    for k in kernels:
        if all(f"{k}_s" in r for r in main_rows):
            layer = sum(r[f"{k}_s"] for r in main_rows)
            report[f"{k}_per_layer_s"] = layer
            report[f"{k}_28_layers_s"] = layer * LAYERS
    # Hessians per layer: q/k/v, o, gate/up on hidden (3 accumulations) + down on intermediate (1)
    h_hidden, h_inter = report["hessian_s"][str(shapes["o"][1])], report["hessian_s"][str(shapes["down"][1])]
    report["hessian_per_layer_s"] = 3 * h_hidden + h_inter
    report["wall_s"] = time.perf_counter() - t_all
    _print_table(report, kernels)
    out = Path(os.environ.get("OUT") or "/tmp") / "gptq_kernel_check.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


def _print_table(report: dict, kernels: list[str]) -> None:
    print(f"\n{'matrix':30s} " + " ".join(f"{k + ' s':>10s}" for k in kernels)
          + f" {'speedup':>8s} {'codes eq':>9s} {'scales/zeros eq':>16s}")
    for r in report["rows"]:
        times = " ".join(f"{r.get(f'{k}_s', float('nan')):10.3f}" for k in kernels)
        print(f"{r['matrix']:30s} {times} {r.get('speedup', float('nan')):8.1f} "
              f"{r.get('codes_equal_frac', float('nan')):9.6f} "
              f"{str(r.get('scales_equal'))}/{str(r.get('zeros_equal')):>10s}")
    for k in kernels:
        if f"{k}_per_layer_s" in report:
            print(f"{k}: {report[f'{k}_per_layer_s']:.3f} s per layer of sweeps, "
                  f"{report[f'{k}_28_layers_s']:.1f} s for 28 layers")
    print(f"Hessian accumulation: {report['hessian_per_layer_s']:.3f} s per layer ({report['hessian_s']})")
    print(f"of which in every sweep, the feedback factor of H: {report['feedback_factor_s']}")


if __name__ == "__main__":
    main()

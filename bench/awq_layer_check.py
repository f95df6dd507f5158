"""Time our AWQ on ONE Qwen2.5-7B-shaped decoder layer: exhaustive search vs the recipe defaults (issue 6).

    python bench/awq_layer_check.py                      (on a CUDA host; < 3 min on an H200)
    python bench/awq_layer_check.py --device cpu --small (structure check at toy shapes; no timings worth reading)

Builds a one-layer Qwen2ForCausalLM from bench/configs/qwen2.5-7b/config.json (random init, bf16; vocab cut
to 512 since only layer 0 is used), takes the layer's keyword arguments (positions, mask) from capture's
own first_layer_inputs as the pipeline does, but feeds random calibration hidden states [128, 512, 3584]
with heavy-tailed channel scales (real residual streams have outlier channels). Then, for each search
setting: restore the FP layer, capture features (capture.forward_with_features), run engine.awq_layer,
and measure the layer-output MSE against the FP layer over every calibration token. Prints and writes
JSON ($OUT/awq_layer_check.json, or /tmp/awq_layer_check.json): seconds per layer and per sub-stage,
chosen ratios, ratios evaluated, MSE (and MSE relative to round-to-nearest), peak device memory.
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

from quantize import engine  # noqa: E402
from quantize.arch import arch_for, layer_prefix  # noqa: E402
from quantize.capture import LayerData, first_layer_inputs, forward_with_features, layer_forward  # noqa: E402
from quantize.recipe import Recipe  # noqa: E402

# name -> awq options; "defaults" takes AwqOptions' defaults, the others override them
VARIANTS = {
    "exhaustive": dict(search_tokens=None, coarse_step=1, grid_batch=1),  # the search before issue 6
    "defaults": {},
    "coarse": dict(coarse_step=4),  # defaults + coarse-to-fine (9 of 20 points; costs quality, see BENCHMARKS)
    "coarse_only": dict(search_tokens=None, coarse_step=4),  # every token, coarse-to-fine
}


def build(args, device: torch.device):
    """-> (model with one decoder layer on `device`, arch, per-batch inputs and kwargs)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(ROOT / "bench" / "configs" / "qwen2.5-7b")
    cfg.num_hidden_layers, cfg.vocab_size = 1, 512
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:1]
    if args.small:
        cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads = 256, 1024, 4, 2
        cfg.head_dim = 64
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=args.dtype)
    model.eval()
    arch = arch_for(cfg)
    ids = torch.randint(0, cfg.vocab_size, (args.samples, args.seq_len))
    _, per_layer = first_layer_inputs(model, arch, ids, device, args.dtype, args.batch_size)
    kwargs = per_layer[0]
    g = torch.Generator(device="cpu").manual_seed(1)
    channel = torch.exp(torch.randn(cfg.hidden_size, generator=g))  # [hidden] log-normal channel scales
    channel[torch.randperm(cfg.hidden_size, generator=g)[:8]] *= 30  # a few massive outlier channels
    inputs = []
    for start in range(0, args.samples, args.batch_size):
        b = min(args.batch_size, args.samples - start)
        x = torch.randn(b, args.seq_len, cfg.hidden_size, generator=g) * channel  # [b, seq, hidden]
        inputs.append(x.to(device, args.dtype))
    return model, arch, inputs, kwargs


def sync(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def mse(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    err = sum((x.float() - y.float()).pow(2).sum() for x, y in zip(a, b))
    return err.item() / sum(x.numel() for x in a)


def run_variant(name: str, overrides: dict | None, model, arch, inputs, kwargs, state, ref, device, args) -> dict:
    """Restore the FP layer, quantize it with one search setting (None = round-to-nearest) -> its record."""
    layer = model.get_submodule(arch.layers)[0]
    layer.load_state_dict(state)
    convert = {f"{layer_prefix(arch, 0)}.{n}" for n in arch.linears}
    opts = dict(overrides or {})
    if args.search_tokens is not None and "search_tokens" not in opts:
        opts["search_tokens"] = args.search_tokens
    recipe = Recipe(name="bench", model="random", method="awq", q_group_size=args.group, awq=opts)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    results: dict = {}
    t0 = sync(device)
    if overrides is None:
        engine._round_to_nearest(layer, list(arch.linears), engine._spec(recipe), torch.float16,
                                 layer_prefix(arch, 0), results)
        t1 = t2 = sync(device)
        stats: dict = {}
    else:
        names = sorted(set(engine._feature_of(arch).values()), key=arch.linears.index)
        _, feats = forward_with_features(layer, inputs, kwargs, names)
        t1 = sync(device)
        stats = engine.awq_layer(LayerData(0, layer, inputs, kwargs, feats), arch, recipe, convert,
                                 torch.float16, results)
        del feats
        t2 = sync(device)
    out = layer_forward(layer, inputs, kwargs)
    rec = {"options": recipe.awq.model_dump() if overrides is not None else "rtn",
           "capture_s": round(t1 - t0, 3), "awq_layer_s": round(t2 - t1, 3), "mse": mse(out, ref),
           "stats": stats}
    if device.type == "cuda":
        rec["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    print(f"{name:12s} capture {rec['capture_s']:7.3f} s  awq_layer {rec['awq_layer_s']:7.3f} s  "
          f"mse {rec['mse']:.4e}  " + "  ".join(f"{k}: α={v['best_ratio']:.2f} ({v['n_evaluated']} pts, "
                                                 f"{v['seconds']:.3f} s)" for k, v in stats.items()
                                                 if k != "seconds") + f"  {stats.get('seconds', '')}", flush=True)
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="toy shapes (256 hidden, 16 x 128 tokens)")
    ap.add_argument("--samples", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--search-tokens", type=int, default=None,
                    help="override awq.search_tokens in the subset variants (--small: 512, a quarter of its tokens)")
    ap.add_argument("--variants", default=",".join(["rtn", *VARIANTS]), help="comma list: rtn," + ",".join(VARIANTS))
    args = ap.parse_args()
    args.samples = args.samples or (16 if args.small else 128)
    args.seq_len = args.seq_len or (128 if args.small else 512)
    if args.small and args.search_tokens is None:
        args.search_tokens = 512
    device = torch.device(args.device)
    args.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, arch, inputs, kwargs = build(args, device)
    layer = model.get_submodule(arch.layers)[0]
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    ref = layer_forward(layer, inputs, kwargs)
    res: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                 "torch": torch.__version__, "shape": {"samples": args.samples, "seq_len": args.seq_len,
                                                       "hidden": layer.mlp.gate_proj.in_features,
                                                       "intermediate": layer.mlp.gate_proj.out_features},
                 "group": args.group, "dtype": str(args.dtype), "variants": {}}
    wanted = args.variants.split(",")
    unknown = [v for v in wanted if v != "rtn" and v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from rtn,{','.join(VARIANTS)}")
    run_variant("warm-up", {}, model, arch, inputs, kwargs, state, ref, device, args)  # kernels, allocator
    for name in wanted:
        overrides = None if name == "rtn" else VARIANTS[name]
        res["variants"][name] = run_variant(name, overrides, model, arch, inputs, kwargs, state, ref, device, args)
    if "rtn" in res["variants"]:
        for v in res["variants"].values():
            v["mse_vs_rtn"] = round(v["mse"] / res["variants"]["rtn"]["mse"], 4)
    out = Path(os.environ.get("OUT", "/tmp"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "awq_layer_check.json").write_text(json.dumps(res, indent=2))
    print(json.dumps({k: {f: v.get(f) for f in ("awq_layer_s", "mse", "mse_vs_rtn", "peak_gib")}
                      for k, v in res["variants"].items()}, indent=2))


if __name__ == "__main__":
    main()

"""First run of the CUDA path on a lent GPU: tiny models CPU vs CUDA, then a 2-layer Qwen2.5-7B-shaped model.

    python bench/gpu_smoke.py        (on the GPU host; writes JSON to $OUT or /tmp/gpu-smoke)

Checks that recipes with device: cuda quantize, that CUDA and CPU runs of the same recipe give (nearly) the
same codes, and records per-stage times at real 7B layer shapes (random-init weights, 128 x 512 tokens).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from eval.artifact import dequantized_state_dict  # noqa: E402
from quantize import runner  # noqa: E402
from tests.conftest import build_tiny_model, build_tokenizer, tiny_recipe, write_recipe  # noqa: E402


def compare(a: Path, b: Path) -> dict:
    sa, _ = dequantized_state_dict(a)
    sb, _ = dequantized_state_dict(b)
    diffs = {k: (sa[k] - sb[k]).abs().max().item() for k in sa if k.endswith("proj.weight")}
    rel = max((sa[k] - sb[k]).norm().item() / max(sa[k].norm().item(), 1e-9) for k in diffs)
    return {"max_abs_diff": max(diffs.values()), "max_rel_fro_diff": rel}


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    out = Path(os.environ.get("OUT", "/tmp/gpu-smoke"))
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp())
    res: dict = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    d = build_tiny_model(tmp / "tiny", "llama")
    for m, kw in {"awq": {}, "gptq": dict(method="gptq", zero_point=False),
                  "gptq-fp32": dict(method="gptq", zero_point=False, compute_dtype="float32"),
                  "gptq-ct-asym": dict(method="gptq", zero_point=True, format="compressed-tensors")}.items():
        a = runner.run(tiny_recipe(tmp, d, name=f"tiny-{m}-cpu", device="cpu", **kw), out_root=tmp / "a")
        b = runner.run(tiny_recipe(tmp, d, name=f"tiny-{m}-cuda", device="cuda", **kw), out_root=tmp / "a")
        res[f"tiny_{m}_cpu_vs_cuda"] = compare(a, b)
        print(m, res[f"tiny_{m}_cpu_vs_cuda"], flush=True)
    if "--tiny-only" in sys.argv:
        (out / "gpu_smoke.json").write_text(json.dumps(res, indent=2))
        return
    # 2 decoder layers with Qwen2.5-7B shapes, random init, saved as safetensors
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(ROOT / "bench" / "configs" / "qwen2.5-7b")
    cfg.num_hidden_layers = 2
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:2]
    big = tmp / "qwen7b-2l"
    t0 = time.perf_counter()
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.to("cpu").save_pretrained(big)
    build_tokenizer(big, 512)  # ids < 512: a tokenizer only for calibration text, vocab shapes stay 7B's
    del model
    res["build_7b_2layer_s"] = round(time.perf_counter() - t0, 1)
    for m, kw in {"awq": dict(method="awq"), "gptq": dict(method="gptq", zero_point=False)}.items():
        r = write_recipe(tmp / f"q7-{m}.yaml", model=str(big), w_bit=4, q_group_size=128, device="cuda",
                         dtype="float16", calibration=dict(dataset="groups-merged", n_samples=128, seq_len=512), **kw)
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        a = runner.run(r, out_root=tmp / "a")
        man = json.loads((a / "manifest.json").read_text())
        res[f"q7_2layer_{m}"] = {"wall_s": round(time.perf_counter() - t0, 1), "stages_s": man["timings_s"],
                                 "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}
        print(m, res[f"q7_2layer_{m}"], flush=True)
    (out / "gpu_smoke.json").write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()

"""One timed run of llm-compressor's AWQ or GPTQ (`oneshot`) for bench/gpu_bench.py, in its own process.

    python bench/peers/llmc_bench.py --method awq --model DIR --out DIR --json RESULT.json

Calibration blocks are the exact ones our pipeline uses (quantize.calib: bundled groups-merged text, same seed,
same tokenizer; their sha256 is recorded to compare with our manifest's samples_sha256), fed to `oneshot`
as a pre-tokenized datasets.Dataset, unshuffled. Recipes, with llm-compressor 0.14's defaults otherwise:
- awq:  [AWQModifier(), QuantizationModifier(targets=Linear, scheme=W4A16_ASYM, ignore=[lm_head])]
        (int4 asymmetric, group 128, as the deprecated AWQModifier(scheme=...) shim builds it)
- gptq: GPTQModifier(targets=Linear, scheme=W4A16, ignore=[lm_head])  (int4 symmetric, group 128)
The model is loaded in bf16 straight onto --device (resident there, as llm-compressor's examples do) and
saved compressed. Records wall time for load / oneshot / save, the process's wall time, peak GPU memory
(max_memory_allocated / reserved) and peak RSS; writes --json and prints the record as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

T0 = time.perf_counter()
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from llmcompressor import oneshot  # noqa: E402
from bench.peers.common import LIFECYCLE_FLAGS, calibration  # noqa: E402
from bench.versions import installed  # noqa: E402
from quantize import calib  # noqa: E402

PACKAGES = ("llmcompressor", "compressed-tensors", "transformers", "torch", "accelerate", "datasets", "pyarrow",
            "fsspec", "pydantic")


def modifiers(method: str, ignore: tuple[str, ...] = ()) -> list:
    """llm-compressor's recipe for `method`, W4A16 group 128, lm_head (and `ignore`: a MoE's routers) left in
    16-bit."""
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    keep = ["lm_head", *ignore]
    if method == "gptq":
        return [GPTQModifier(targets="Linear", scheme="W4A16", ignore=keep)]
    from llmcompressor.modifiers.transform.awq import AWQModifier

    return [AWQModifier(), QuantizationModifier(targets="Linear", scheme="W4A16_ASYM", ignore=keep)]


def skip_pinning_without_accelerator() -> bool:
    """llm-compressor 0.14's AWQ pins cached activations (IntermediatesCache.pin_memory), which raises
    "Cannot access accelerator device" on a machine without one. Pinning only speeds host-to-GPU copies, so
    on the CPU (the tests of this script) it is made a no-op; on a GPU nothing is changed. -> patched?"""
    if torch.accelerator.is_available():
        return False
    from llmcompressor.pipelines.cache import IntermediatesCache

    IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None
    return True



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", choices=("awq", "gptq"), required=True)
    ap.add_argument("--model", required=True, help="local HF safetensors directory")
    ap.add_argument("--out", type=Path, required=True, help="where the compressed model is saved")
    ap.add_argument("--json", type=Path, required=True, help="where the record is written")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--n-samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=1, help="oneshot's batch_size (its default: 1)")
    ap.add_argument("--ignore", default="", help="comma-separated modules also left 16-bit (e.g. re:.*mlp.gate$)")
    args = ap.parse_args()

    tok, text, samples, ds = calibration(args.model, "groups-merged", args.n_samples, args.seq_len, args.seed)
    cuda = torch.device(args.device).type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16, device_map=args.device)
    load_s = time.perf_counter() - t
    recipe = modifiers(args.method, tuple(filter(None, args.ignore.split(","))))
    patched = skip_pinning_without_accelerator()
    t = time.perf_counter()
    oneshot(model=model, processor=tok, dataset=ds, recipe=recipe, num_calibration_samples=args.n_samples,
            max_seq_length=args.seq_len, shuffle_calibration_samples=False, batch_size=args.batch_size)
    if cuda:
        torch.cuda.synchronize()
    oneshot_s = time.perf_counter() - t
    t = time.perf_counter()
    model.save_pretrained(args.out, save_compressed=True)
    tok.save_pretrained(args.out)
    save_s = time.perf_counter() - t

    gib = 2**30
    n_layers = model.config.num_hidden_layers
    record = {
        "runner": "llmcompressor", "method": args.method, "model": str(Path(args.model).resolve()),
        "device": args.device, "gpu": torch.cuda.get_device_name(0) if cuda else None, "versions": installed(PACKAGES),
        "calibration": {"source": text.source, "sha256": text.sha256, "n_samples": args.n_samples,
                        "seq_len": args.seq_len, "seed": args.seed, "batch_size": args.batch_size,
                        "samples_sha256": calib.samples_sha256(samples)},
        "modifiers": [{type(m).__name__: m.model_dump(mode="json", exclude_none=True, exclude=LIFECYCLE_FLAGS)}
                      for m in recipe],
        "quantization_config": json.loads((args.out / "config.json").read_text()).get("quantization_config"),
        "stages_s": {"load": round(load_s, 3), "oneshot": round(oneshot_s, 3), "save": round(save_s, 3)},
        "process_s": round(time.perf_counter() - T0, 2), "layers": n_layers, "cpu_pinning_skipped": patched,
        "oneshot_per_layer_s": round(oneshot_s / n_layers, 3),
        "peak_gpu_alloc_gib": round(torch.cuda.max_memory_allocated() / gib, 2) if cuda else None,
        "peak_gpu_reserved_gib": round(torch.cuda.max_memory_reserved() / gib, 2) if cuda else None,
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
    }
    args.json.write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(json.dumps(record, default=str), flush=True)


if __name__ == "__main__":
    main()

"""Peer run: llm-compressor's AWQ on the exact calibration token blocks our pipeline builds.

    bash bench/peers/setup_llmcompressor.sh
    HF_HUB_OFFLINE=1 .cache/venv-llmcompressor/bin/python bench/peers/llmc_awq.py \
        --model ~/.cache/quantize/gguf/SmolLM2-135M-Instruct.Q4_1-<hash> --out artifacts/peer-llmc-awq-g64

Calibration blocks as in llmc_gptq.py (bench/peers/common.py). Recipe: [AWQModifier(), QuantizationModifier]
with int4 asymmetric group --group-size weights on every Linear but lm_head (llm-compressor 0.14's defaults
otherwise: duo scaling, 20-point grid, its default mappings for Llama). Calibrated in --compute-dtype (float32,
as our pipeline does on the CPU), saved compressed (pack-quantized) in float16. Writes OUT/peer_run.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

T0 = time.perf_counter()
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import AutoModelForCausalLM  # noqa: E402

from llmcompressor.modifiers.quantization import QuantizationModifier  # noqa: E402
from llmcompressor.modifiers.transform.awq import AWQModifier  # noqa: E402
from bench.peers.common import DTYPES, calibration, llmc_record, oneshot_and_save, parser  # noqa: E402
from bench.peers.llmc_bench import skip_pinning_without_accelerator  # noqa: E402

def main() -> None:
    ap = parser(__doc__.split("\n\n")[0])
    ap.add_argument("--save-dtype", choices=DTYPES, default="float16")
    args = ap.parse_args()
    out = Path(args.out)

    tok, text, samples, ds = calibration(args.model, args.dataset, args.n_samples, args.seq_len, args.seed)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=DTYPES[args.compute_dtype])
    recipe = [AWQModifier(), QuantizationModifier(
        config_groups={"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group",
                        "group_size": args.group_size, "dynamic": False},
        }},
        ignore=["lm_head"],
    )]
    patched = skip_pinning_without_accelerator()
    oneshot_s = oneshot_and_save(model, tok, ds, recipe, args, out)
    record = llmc_record("llmcompressor.AWQModifier", args, out, text, samples, T0, oneshot_s, modifiers=recipe)
    record["cpu_pinning_skipped"] = patched
    (out / "peer_run.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(json.dumps(record, default=str))


if __name__ == "__main__":
    main()

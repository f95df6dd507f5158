"""Peer run: llm-compressor's GPTQ on the exact calibration token blocks our pipeline builds.

    bash bench/peers/setup_llmcompressor.sh
    HF_HUB_OFFLINE=1 .cache/venv-llmcompressor/bin/python bench/peers/llmc_gptq.py \
        --model ~/.cache/quantize/gguf/SmolLM2-135M-Instruct.Q4_1-<hash> --out artifacts/peer-llmc-gptq-g64

Calibration blocks come from quantize.calib (load_text + make_samples, same seed/tokenizer), and are fed
to `oneshot` as a pre-tokenized datasets.Dataset (input_ids, attention_mask), unshuffled. Scheme: int4
symmetric, group strategy, targets Linear, lm_head ignored, memoryless min-max weight observer (the
llm-compressor default). The model is calibrated in --compute-dtype (float32, as our pipeline does on
the CPU) and saved compressed (compressed-tensors pack-quantized) in --save-dtype (float16, as our
recipes write; recasting after GPTQ leaves every int4 value unchanged, only scales are rounded). Writes
OUT/peer_run.json with versions, timings, the modifier config and peak RSS. HF_HUB_OFFLINE defaults
to 1 here; the default `groups-merged` is the bundled text in data/.
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
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local model dir; calib then uses the bundled data/ text

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from llmcompressor.modifiers.gptq import GPTQModifier  # noqa: E402
from bench.peers.common import DTYPES, calibration, llmc_record, oneshot_and_save, parser  # noqa: E402

def main() -> None:
    ap = parser(__doc__.split("\n\n")[0])
    ap.add_argument("--dampening-frac", type=float, default=0.01)
    ap.add_argument("--block-size", type=int, default=128, help="GPTQ columns per pass (llm-compressor default)")
    ap.add_argument("--actorder", choices=["static", "none"], default="static",
                    help="static = llm-compressor's default (reorders during GPTQ only; groups stay contiguous)")
    ap.add_argument("--save-dtype", choices=DTYPES, default="float16", help="our smollm2 recipes write float16")
    args = ap.parse_args()
    out = Path(args.out)

    tok, text, samples, ds = calibration(args.model, args.dataset, args.n_samples, args.seq_len, args.seed)

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=DTYPES[args.compute_dtype])
    modifier = GPTQModifier(
        config_groups={"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                        "group_size": args.group_size, "dynamic": False},
        }},
        ignore=["lm_head"],
        actorder=None if args.actorder == "none" else args.actorder,
        dampening_frac=args.dampening_frac,
        block_size=args.block_size,
    )

    oneshot_s = oneshot_and_save(model, tok, ds, modifier, args, out)

    record = llmc_record("llmcompressor.GPTQModifier", args, out, text, samples, T0, oneshot_s, modifier=modifier)
    record["torch_threads"] = torch.get_num_threads()
    (out / "peer_run.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()

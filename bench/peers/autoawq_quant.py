"""Peer run: AutoAWQ 0.2.9's AWQ on the exact calibration token blocks our pipeline builds.

    bash bench/peers/setup_autoawq.sh
    PYTHONPATH=.:.cache/autoawq-0.2.9 HF_HUB_OFFLINE=1 .venv/bin/python bench/peers/autoawq_quant.py \
        --model ~/.cache/quantize/gguf/SmolLM2-135M-Instruct.Q4_1-<hash> --out artifacts/peer-autoawq-g64

Calibration: the blocks quantize.calib builds (bench/peers/common.py: same text, seed, tokenizer), passed to
`model.quantize(calib_data=...)` as lists of token ids. AutoAWQ keeps a tokenized sample no longer than
max_calib_seq_len, concatenates them and cuts blocks of that length again, so with 512-token blocks it sees
exactly our blocks, in order, as one [n_samples, 512] batch. Settings: AutoAWQ's defaults (duo scaling,
20-point grid, clip on) with w_bit 4, q_group_size --group-size, zero_point true, version GEMM. The model is
calibrated in --compute-dtype (float32, as our pipeline does on the CPU) and its unquantized tensors and
scales are saved in float16 (as our recipes write). Writes OUT/peer_run.json (versions, timings, peak RSS).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from importlib.metadata import version
from pathlib import Path

T0 = time.perf_counter()
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import awq  # noqa: E402
from awq import AutoAWQForCausalLM  # noqa: E402

from bench.peers.common import DTYPES, calibration, parser  # noqa: E402
from quantize import calib  # noqa: E402

def main() -> None:
    ap = parser(__doc__.split("\n\n")[0])
    args = ap.parse_args()
    out = Path(args.out)

    tok, text, samples, _ = calibration(args.model, args.dataset, args.n_samples, args.seq_len, args.seed)
    t = time.perf_counter()
    model = AutoAWQForCausalLM.from_pretrained(args.model, torch_dtype=DTYPES[args.compute_dtype])
    load_s = time.perf_counter() - t
    quant_config = {"zero_point": True, "q_group_size": args.group_size, "w_bit": 4, "version": "GEMM"}
    t = time.perf_counter()
    model.quantize(tok, quant_config=quant_config, calib_data=samples.tolist(), max_calib_samples=args.n_samples,
                   max_calib_seq_len=args.seq_len)
    quant_s = time.perf_counter() - t
    model.model.to(torch.float16)  # unquantized tensors and scales as our recipes store them
    t = time.perf_counter()
    model.save_quantized(str(out))
    tok.save_pretrained(out)
    record = {
        "runner": "autoawq", "model": str(Path(args.model).resolve()),
        "versions": {"autoawq": awq.__version__, **{p: version(p) for p in ("torch", "transformers")}},
        "quant_config": quant_config, "compute_dtype": args.compute_dtype,
        "calibration": {"source": text.source, "sha256": text.sha256, "n_samples": args.n_samples,
                        "seq_len": args.seq_len, "seed": args.seed, "samples_sha256": calib.samples_sha256(samples)},
        "stages_s": {"load": round(load_s, 2), "quantize": round(quant_s, 2), "save": round(time.perf_counter() - t, 2)},
        "process_s": round(time.perf_counter() - T0, 2),
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
    }
    (out / "peer_run.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record))


if __name__ == "__main__":
    main()

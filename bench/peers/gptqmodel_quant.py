"""Peer run: ModelCloud GPTQModel's GPTQ (or its GPTAQ variant) on the exact calibration token blocks our pipeline
builds.

    bash bench/peers/setup_gptqmodel.sh
    HF_HUB_OFFLINE=1 .cache/venv-gptqmodel/bin/python bench/peers/gptqmodel_quant.py \
        --model ~/.cache/quantize/gguf/SmolLM2-135M-Instruct.Q4_1-<hash> --out artifacts/peer-gptqmodel-g64

Calibration: the blocks quantize.calib builds (bench/peers/common.py: same text, seed, tokenizer), handed to
`model.quantize` as {input_ids, attention_mask} token lists, batch 1 (GPTQModel's default). Settings: GPTQModel's
QuantizeConfig defaults (GPTQ, damp_percent 0.05, desc_act false with group-aware reordering (GAR) on, checkpoint
format GPTQ v1) with bits 4, group_size --group-size and sym / asym; --gptaq adds its documented
GPTAQConfig(alpha=0.25) (README: "Using GPTAQ", experimental). Loaded and quantized in --compute-dtype (float32,
as our pipeline on the CPU). Writes OUT/peer_run.json (versions, the saved quantization_config, timings).
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
# GPTQModel sizes its CPU pool as (cores + 1) // 2, one worker on a 2-core host, and then refuses to load
# ("Virtual pool 'model_loader:cpu' requests 2 workers but parent 'cpu' only has 1"); its own override:
os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")

import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from bench.peers.common import DTYPES, calibration_record, parser  # noqa: E402
from quantize import calib  # noqa: E402


def main() -> None:
    ap = parser(__doc__.split("\n\n")[0])
    ap.add_argument("--sym", action="store_true", help="symmetric grid (default: asymmetric, zero points)")
    ap.add_argument("--gptaq", action="store_true", help="GPTAQ (GPTAQConfig(alpha=0.25), the README's setting)")
    ap.add_argument("--device", default="cpu", help="where the peer quantizes: cpu, or cuda on a GPU host")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    args.model = str(Path(args.model).resolve())
    out.parent.mkdir(parents=True, exist_ok=True)
    os.chdir(out.parent)  # GPTQModel writes its logs/ into the working directory: beside the artifacts, not the repo

    from gptqmodel import GPTQModel
    from gptqmodel.quantization import QuantizeConfig

    tok = AutoTokenizer.from_pretrained(args.model)
    text = calib.load_text(args.dataset)
    samples = calib.make_samples(text.documents, tok, args.n_samples, args.seq_len, args.seed)  # [n, seq]
    data = [{"input_ids": s.tolist(), "attention_mask": [1] * len(s)} for s in samples]
    extra = {}
    if args.gptaq:
        from gptqmodel.quantization.config import GPTAQConfig
        extra["gptaq"] = GPTAQConfig(alpha=0.25, device=args.device)
    qcfg = QuantizeConfig(bits=4, group_size=args.group_size, sym=args.sym, **extra)
    t = time.perf_counter()
    model = GPTQModel.load(args.model, qcfg, device=args.device, dtype=DTYPES[args.compute_dtype])
    load_s = time.perf_counter() - t
    t = time.perf_counter()
    model.quantize(data, batch_size=1, tokenizer=tok)
    quant_s = time.perf_counter() - t
    t = time.perf_counter()
    model.save(str(out))
    save_s = time.perf_counter() - t
    tok.save_pretrained(out)
    record = {
        "peer": "gptqmodel" + (" GPTAQ" if args.gptaq else " GPTQ"),
        "versions": {p: version(p) for p in ("gptqmodel", "torch", "transformers")},
        "model": str(Path(args.model).resolve()), "calibration": calibration_record(args, text, samples),
        "quantize_config": {k: str(v) for k, v in vars(qcfg).items() if not k.startswith("_")},
        "quantization_config": json.loads((out / "config.json").read_text()).get("quantization_config"),
        "compute_dtype": args.compute_dtype, "threads": torch.get_num_threads(),
        "load_s": round(load_s, 2), "quantize_s": round(quant_s, 2), "save_s": round(save_s, 2),
        "total_s": round(time.perf_counter() - T0, 2),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    (out / "peer_run.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(json.dumps(record, default=str))


if __name__ == "__main__":
    main()

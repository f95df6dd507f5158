"""Peer run: Intel AutoRound (SignRound) on the exact calibration token blocks our pipeline builds.

    bash bench/peers/setup_autoround.sh
    HF_HUB_OFFLINE=1 .cache/venv-autoround/bin/python bench/peers/autoround_quant.py \
        --model ~/.cache/quantize/gguf/SmolLM2-135M-Instruct.Q4_1-<hash> --out artifacts/peer-autoround-g64

Calibration: the blocks quantize.calib builds (bench/peers/common.py: same text, seed, tokenizer), handed to
AutoRound as its `dataset` (one {input_ids, attention_mask} [1, seq_len] sample each, in order), nsamples and
seqlen set to match. Settings: scheme W4A16 with --group-size and --sym/asym; --recipe picks AutoRound's own
CLI recipe (auto_round/cli/main.py RECIPES: default = 200 iters, batch 8, lr auto; best = 1000 iters,
batch 8; light = 50 iters, lr 5e-3), whose nsamples x seqlen (128 x 2048, best 512 x 2048) are replaced by our
blocks; --iters overrides the recipe's iterations where the machine cannot afford them (the record says so).
Tuned in --compute-dtype (float32, as our pipeline on the CPU). Exported as AutoAWQ GEMM (asymmetric) or GPTQ v1
(symmetric), the layouts our evaluator and vLLM read. Writes OUT/peer_run.json (versions, settings, timings).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import sys
import time
from importlib.metadata import version
from pathlib import Path

T0 = time.perf_counter()
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from bench.peers.common import DTYPES, calibration_record, parser  # noqa: E402
from quantize import calib  # noqa: E402

# AutoRound 0.16.1's CLI recipes (auto_round/cli/main.py RECIPES), less their nsamples/seqlen: ours replace them
RECIPES = {"default": {"iters": 200, "batch_size": 8, "lr": None},
           "best": {"iters": 1000, "batch_size": 8, "lr": None},
           "light": {"iters": 50, "batch_size": 8, "lr": 5e-3}}


def move_up(folders: str | list[str], out: Path) -> None:
    """AutoRound writes into OUT/<model name>-w4g<G>/ and returns that folder: a str for one format, a list for
    several. The artifact is OUT itself, so the folder's files move up one level; a folder anywhere but directly
    inside OUT is refused before anything moves (indexing the str form would name "/")."""
    folder = Path(folders if isinstance(folders, str) else folders[0]).resolve()
    if folder.parent != out.resolve() or not folder.is_dir():
        raise SystemExit(f"error: AutoRound saved to {folder}, not a folder inside {out}: nothing moved")
    for f in folder.iterdir():
        shutil.move(str(f), out / f.name)
    folder.rmdir()


def main() -> None:
    ap = parser(__doc__.split("\n\n")[0])
    ap.add_argument("--sym", action="store_true", help="symmetric grid, exported as GPTQ (default: asymmetric, AWQ)")
    ap.add_argument("--recipe", choices=RECIPES, default="default")
    ap.add_argument("--iters", type=int, default=None, help="override the recipe's iterations per block")
    ap.add_argument("--device", default="cpu", help="where the peer quantizes: cpu, or cuda on a GPU host")
    ap.add_argument("--json", default=None, help="also write the run's record here (bench/gpu_bench.py's jobs)")
    args = ap.parse_args()
    out = Path(args.out)

    from auto_round import AutoRound
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    text = calib.load_text(args.dataset)
    samples = calib.make_samples(text.documents, tok, args.n_samples, args.seq_len, args.seed)  # [n, seq]
    data = [{"input_ids": s[None], "attention_mask": torch.ones_like(s[None])} for s in samples]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=DTYPES[args.compute_dtype])
    settings = {**RECIPES[args.recipe], "scheme": "W4A16", "group_size": args.group_size, "sym": args.sym,
                "nsamples": args.n_samples, "seqlen": args.seq_len}
    if args.iters is not None:
        settings["iters"] = args.iters
    fmt = "auto_gptq" if args.sym else "auto_awq"
    t = time.perf_counter()
    ar = AutoRound(model, tokenizer=tok, scheme="W4A16", bits=4, group_size=args.group_size, sym=args.sym,
                   dataset=data, nsamples=args.n_samples, seqlen=args.seq_len, iters=settings["iters"],
                   batch_size=settings["batch_size"], lr=settings["lr"], device_map=args.device, seed=args.seed)
    _, folders = ar.quantize_and_save(str(out), format=fmt)  # AutoRound's documented entry: tune, pack in `fmt`
    quant_s = time.perf_counter() - t
    move_up(folders, out)
    tok.save_pretrained(out)
    record = {
        "peer": "auto-round", "recipe": args.recipe, "iters_reduced": args.iters is not None
        and args.iters < RECIPES[args.recipe]["iters"], "settings": settings, "format": fmt,
        "versions": {p: version(p) for p in ("auto-round", "torch", "transformers")},
        "model": str(Path(args.model).resolve()), "calibration": calibration_record(args, text, samples),
        "quantization_config": json.loads((out / "config.json").read_text()).get("quantization_config"),
        "compute_dtype": args.compute_dtype, "threads": torch.get_num_threads(),
        "quantize_and_save_s": round(quant_s, 2), "total_s": round(time.perf_counter() - T0, 2),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    (out / "peer_run.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(json.dumps(record, default=str))


if __name__ == "__main__":
    main()

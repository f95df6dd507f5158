"""Build a random-init checkpoint of a published shape (bench/configs/<name>/config.json) for benchmarks.

    python bench/build_checkpoint.py --config bench/configs/qwen2.5-7b --out /tmp/gpu-bench/ckpt/qwen2.5-7b
    python bench/build_checkpoint.py --config bench/configs/qwen2.5-72b --layers 2 --out /tmp/q72b-2l
    python bench/build_checkpoint.py --config bench/configs/qwen2.5-7b --tiny --device cpu --out /tmp/tiny

Weights are drawn by the model's own initializer (seeded) on --device, in bf16, and saved as sharded
safetensors with the bundled tokenizer (bench/assets/tokenizer: SmolLM2's, 49,152 ids, so it fits any
vocabulary at least that large). `--tiny` keeps the architecture but shrinks it to 2 layers of hidden 256
for CPU tests of the benchmark's code paths. A directory built before with the same spec is reused.
Prints one JSON line: {"path", "spec", "params", "build_s", "reused"}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_DIR = ROOT / "bench" / "assets" / "tokenizer"
TOKENIZER_VOCAB = 49152  # ids the bundled tokenizer can produce
TINY = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": TOKENIZER_VOCAB, "num_hidden_layers": 2, "bos_token_id": 1, "eos_token_id": 2}  # the tokenizer's
# a mixture of experts shrinks its experts too (8 of moe_intermediate_size 128, top-2)
TINY_MOE = {"moe_intermediate_size": 128, "num_experts": 8, "num_experts_per_tok": 2, "head_dim": 64}


def copy_tokenizer(out: Path) -> None:
    """Put the bundled tokenizer's files beside a checkpoint saved in `out`."""
    for f in TOKENIZER_DIR.iterdir():
        shutil.copy(f, out / f.name)


def shaped_config(config_dir: Path, layers: int | None, tiny: bool, vocab: int | None = None):
    """The published config, optionally cut to `layers` decoder layers, its vocabulary cut to `vocab` ids, or
    shrunk to the tiny shape."""
    cfg = AutoConfig.from_pretrained(config_dir)
    changes = dict(TINY) if tiny else {}
    if tiny and hasattr(cfg, "moe_intermediate_size"):
        changes.update(TINY_MOE)
    if layers is not None:
        changes["num_hidden_layers"] = layers
    if vocab is not None:
        changes["vocab_size"] = vocab
    for key, value in changes.items():
        setattr(cfg, key, value)
    n = cfg.num_hidden_layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:n]
    if getattr(cfg, "max_window_layers", None) is not None:
        cfg.max_window_layers = min(cfg.max_window_layers, n)
    if cfg.vocab_size < TOKENIZER_VOCAB:
        sys.exit(f"error: vocab_size {cfg.vocab_size} is below the bundled tokenizer's {TOKENIZER_VOCAB} ids")
    return cfg


def build(config_dir: Path, out: Path, layers: int | None, tiny: bool, device: str, seed: int,
          vocab: int | None = None) -> dict:
    cfg = shaped_config(config_dir, layers, tiny, vocab)
    spec = {"config": str(config_dir.resolve().relative_to(ROOT)) if config_dir.resolve().is_relative_to(ROOT)
            else str(config_dir), "layers": cfg.num_hidden_layers, "tiny": tiny, "seed": seed,
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "vocab_size": cfg.vocab_size, "dtype": "bfloat16"}
    if hasattr(cfg, "num_experts"):
        spec.update(num_experts=cfg.num_experts, moe_intermediate_size=cfg.moe_intermediate_size)
    stamp = out / "build.json"
    if stamp.is_file():
        old = json.loads(stamp.read_text())
        if old.get("spec") == spec:
            return {**old, "path": str(out), "reused": True}
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    model.to("cpu")
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, max_shard_size="5GB")
    del model
    copy_tokenizer(tmp)
    record = {"spec": spec, "params": params, "build_s": round(time.perf_counter() - t0, 1)}
    (tmp / "build.json").write_text(json.dumps(record, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return {**record, "path": str(out), "reused": False}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, required=True, help="directory holding config.json")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=None, help="keep only the first N decoder layers")
    ap.add_argument("--tiny", action="store_true", help="2 layers, hidden 256 (CPU tests of the bench)")
    ap.add_argument("--device", default="cuda", help="where the weights are drawn (cuda is fast)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=None,
                    help=f"cut the vocabulary to N ids (at least the tokenizer's {TOKENIZER_VOCAB}): the embedding and "
                         f"lm_head shrink, the decoder's linears keep the published shape")
    args = ap.parse_args()
    if args.layers is not None and args.layers < 1:
        sys.exit("error: --layers must be at least 1")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    print(json.dumps(build(args.config, args.out, args.layers, args.tiny, args.device, args.seed, args.vocab)),
          flush=True)


if __name__ == "__main__":
    main()

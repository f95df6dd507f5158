"""Issue 6's quality check on a model trained on the GPU host: do the speed changes cost perplexity?

    git archive dba369e quantize eval data | tar -x -C /tmp/baseline     # the code before any speed change
    python3 bench/gpu_quality.py --baseline /tmp/baseline --out $OUT/quality

1. Trains a small Llama (8 layers of 512, vocabulary 49,152: bench/assets/tokenizer) from scratch on the GPU
   on the host's Python standard library sources (every 10th file, in sorted path order, held out), and keeps
   the weights with the lowest held-out loss. Saved as a bf16 safetensors checkpoint with its tokenizer.
   (The bundled text is too small: a first try on it over-fitted within 200 steps.)
2. Quantizes it, W4 g128, 128 x 512 calibration tokens of the bundled groups-merged text, at calibration seeds
   0, 1, 2 (the seed spread is the noise scale):
   - the current code: AWQ and GPTQ with their defaults, and GPTQ with `gptq.update: tf32`;
   - the baseline (`--baseline`: a `git archive` of dba369e, the last commit before any issue-6 speed change:
     exhaustive AWQ grid over every token; GPTQ with the torch sweep, float32 Hessians and the textbook
     Cholesky inverse), run as subprocesses from its own tree, all at once.
3. Scores the FP model and every artifact (decoded weights, float32) on held-out windows (512 tokens, the
   training length, non-overlapping) and writes OUT/quality.json plus a table on stdout.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import platform
import subprocess
import sys
import sysconfig
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import yaml  # noqa: E402

from bench.build_checkpoint import TOKENIZER_DIR, copy_tokenizer  # noqa: E402

SEQ = 512  # training and scoring window
log = logging.getLogger("gpu_quality")


def corpus() -> tuple[list[str], list[str], dict]:
    """-> (training files, held-out files, record): this host's Python standard library sources, every 10th
    file of the sorted list held out."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in lib.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts)
    train, held = [], []
    for i, f in enumerate(files):
        (held if i % 10 == 0 else train).append(f.read_text(encoding="utf-8", errors="replace"))
    digest = hashlib.sha256("\0".join(train + held).encode()).hexdigest()
    return train, held, {"source": str(lib), "python": platform.python_version(), "files": len(files),
                         "train_chars": sum(map(len, train)), "held_chars": sum(map(len, held)), "sha256": digest}


def _ids(tok, texts: list[str]) -> torch.Tensor:
    """Files -> one token stream, files separated by the end-of-sequence token."""
    out: list[int] = []
    for ids in tok(texts, add_special_tokens=False)["input_ids"]:
        out += ids + [tok.eos_token_id]
    return torch.tensor(out)


def train(out: Path, files: tuple[list[str], list[str], dict], steps: int, device: str) -> dict:
    """Train the small Llama, keep the best held-out weights, save them (bf16) with the tokenizer -> record."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    train_files, held_files, record = files
    ids, held = _ids(tok, train_files), _ids(tok, held_files)
    seq, batch = SEQ, 32
    held_wins = held[: (held.numel() // seq) * seq].reshape(-1, seq)[:32].to(device)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                      tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    warm = 50
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    g = torch.Generator().manual_seed(0)
    best, best_state, curve = float("inf"), None, []
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        starts = torch.randint(0, ids.numel() - seq, (batch,), generator=g)
        x = torch.stack([ids[s : s + seq] for s in starts.tolist()]).to(device)
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == steps:
            model.eval()
            with torch.no_grad(), torch.autocast(device_type=device, dtype=torch.bfloat16):
                losses = [model(input_ids=w[None], labels=w[None]).loss.item() for w in held_wins]
                held_loss = sum(losses) / len(losses)
            model.train()
            curve.append({"step": step, "train_loss": round(loss.item(), 4), "held_loss": round(held_loss, 4)})
            log.info("train step %d/%d: loss %.3f, held-out %.3f", step, steps, loss.item(), held_loss)
            if held_loss < best:
                best = held_loss
                best_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    model.load_state_dict(best_state)
    model.to(torch.bfloat16).save_pretrained(out)
    copy_tokenizer(out)
    params = sum(p.numel() for p in model.parameters())
    return {"params": params, "steps": steps, "seconds": round(time.perf_counter() - t0, 1), "best_held_loss": best,
            "curve": curve, "corpus": record, "train_tokens": ids.numel(), "held_tokens": held.numel()}


def recipe(work: Path, name: str, model: Path, method: str, seed: int, args, extra: dict | None = None) -> Path:
    r = {"name": name, "model": str(model), "method": method, "w_bit": 4, "q_group_size": 128,
         "zero_point": method == "awq", "calibration": {"dataset": "groups-merged", "n_samples": args.n_samples,
                                                         "seq_len": 512, "seed": seed},
         "modules_to_not_convert": ["lm_head"], "dtype": "bfloat16", "device": args.device,
         "eval": {"enabled": False}, **(extra or {})}
    path = work / "recipes" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(r))
    return path


def quantize_current(path: Path, out_root: Path) -> tuple[Path, float]:
    from quantize import runner

    t0 = time.perf_counter()
    art = runner.run(path, out_root=out_root, force=True)
    return art, time.perf_counter() - t0


def start_baseline(baseline: Path, path: Path, out_root: Path, log_dir: Path) -> subprocess.Popen:
    """The baseline code's `quantize run` on one recipe, as a subprocess from its own tree (PYTHONPATH without
    this repository)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(baseline)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p) != ROOT]))
    with (log_dir / f"{path.stem}.log").open("w") as fh:  # the child keeps its own copy of the descriptor
        return subprocess.Popen([sys.executable, "-m", "quantize", "run", str(path), "--out", str(out_root),
                                 "--force", "--no-eval"], cwd=baseline, env=env, stdout=fh, stderr=subprocess.STDOUT)


def score(model, wins: torch.Tensor) -> float:
    from eval.perplexity import perplexity

    return perplexity(model, wins)["ppl"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", type=Path, required=True, help="a tree of the pre-speed-change code (see above)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/gpu-quality")) / "quality")
    ap.add_argument("--work", type=Path, default=Path("/tmp/gpu-quality"))
    ap.add_argument("--steps", type=int, default=1200, help="training steps of 32 x 512 tokens")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script (use few --steps)")
    ap.add_argument("--n-samples", type=int, default=128, help="calibration blocks of 512 tokens")
    ap.add_argument("--windows", type=int, default=200, help="held-out windows scored")
    ap.add_argument("--seeds", default="0,1,2", help="calibration seeds (their spread is the noise scale)")
    args = ap.parse_args(argv)
    seeds = [int(x) for x in args.seeds.split(",")]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = args.work / "trained-llama-8x512"
    report: dict = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": sys.argv,
                    "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None, "torch": torch.__version__,
                    "baseline": str(args.baseline), "runs": {}}

    def save() -> None:
        (args.out / "quality.json").write_text(json.dumps(report, indent=2) + "\n")

    files = corpus()
    report["training"] = train(model_dir, files, args.steps, args.device)
    save()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eval.artifact import load_dequantized
    from eval.perplexity import Protocol, windows

    tok = AutoTokenizer.from_pretrained(model_dir)
    wins = windows(tok, "\n\n".join(files[1]), Protocol(seq_len=SEQ, max_windows=args.windows))
    report["eval"] = {"text": "the held-out standard-library files, joined with blank lines",
                      "windows": int(wins.shape[0]), "seq_len": SEQ, "dtype": "float32"}
    fp = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(args.device).eval()
    report["fp_ppl"] = score(fp, wins)
    del fp
    save()
    variants = [("awq", "current", {}), ("gptq", "current", {}), ("gptq-tf32", "current", {"gptq": {"update": "tf32"}}),
                ("awq", "baseline", {}), ("gptq", "baseline", {})]
    log_dir = args.work / "logs"
    log_dir.mkdir(exist_ok=True)
    arts = args.work / "artifacts"
    runs = [(f"{code}-{label}-s{seed}", code, label, seed, recipe(args.work, f"{code}-{label}-s{seed}", model_dir,
                                                                   label.split("-")[0], seed, args, extra))
            for label, code, extra in variants for seed in seeds]
    t_base = time.perf_counter()
    procs = {name: start_baseline(args.baseline, path, arts, log_dir) for name, code, _, _, path in runs
             if code == "baseline"}  # all at once: they only need to finish, not to be timed
    done: dict[str, tuple[Path | None, float]] = {}
    for name, code, label, seed, path in runs:
        if code == "current":
            done[name] = quantize_current(path, arts)
    for name, proc in procs.items():
        rc = proc.wait()
        done[name] = (arts / name if rc == 0 and (arts / name).is_dir() else None, time.perf_counter() - t_base)
    for name, code, label, seed, path in runs:
        art, secs = done[name]
        rec: dict = {"code": code, "variant": label, "seed": seed,
                     ("quantize_s" if code == "current" else "wall_s_all_baselines_in_parallel"): round(secs, 1)}
        if art is None:
            rec["error"] = f"quantize failed: see {log_dir / name}.log"
        else:
            m = load_dequantized(art, torch.float32).to(args.device)
            rec["ppl"] = score(m, wins)
            rec["delta"] = rec["ppl"] - report["fp_ppl"]
            del m
        report["runs"][name] = rec
        log.info("%s: %s", name, rec)
        save()
    lines = [f"FP ppl {report['fp_ppl']:.4f} ({wins.shape[0]} held-out windows of {SEQ})",
             f"| code | variant | ppl, seeds {' / '.join(map(str, seeds))} | mean Δ | spread |",
             "|---|---|---|---:|---:|"]
    for label, code, _ in variants:
        ppls = [report["runs"][f"{code}-{label}-s{s}"].get("ppl") for s in seeds]
        if None in ppls:
            lines.append(f"| {code} | {label} | failed | | |")
            continue
        lines.append(f"| {code} | {label} | {' / '.join(f'{p:.4f}' for p in ppls)} | "
                     f"{sum(ppls) / len(ppls) - report['fp_ppl']:+.4f} | {max(ppls) - min(ppls):.4f} |")
    report["table"] = lines
    save()
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

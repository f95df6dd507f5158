"""Where one perplexity pass of the eval spends its time on a GPU: the model's forwards against what the eval does
with each window's logits (log-softmax, NLL, the reference's top-k or the comparison with it).

    python bench/eval_pass_profile.py --model CKPT_DIR [--windows 48] [--dtype float16] [--json OUT.json]

On the first `--windows` windows of the bundled WikiText-2 test text (the eval's protocol: 2048 tokens, as many
per forward as the eval puts there), each timed with the device synchronised before and after:
  forward        the forwards alone, logits computed and dropped;
  reference      `eval.perplexity.perplexity` as the reference's pass runs it (keeps the top-k);
  quantized      the same as the quantized model's pass runs it (compares with those top-k; here the same model);
then a kernel profile of two forwards' worth of the reference pass, by kind of kernel (bench/kernel_profile.py).
The passes less `forward` is what the per-window work costs. Prints the figures, writes them as JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.kernel_profile import KernelProfile  # noqa: E402
from eval import distribution  # noqa: E402
from eval.perplexity import Protocol, batch_windows, load_eval_text, perplexity, windows  # noqa: E402
from quantize.source import load as source  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def synced(fn):
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return out, round(time.perf_counter() - t0, 3)


@torch.no_grad()
def forwards(model, wins: torch.Tensor, batch: int) -> None:
    device = next(model.parameters()).device
    for start in range(0, len(wins), batch):
        model(input_ids=wins[start : start + batch].to(device), use_cache=False).logits
        # the logits are dropped here; the eval drops them after the window loop


def ref_two(ref: dict, n: int) -> dict:
    """The reference record's top-k for its first n windows."""
    return {"k": ref["topk"]["k"], "logp": ref["topk"]["logp"][:n], "idx": ref["topk"]["idx"][:n]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--windows", type=int, default=48)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: the same steps on the CPU, one window per forward (a check of this script)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device: this bench profiles the GPU eval; run it on a GPU host (or --device cpu)",
              file=sys.stderr)
        return 2
    if not (args.model / "config.json").is_file():
        print(f"error: --model {args.model}: no config.json there; pass a checkpoint directory", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    src = source.resolve(str(args.model))
    tok = source.load_tokenizer(src)
    proto = Protocol(seq_len=args.seq_len, max_windows=args.windows)
    text, _ = load_eval_text(proto.dataset)
    wins = windows(tok, text, proto)
    device = torch.device(args.device)
    batch = batch_windows(device, proto.seq_len)
    model, load_s = synced(lambda: source.load_model(src, dtype, device=device))
    out: dict = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                 "device": torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor() or "cpu", "torch": torch.__version__, "host": platform.node(),
                 "model": str(args.model), "dtype": args.dtype, "windows": int(wins.shape[0]),
                 "seq_len": proto.seq_len, "windows_per_forward": batch,
                 "attn_implementation": model.config._attn_implementation, "load_s": load_s}
    forwards(model, wins[:batch], batch)  # the first forward pays cuBLAS's and the allocator's set-up
    _, out["forward_s"] = synced(lambda: forwards(model, wins, batch))
    ref, out["reference_pass_s"] = synced(lambda: perplexity(model, wins, batch, "reference",
                                                             keep_topk=distribution.TOPK))
    _, out["quantized_pass_s"] = synced(lambda: perplexity(model, wins, batch, "quantized", reference=ref["topk"]))
    q = perplexity(model, wins[: 2 * batch], batch, "check", reference=ref_two(ref, 2 * batch))
    out["numbers"] = {"reference_ppl": ref["ppl"], "reference_nll_sum": ref["nll_sum"],
                      "topk_sha256": hashlib.sha256(ref["topk"]["logp"].numpy().tobytes()
                                                    + ref["topk"]["idx"].numpy().tobytes()).hexdigest(),
                      "self_kl_mean_two_forwards": q["distribution"]["kl_mean"]}
    for name in ("reference", "quantized"):
        out[f"{name}_per_window_work_s"] = round(out[f"{name}_pass_s"] - out["forward_s"], 3)
    two = wins[: 2 * batch]
    with KernelProfile() as kp:
        t0 = time.perf_counter()
        perplexity(model, two, batch, "profiled", keep_topk=distribution.TOPK)
        sync()
        wall = time.perf_counter() - t0
    out["reference_profile_two_forwards"] = kp.summary(wall)
    for k in ("load_s", "forward_s", "reference_pass_s", "quantized_pass_s", "reference_per_window_work_s",
              "quantized_per_window_work_s"):
        print(f"{k}: {out[k]}")
    print("numbers:", out["numbers"])
    print("profile by kind (s):", out["reference_profile_two_forwards"]["by_kind_s"],
          "busy", out["reference_profile_two_forwards"]["busy_s"], "wall", round(wall, 3))
    for t in out["reference_profile_two_forwards"]["top"][:15]:
        print(f"  {t['seconds']:8.4f} s {t['calls']:5d}x {t['kind']:18s} {t['name'][:90]}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

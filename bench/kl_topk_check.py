"""The eval stage's KL figure (the reference's top-64 tokens plus one tail bucket: a lower bound) against the
full-vocabulary KL, on the first windows of the bundled WikiText-2 text.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/kl_topk_check.py ARTIFACT SOURCE_MODEL_DIR [--windows 3 --seq-len 512]

Prints one JSON line: mean per-token full-vocabulary KL, the eval stage's figure, its gap bound, the reference's
tail mass, and the figure as a share of the full KL.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eval import distribution  # noqa: E402
from eval.artifact import load_dequantized  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("source", type=Path, help="the unquantized model's directory")
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=512)
    a = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(a.source)
    ids = tok((ROOT / "data" / "wikitext2-raw-test.txt").read_text()[: 400 * a.windows * a.seq_len])["input_ids"]
    windows = [torch.tensor(ids[i * a.seq_len:(i + 1) * a.seq_len])[None] for i in range(a.windows)]
    ref = AutoModelForCausalLM.from_pretrained(a.source, dtype=torch.float32).eval()
    quant = load_dequantized(a.artifact)
    parts: dict[str, list[torch.Tensor]] = {"kl_full": [], "kl_topk": [], "gap_bound": [], "tail_mass": []}
    with torch.no_grad():
        for w in windows:
            lp = torch.log_softmax(ref(w).logits[0, :-1].float(), -1)
            lq = torch.log_softmax(quant(w).logits[0, :-1].float(), -1)
            c = distribution.compare(lq, *distribution.reference_topk(lp))
            parts["kl_full"].append((lp.exp() * (lp - lq)).sum(-1))
            parts["kl_topk"].append(c["kl"])
            parts["gap_bound"].append(c["gap_bound"])
            parts["tail_mass"].append(c["tail_mass"])
    out = {k: round(float(torch.cat(v).mean()), 4) for k, v in parts.items()}
    out.update(k=distribution.TOPK, tokens=sum(w.shape[1] - 1 for w in windows),
               topk_share_of_full=round(out["kl_topk"] / out["kl_full"], 3))
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""Does the token subset pick the exhaustive search's scales? Layer-level check on a real model (CPU-sized).

    python bench/awq_subset_check.py smollm2-awq-g64 --search-tokens 2048 --batch-size 4 --seeds 0,1,2 --every 2

For every `every`-th decoder layer and each AWQ scale group: the exhaustive 20-point search over all
calibration tokens, then the same grid with the loss measured on seeded batch subsets (engine.search_batches,
as the pipeline picks them). Reports, per subset, whether it chose the same ratio, and the excess of its
ratio's all-token loss over the exhaustive minimum. Layer inputs are the FP model's (propagate fp), so
nothing is applied. JSON to $OUT or /tmp/awq_subset_check.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from quantize import calib, engine, source  # noqa: E402
from quantize.arch import active_scale_groups, arch_for  # noqa: E402
from quantize.capture import run_layerwise  # noqa: E402
from quantize.recipe import load_recipe  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("recipe")
    ap.add_argument("--search-tokens", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--every", type=int, default=2)
    a = ap.parse_args()
    recipe = load_recipe(a.recipe)
    src = source.resolve(recipe.model)
    arch = arch_for(source.read_config(src, recipe.trust_remote_code))
    model = source.load_model(src, torch.float32, recipe.trust_remote_code)
    c = recipe.calibration
    text = calib.load_text(c.dataset, c.split, c.subset, c.text_column)
    samples = calib.make_samples(text.documents, source.load_tokenizer(src), c.n_samples, c.seq_len, c.seed)
    spec, seeds = engine._spec(recipe), [int(s) for s in a.seeds.split(",")]
    exh = recipe.awq.model_copy(update=dict(search_tokens=None, coarse_step=1))
    rows = []

    def process(data) -> None:
        if data.index % a.every:
            return
        sizes = [t.shape[0] * t.shape[1] for t in data.inputs]
        for g in active_scale_groups(data.layer, arch):
            q = [True] * len(g.linears)
            full = engine._search_group(data, g, q, list(range(len(sizes))), exh, spec)
            row = {"layer": data.index, "group": g.prev, "ratio": full.ratio,
                   "gain_vs_rtn": 1 - full.losses[full.ratio] / full.losses[0.0], "subsets": []}
            for seed in seeds:
                chosen = engine.search_batches(sizes, a.search_tokens, c.seed + seed + data.index)
                sub = engine._search_group(data, g, q, chosen, exh, spec)
                row["subsets"].append({"seed": seed, "tokens": sum(sizes[i] for i in chosen), "ratio": sub.ratio,
                                       "excess": full.losses[sub.ratio] / full.losses[full.ratio] - 1})
            rows.append(row)
            print(json.dumps(row), flush=True)

    names = sorted(set(engine._feature_of(arch).values()), key=arch.linears.index)
    run_layerwise(model, arch, samples, torch.device("cpu"), torch.float32, a.batch_size, lambda _l: names, process)
    subs = [s for r in rows for s in r["subsets"]]
    summary = {"groups": len(rows), "subset_searches": len(subs),
               "same_ratio": sum(s["ratio"] == r["ratio"] for r in rows for s in r["subsets"]),
               "mean_excess": sum(s["excess"] for s in subs) / len(subs), "max_excess": max(s["excess"] for s in subs),
               "mean_gain_vs_rtn": sum(r["gain_vs_rtn"] for r in rows) / len(rows)}
    print(json.dumps(summary, indent=2))
    out = Path(os.environ.get("OUT", "/tmp"))
    (out / "awq_subset_check.json").write_text(json.dumps({"args": vars(a), "summary": summary, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()

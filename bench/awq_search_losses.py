"""Every AWQ block scale search's loss per ratio and per calibration batch, and what cheaper searches would pick.

    python bench/awq_search_losses.py record RECIPE LOSSES.json [--out DIR]   # quantize (eval off), recording
    python bench/awq_search_losses.py analyse LOSSES.json [--json OUT.json] [--plot OUT.png]

`record` runs the recipe with every block search (`awq_search.search_scales` with an inspected block, i.e. not a
single linear) evaluating all n_grid ratios on every batch, keeping each batch's squared error: the same ratios,
losses and choice as the exhaustive search (`advanced.awq.coarse_step: 1`, `awq.screen_keep: null`), so the
artifact is the recipe's own with that search (and with its screening wherever that picks the same ratios).
With `awq.propagate: fp` no choice changes a later layer's inputs, so what another search would pick can be read
from these losses alone. `analyse` reports, over all searches:
- exact pruning: evaluating the chosen ratio first and abandoning a candidate once its running loss passes the
  best (the terms are non-negative) costs, at token granularity, sum(min(1, best / loss)) of the forwards;
- screening: all ratios on a random subset of b batches, then the k best (and ratio 0) on every batch: how often
  it picks the exhaustive search's ratio, the loss it gives up, and its cost in forwards; `first` rows screen on
  the first half of the batches, as `awq.screen_keep` does (cost without its pruning);
- with --plot, each search's loss over the ratio relative to its minimum (one line a search): how jagged it is.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def record(recipe: str, out_json: Path, out_root: Path) -> None:
    import quantize.methods.awq_search as S
    from quantize import runner

    searches: list[dict] = []
    search = S.search_scales

    def recorded(x, linears, quantized, run_inspect, spec, *args, **kwargs):
        """The search itself, its inspected block wrapped to keep each batch's squared error per candidate."""
        if run_inspect is None:  # a single linear: its loss has no per-batch form worth recording
            return search(x, linears, quantized, run_inspect, spec, *args, **kwargs)
        reference = kwargs.get("reference") or list(run_inspect())
        per: list[list[float]] = []  # per candidate, in the search's order

        def inspect():
            out = list(run_inspect())
            per.append([(o.float() - r.float()).pow(2).sum().item() for o, r in zip(out, reference)])
            return out

        # every candidate's every batch: no candidate stopped early
        result = search(x, linears, quantized, inspect, spec, *args, **{**kwargs, "reference": reference,
                                                                        "prune": False, "screen_keep": 0})
        n_grid = args[0] if args else kwargs.get("n_grid", 20)  # search_scales(x, ..., spec, n_grid, ...)
        if len(per) != len(result.losses) or len(per) != n_grid:
            raise SystemExit("error: the recipe's AWQ search is not exhaustive; set advanced.awq.coarse_step: 1")
        order = [round(r * n_grid) for r in result.losses]  # the grid index of each candidate evaluated
        searches.append({"n_out": sum(r.numel() for r in reference), "batch_numel": [r.numel() for r in reference],
                         "losses": [per[order.index(i)] for i in range(n_grid)]})
        return result

    S.search_scales = recorded
    art = runner.run(recipe, out_root=out_root, force=True)
    out_json.write_text(json.dumps({"recipe": recipe, "artifact": str(art), "searches": searches}))
    print(f"{len(searches)} block searches -> {out_json}")


def analyse(path: Path) -> dict:
    doc = json.loads(path.read_text())
    searches = doc["searches"] if isinstance(doc, dict) else doc
    n_batches, n_grid = len(searches[0]["losses"][0]), len(searches[0]["losses"])
    pruned = 0.0
    for r in searches:
        full = [sum(x) for x in r["losses"]]
        best = min(full)
        pruned += 1 + sum(min(1.0, best / f) for i, f in enumerate(full) if i != full.index(best))
    out = {"searches": len(searches), "batches": n_batches, "grid": n_grid,
           "exact_pruning_cost": round(pruned / (n_grid * len(searches)), 4), "screened": []}
    for b, first in [(b, False) for b in range(1, n_batches)] + [(n_batches // 2, True)] * (n_batches > 1):
        for k in ((3, 4, 5, 6, 7, 8) if first else (1, 2, 3, 4, 5)):
            same, excess, cost = 0, [], 0.0
            for j, r in enumerate(searches):
                L = r["losses"]
                full = [sum(x) for x in L]
                best = min(range(n_grid), key=full.__getitem__)
                subset = list(range(b)) if first else random.Random(j).sample(range(n_batches), b)
                screen = [sum(x[i] for i in subset) for x in L]
                ranked = range(1, n_grid) if first else range(n_grid)  # the product ranks all but ratio 0
                kept = set(sorted(ranked, key=screen.__getitem__)[:k]) | {0}
                pick = min(kept, key=full.__getitem__)
                same += pick == best
                excess.append(full[pick] / full[best] - 1)
                cost += n_grid * b / n_batches + len(kept) * (n_batches - b) / n_batches
            out["screened"].append({"batches": b, "first": first, "keep": k, "same_pick": same,
                                    "max_loss_excess": max(excess), "mean_loss_excess": sum(excess) / len(excess),
                                    "cost": round(cost / (n_grid * len(searches)), 4)})
    return out


def plot(path: Path, png: Path) -> None:
    """Each search's loss over the ratio, divided by its minimum: one line a search, the minima marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = json.loads(path.read_text())
    searches = doc["searches"] if isinstance(doc, dict) else doc
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in searches:
        full = [sum(x) for x in r["losses"]]
        alphas = [i / len(full) for i in range(len(full))]
        rel = [f / min(full) for f in full]
        ax.plot(alphas, rel, lw=0.7, alpha=0.5, color="tab:blue")
        ax.plot(alphas[rel.index(1.0)], 1.0, "o", ms=3, color="tab:red")
    ax.set_yscale("log")
    ax.set_xlabel("ratio α (scales mean|X|^α / mean|W|^(1-α))")
    ax.set_ylabel("block output loss / the search's minimum")
    ax.set_title(f"AWQ block scale searches of {doc.get('recipe', path.stem) if isinstance(doc, dict) else path.stem}"
                 f" ({len(searches)}; red: the ratio chosen)")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("recipe")
    r.add_argument("losses", type=Path)
    r.add_argument("--out", type=Path, default=Path("/tmp/awq-search-losses"))
    a = sub.add_parser("analyse")
    a.add_argument("losses", type=Path)
    a.add_argument("--json", type=Path, default=None)
    a.add_argument("--plot", type=Path, default=None, help="PNG: each search's loss over the ratio")
    args = ap.parse_args(argv)
    if args.cmd == "record":
        record(args.recipe, args.losses, args.out)
        return
    result = analyse(args.losses)
    print(f"{result['searches']} searches, {result['batches']} batches, grid {result['grid']}: exact pruning "
          f"costs at least {result['exact_pruning_cost']:.2f} of the forwards")
    for row in result["screened"]:
        print(f"  screen on {'the first ' if row['first'] else ''}{row['batches']}/{result['batches']} batches, "
              f"keep {row['keep']}: same pick "
              f"{row['same_pick']}/{result['searches']}, loss given up max {row['max_loss_excess']:.2e} mean "
              f"{row['mean_loss_excess']:.2e}, cost {row['cost']:.2f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(args.losses, args.plot)


if __name__ == "__main__":
    main()

"""The eval's gates: the recipe's thresholds on the perplexity delta and on the distance from the reference's
next-token distribution, against the figures one eval measured -> the report's `gates` record (what failed,
whether it passed). Kept apart from the eval's orchestration (`report`): pure arithmetic on its results."""

from __future__ import annotations

import math


def check(ppl: dict | None, eopts, dist: dict | None = None) -> dict:
    """The report's gates record: the recipe's thresholds (eval.max_ppl_delta, max_ppl_delta_pct, max_kl,
    min_top1), each one the figures fail, and whether all passed. A perplexity that is not finite fails the
    perplexity gates whatever their thresholds."""
    failures = []
    if ppl is not None:
        broken = [f"{name} {ppl[k]['ppl']}" for k, name in (("fp16", "reference"), ("quantized", "quantized"))
                  if not math.isfinite(ppl[k]["ppl"])]
        if broken:
            failures.append(f"perplexity is not finite ({', '.join(broken)}): the model computes NaN or infinite "
                            f"logits, so no gate can pass")
        elif eopts.max_ppl_delta is not None and ppl["delta"] > eopts.max_ppl_delta:
            failures.append(f"perplexity delta {ppl['delta']:.4f} > eval.max_ppl_delta {eopts.max_ppl_delta}")
        if not broken and eopts.max_ppl_delta_pct is not None and ppl["delta_pct"] > eopts.max_ppl_delta_pct:
            failures.append(f"perplexity delta {ppl['delta_pct']:.2f}% > eval.max_ppl_delta_pct "
                            f"{eopts.max_ppl_delta_pct}%")
    failures += distribution_failures(dist, eopts)
    return {"max_ppl_delta": eopts.max_ppl_delta, "max_ppl_delta_pct": eopts.max_ppl_delta_pct,
            "max_kl": eopts.max_kl, "min_top1": eopts.min_top1, "failures": failures, "passed": not failures}


def distribution_failures(dist: dict | None, eopts) -> list[str]:
    """eval.max_kl (mean KL, nats) and eval.min_top1 against the distribution record; NaN fails both."""
    if not dist:
        return []
    out = []
    kl, top1 = dist["kl_mean"], dist["top1"]
    if eopts.max_kl is not None and not kl <= eopts.max_kl:  # `not <=`: a NaN fails
        out.append(f"mean KL(reference || quantized) {kl:.4f} nats > eval.max_kl {eopts.max_kl}")
    if eopts.min_top1 is not None and not top1 >= eopts.min_top1:
        out.append(f"top-1 agreement with the reference {top1:.4f} < eval.min_top1 {eopts.min_top1}")
    return out

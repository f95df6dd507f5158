"""How far the quantized model's next-token distribution moved from the reference's, on the perplexity windows.

Both come from the perplexity forwards themselves (no extra pass over either model): the reference's pass keeps,
per predicted token, its TOPK largest log-probabilities and their token ids (`reference_topk`); the quantized
model's pass compares its full distribution Q against them (`compare`).

KL(P || Q) is computed over k + 1 outcomes: the reference's top-k tokens, each exactly, and every other token
as one "tail" bucket holding the reference's remaining mass r = 1 - Σ_topk P and Q's mass on the same tokens.
Merging outcomes never raises a KL (log-sum inequality), so the figure is a lower bound of the full-vocabulary
KL, short by exactly r · KL(P|tail || Q|tail), the divergence of the two distributions restricted to the tail.
Each token's shortfall is at most r · max(0, log(min(1, p_k / r)) + log Q_tail - log min_v Q(v)) (every tail
token has P(v) <= p_k, the k-th largest reference probability): `gap_bound`, reported as its mean beside the
mean tail mass. The bound is loose and the shortfall real (SmolLM2-135M at k = 64: docs/BENCHMARKS.md, "Figures
behind the code's comments"). Reports, cards and gates therefore call it
a lower bound; gates compare artifacts of one model under one k, where the figure ranks them.
"""

from __future__ import annotations

import math

import numpy as np
import torch

TOPK = 64  # reference log-probs kept per token (64 x 8 bytes; 303k WikiText-2 tokens: 155 MB cached)
WORST = 5  # windows listed by mean KL
TAIL_EPS = 1e-5  # a tail mass below this is float32 rounding of the top-k sum, not probability


def reference_topk(logp: torch.Tensor, k: int = TOPK) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference log-probs logp [T, V] -> (top-k values [T, k] float32, token ids [T, k] int32), on the CPU."""
    vals, idx = logp.topk(k, dim=-1)  # sorted: column 0 is the reference's top-1
    return vals.float().cpu(), idx.to(torch.int32).cpu()


@torch.no_grad()
def compare(logq: torch.Tensor, ref_vals: torch.Tensor, ref_idx: torch.Tensor) -> dict[str, torch.Tensor]:
    """Quantized log-probs logq [T, V] against the reference's top-k (values, ids) [T, k]
    -> per token {kl, top1 (bool), tail_mass, gap_bound}, each [T] float32 on the CPU."""
    vals, idx = ref_vals.to(logq.device, torch.float32), ref_idx.to(logq.device, torch.long)
    logq = logq.float()
    q_at = logq.gather(1, idx)  # [T, k] Q's log-probs on the reference's top-k tokens
    p = vals.exp()  # [T, k]
    r = 1 - p.double().sum(-1)  # [T] the reference's tail mass; below TAIL_EPS it is the float rounding of the sum
    r = torch.where(r > TAIL_EPS, r, torch.zeros_like(r)).float()
    q_tail = (1 - q_at.exp().sum(-1)).clamp(min=torch.finfo(torch.float32).tiny)  # [T]
    head = (p * (vals - q_at)).sum(-1)  # [T]
    tail = torch.where(r > 0, r * (torch.log(r.clamp(min=1e-30)) - torch.log(q_tail)), torch.zeros_like(r))
    p_k = p[:, -1]
    spread = torch.log(torch.minimum(torch.ones_like(r), p_k / r.clamp(min=1e-30))) + torch.log(q_tail) \
        - logq.min(-1).values
    gap = r * spread.clamp(min=0)
    top1 = logq.argmax(-1) == idx[:, 0]
    return {k: v.float().cpu() for k, v in
            {"kl": head + tail, "top1": top1, "tail_mass": r, "gap_bound": gap}.items()}


def summary(per_window: list[dict[str, torch.Tensor]], k: int) -> dict:
    """Per-window outputs of `compare` -> the report's record: KL mean / median / p99 (nats), top-1 agreement, the
    reference's mean tail mass and the mean bound on what the top-k KL leaves out, and the worst windows."""
    kl = torch.cat([w["kl"] for w in per_window]).double()
    top1 = torch.cat([w["top1"] for w in per_window])
    win_kl = [float(w["kl"].double().mean()) for w in per_window]
    worst = sorted(range(len(win_kl)), key=lambda i: -win_kl[i] if math.isfinite(win_kl[i]) else -math.inf)[:WORST]
    return {"k": k, "tokens": int(kl.numel()),
            "kl_mean": float(kl.mean()), "kl_median": float(np.percentile(kl.numpy(), 50)),
            "kl_p99": float(np.percentile(kl.numpy(), 99)), "kl_max": float(kl.max()), "top1": float(top1.mean()),
            "tail_mass_mean": float(torch.cat([w["tail_mass"] for w in per_window]).double().mean()),
            "kl_gap_bound_mean": float(torch.cat([w["gap_bound"] for w in per_window]).double().mean()),
            "worst_windows": [{"window": i, "kl_mean": win_kl[i], "top1": float(per_window[i]["top1"].mean())}
                              for i in worst]}

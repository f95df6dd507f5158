"""Activation-aware Weight Quantization (Lin et al. 2023), search separated from apply.

Pure maths on tensors and nn.Linear weights: no transformers import, no model-type branches. The caller
says which linears share an input, what feeds them (`prev`) and how to run the inspected module.

Scale search, for one group of linears sharing input X [tokens, in] and an inspected block f:
    s(α) = mean|X|^α / mean|Ŵ|^(1-α)      (duo scaling; Ŵ = |W| normalised per quantization group)
    s ← s / sqrt(max(s) · min(s))
    α* = argmin_α  ‖ f(X; W) − f(X; Q(W · diag(s)) · diag(s)^-1) ‖²   over α ∈ {0, 1/n, …, (n-1)/n}
α = 0 gives s ≈ 1, i.e. round-to-nearest, so the chosen scales never lose to RTN on the search loss.
Applied: W ← W · diag(s), prev ← prev / s (norm weight, or the rows of a preceding linear).

Clip search, per linear: shrink each group's max |w| by (1 - i/n), i < n · max_shrink, and keep the
shrink that minimises the group-wise output error ‖X_g W_gᵀ − X_g Q(clip(W_g))ᵀ‖², computed exactly over
all tokens through the group Gram matrices X_gᵀX_g (AutoAWQ samples 512 tokens instead).
For a group whose inspected block is the linear itself, the scale-search loss is likewise
‖X ΔWᵀ‖² = tr(ΔW XᵀX ΔWᵀ): no forward pass per grid point.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from .primitives import fake_quant


@dataclass(frozen=True)
class QSpec:
    w_bit: int
    group: int
    zero_point: bool


def _mse_sum(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).pow(2).sum().item()


def _gram_loss(w_hat: torch.Tensor, w: torch.Tensor, gram: torch.Tensor, n_tokens: int) -> float:
    """mean over tokens and outputs of (x · (ŵ - w))², from gram = XᵀX [in, in]."""
    delta = w_hat.float() - w.float()  # [out, in]
    return ((delta @ gram) * delta).sum().item() / (n_tokens * w.shape[0])


def search_scales(
    x: torch.Tensor,
    linears: Sequence[nn.Linear],
    quantized: Sequence[bool],
    run_inspect: Callable[[], list[torch.Tensor]] | None,
    spec: QSpec,
    n_grid: int = 20,
    duo_scaling: bool = True,
) -> tuple[torch.Tensor, list[float]]:
    """x: [tokens, in] shared input of `linears` -> best scales [in] (fp32) and the loss per grid point.

    `run_inspect()` runs the inspected module with the linears' *current* weights and returns its
    outputs (a list of per-batch tensors). None means the inspected block is the single linear itself:
    the loss is then computed from XᵀX without running it. Weights are restored before returning.
    """
    x_mean = x.abs().float().mean(dim=0)  # [in]
    w = torch.cat([fc.weight.detach().float() for fc in linears], dim=0)  # [sum_out, in]
    wg = w.abs().reshape(-1, spec.group)  # [sum_out * in / g, g]
    w_norm = (wg / (wg.amax(dim=1, keepdim=True) + 1e-6)).reshape(w.shape)  # [sum_out, in]
    w_mean = w_norm.mean(dim=0)  # [in]

    originals = [fc.weight.detach().clone() for fc in linears]
    if run_inspect is None:
        assert len(linears) == 1, "the Gram-matrix loss needs a single linear"
        xf = x.float()
        gram = xf.t() @ xf  # [in, in]
        loss_of = lambda: _gram_loss(linears[0].weight, originals[0], gram, x.shape[0])  # noqa: E731
    else:
        reference = run_inspect()
        n_out = sum(r.numel() for r in reference)
        loss_of = lambda: sum(_mse_sum(o, r) for o, r in zip(run_inspect(), reference)) / n_out  # noqa: E731
    losses: list[float] = []
    best, best_loss = None, float("inf")
    try:
        for i in range(n_grid):
            ratio = i / n_grid
            if duo_scaling:
                s = (x_mean.pow(ratio) / (w_mean.pow(1 - ratio) + 1e-4)).clamp(min=1e-4)
            else:
                s = x_mean.pow(ratio).clamp(min=1e-4)
            s = s / (s.max() * s.min()).sqrt()  # [in]
            for fc, orig, q in zip(linears, originals, quantized):
                if q:
                    scaled = orig.float() * s.view(1, -1)  # [out, in]
                    fc.weight.data = (fake_quant(scaled, spec.w_bit, spec.group, spec.zero_point) / s.view(1, -1)).to(
                        orig.dtype
                    )
            loss = loss_of()
            losses.append(loss)
            if loss < best_loss:
                best, best_loss = s.clone(), loss
    finally:
        for fc, orig in zip(linears, originals):
            fc.weight.data = orig
    if best is None:  # every loss was NaN/inf
        raise FloatingPointError("AWQ scale search produced no finite loss (NaN/inf in activations or weights)")
    return best, losses


def apply_scales(prev: nn.Module, linears: Sequence[nn.Linear], s: torch.Tensor) -> None:
    """Fold s into the model: prev's output / s (norm weight or linear rows), each linear's input columns · s."""
    s = s.to(prev.weight.device)
    with torch.no_grad():
        if isinstance(prev, nn.Linear):
            prev.weight.div_(s.view(-1, 1).to(prev.weight.dtype))  # [out_prev, in_prev] rows
        else:  # a norm: y = norm(x) * weight (+ bias)
            prev.weight.div_(s.to(prev.weight.dtype))
        if getattr(prev, "bias", None) is not None:
            prev.bias.div_(s.to(prev.bias.dtype))
        for fc in linears:
            fc.weight.mul_(s.view(1, -1).to(fc.weight.dtype))


def group_gram(x: torch.Tensor, group: int) -> torch.Tensor:
    """x: [tokens, in] -> per-group second moments [in // g, g, g] = X_gᵀ X_g / tokens (fp32)."""
    t, in_f = x.shape
    xg = x.float().reshape(t, in_f // group, group).transpose(0, 1)  # [n_group, t, g]
    return torch.bmm(xg.transpose(1, 2), xg) / t  # [n_group, g, g]


def search_clip(
    w: torch.Tensor, gram: torch.Tensor, spec: QSpec, n_grid: int = 20, max_shrink: float = 0.5
) -> torch.Tensor:
    """w: [out, in], gram: [in // g, g, g] from group_gram -> best max |w| per group [out, in // g] (fp32).

    The mean squared group output error over tokens, mean_t (x_g · Δw_g)², equals Δw_g G_g Δw_gᵀ with
    G_g = X_gᵀ X_g / t: exact over every calibration token, at a cost independent of the token count.
    """
    out_f, in_f = w.shape
    g = spec.group
    wg = w.float().reshape(out_f, in_f // g, g)  # [out, n_group, g]
    org_max = wg.abs().amax(dim=-1, keepdim=True)  # [out, n_group, 1]
    best_max = org_max.clone()
    min_err = torch.full_like(org_max, float("inf"))
    for i in range(int(max_shrink * n_grid)):
        max_val = org_max * (1 - i / n_grid)
        cur = torch.clamp(wg, -max_val, max_val)
        delta = fake_quant(cur.reshape(out_f, in_f), spec.w_bit, g, spec.zero_point).reshape(wg.shape) - wg
        err = torch.einsum("ong,ngh,onh->on", delta, gram, delta).unsqueeze(-1)  # [out, n_group, 1]
        better = err < min_err
        min_err[better] = err[better]
        best_max[better] = max_val[better]
    return best_max.squeeze(-1)  # [out, n_group]


def apply_clip(fc: nn.Linear, max_val: torch.Tensor) -> None:
    """Clamp each group of fc.weight [out, in] to ±max_val [out, in // g]."""
    out_f, in_f = fc.weight.shape
    n_group = max_val.shape[1]
    with torch.no_grad():
        w = fc.weight.data.reshape(out_f, n_group, -1)  # [out, n_group, g]
        m = max_val.to(w.device, w.dtype).unsqueeze(-1)  # [out, n_group, 1]
        fc.weight.data = torch.clamp(w, -m, m).reshape(out_f, in_f)

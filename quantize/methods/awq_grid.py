"""AWQ's quantization grid (Lin et al. 2023): the clip search, the grid it gives and its least-squares refit, on
the weights the scale search left.

Pure maths on tensors, as `awq_search.py` (which searches and folds the scales first).

Clip search, per linear: shrink each group's max |w| by (1 - i/n), i < n · max_shrink, and keep the
shrink that minimises the group-wise output error ‖X_g W_gᵀ − X_g Q(clip(W_g))ᵀ‖², computed exactly over
all tokens through the group Gram matrices X_gᵀX_g (AutoAWQ samples 512 tokens instead). `per_side` also
shrinks the grid's top and bottom on their own (a zero-point grid spans [min, max]). The result is a range
per group, i.e. a grid (scale, zero); the weights themselves are not clamped.

On that grid (see `refit_scales`): each group's scale may be refit by least squares to its codes on the same
group output error, and the codes are chosen by round-to-nearest or, by the caller, with GPTQ's error
feedback (`gptq.gptq_quantize(..., grid=...)`): AWQ decides the scales and the grid, GPTQ the rounding.
"""

from __future__ import annotations

import torch

from .awq_search import QSpec
from .primitives import fake_quant_, qparams, symmetric_scale, symmetric_zero


def group_gram(x: torch.Tensor, group: int, chunk: int = 8192) -> torch.Tensor:
    """x: [tokens, in] -> per-group second moments [in // g, g, g] = X_gᵀ X_g / tokens (fp32).

    Accumulated over chunks of `chunk` tokens, so peak memory stays at one chunk's fp32 copy.
    """
    t, in_f = x.shape
    gram = torch.zeros(in_f // group, group, group, device=x.device, dtype=torch.float32)
    for start in range(0, t, chunk):
        xg = x[start : start + chunk].float().reshape(-1, in_f // group, group).transpose(0, 1)  # [n_group, c, g]
        gram.baddbmm_(xg.transpose(1, 2), xg)
    return gram / t  # [n_group, g, g]


def _group_err(delta: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """delta: [out, n_group, g], gram: [n_group, g, g] -> mean_t (x_g · Δw_g)² per group [out, n_group]."""
    return torch.einsum("ong,ngh,onh->on", delta, gram, delta)


def search_clip(
    w: torch.Tensor, gram: torch.Tensor, spec: QSpec, n_grid: int = 20, max_shrink: float = 0.5,
    per_side: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [out, in], gram: [in // g, g, g] from group_gram -> per group clip range (lo, hi), each [out, in // g].

    The mean squared group output error over tokens, mean_t (x_g · Δw_g)², equals Δw_g G_g Δw_gᵀ with
    G_g = X_gᵀ X_g / t: exact over every calibration token, at a cost independent of the token count.
    Candidates, each kept per group only where it lowers that error:
      1. AutoAWQ's: clamp to ±max|w|·(1 - i/n), i < n · max_shrink;
      2. per_side (zero-point grids): hi = max w - (i/n)·(max w - min w)/2 with lo from 1., then
         lo = min w + (i/n)·(max w - min w)/2 with the best hi. A zero-point grid spans [min, max], so a
         group whose two tails differ gets each tail clipped on its own (±max|w| only moves the longer one).
    A symmetric grid is set by max|w| alone: there per_side adds nothing and is skipped.
    """
    out_f, in_f = w.shape
    g = spec.group
    max_q = 2**spec.w_bit - 1
    # group-major [n_group, out, g]: the error's batched product over groups reads it as it lies (an [out, n_group,
    # g] operand is copied to this layout for every candidate); every other step is elementwise
    wg = w.float().reshape(out_f, in_f // g, g).transpose(0, 1).contiguous()  # [n_group, out, g]
    w_max, w_min = wg.amax(dim=-1), wg.amin(dim=-1)  # [n_group, out]
    best_lo, best_hi = w_min.clone(), w_max.clone()
    min_err = torch.full_like(w_max, float("inf"))
    delta = torch.empty_like(wg)  # one buffer for every candidate's Q(clamp(w)) - w

    def consider(lo: torch.Tensor, hi: torch.Tensor) -> None:
        # fake_quant(clamp(w, lo, hi)) - w, value for value, without its reductions and temporaries: the clamped
        # group's extremes are min(lo, hi) and hi (lo >= min w, hi <= max w; torch.clamp gives hi where lo > hi),
        # so its qparams come straight from the range
        lo_eff = torch.minimum(lo, hi)
        if spec.symmetric:
            s = symmetric_scale(lo_eff, hi, spec.w_bit)
            z = torch.full_like(s, symmetric_zero(spec.w_bit))
        else:
            s = (hi - lo_eff).clamp(min=1e-5) / max_q
            z = (-torch.round(lo_eff / s)).clamp(0, max_q)
        torch.clamp(wg, lo.unsqueeze(-1), hi.unsqueeze(-1), out=delta)
        fake_quant_(delta, s, z, spec.w_bit).sub_(wg)  # [n_group, out, g]
        err = torch.einsum("nog,ngh,noh->no", delta, gram, delta)  # `_group_err`, group-major
        better = err < min_err
        torch.where(better, err, min_err, out=min_err)
        torch.where(better, lo, best_lo, out=best_lo)
        torch.where(better, hi, best_hi, out=best_hi)

    steps = range(int(max_shrink * n_grid))
    abs_max = torch.maximum(w_max, -w_min)
    for i in steps:
        m = abs_max * (1 - i / n_grid)
        consider(torch.maximum(w_min, -m), torch.minimum(w_max, m))
    if per_side and not spec.symmetric:
        half = (w_max - w_min) / 2
        lo = best_lo.clone()
        for i in steps:
            consider(lo, w_max - half * (i / n_grid))
        hi = best_hi.clone()
        for i in steps:
            consider(w_min + half * (i / n_grid), hi)
    return best_lo.t().contiguous(), best_hi.t().contiguous()  # [out, n_group]


def clip_grid(w: torch.Tensor, lo: torch.Tensor | None, hi: torch.Tensor | None, spec: QSpec
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [out, in], clip range lo/hi [out, in // g] (None: no clip) -> the grid's scales [out, in // g] (fp32)
    and zeros (int32): qparams of the clamped weight. Quantizing the unclamped w on this grid clamps its codes,
    which is the clip."""
    if lo is not None:
        out_f, in_f = w.shape
        wg = w.float().reshape(out_f, lo.shape[1], -1)  # [out, n_group, g]
        w = torch.clamp(wg, lo.unsqueeze(-1).to(wg), hi.unsqueeze(-1).to(wg)).reshape(out_f, in_f)
    return qparams(w, spec.w_bit, spec.group, symmetric=spec.symmetric)


def refit_scales(w: torch.Tensor, gram: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, spec: QSpec,
                 iters: int, scale_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Least-squares scales for the codes: w [out, in], gram [in // g, g, g], scales/zeros [out, in // g] ->
    scales [out, in // g] (fp32 holding scale_dtype values).

    Per group, with e = q - z the codes' integer offsets (z kept), the output error (w - s·e) G (w - s·e)ᵀ
    is a parabola in s, least at s* = e G wᵀ / e G eᵀ; the codes are then re-rounded on s*. Repeated `iters`
    times; a group keeps a new scale only where it lowers that error, so the result never loses to the input
    grid on the loss it measures.
    """
    out_f, in_f = w.shape
    g = spec.group
    max_q = 2**spec.w_bit - 1
    wg = w.float().reshape(out_f, in_f // g, g)  # [out, n_group, g]
    z = zeros.float().unsqueeze(-1)  # [out, n_group, 1]
    s = scales.float().to(scale_dtype).float()  # [out, n_group]
    Gw = torch.einsum("ngh,onh->ong", gram, wg)  # [out, n_group, g]

    def offsets(sc: torch.Tensor) -> torch.Tensor:
        return torch.clamp(torch.round(wg / sc.unsqueeze(-1)) + z, 0, max_q) - z  # [out, n_group, g]

    e = offsets(s)
    err = _group_err(s.unsqueeze(-1) * e - wg, gram)  # [out, n_group]
    for _ in range(iters):
        num = (e * Gw).sum(dim=-1)
        den = (e * torch.einsum("ngh,onh->ong", gram, e)).sum(dim=-1)
        s_new = (num / den.clamp(min=1e-30)).to(scale_dtype).float()  # [out, n_group]
        ok = torch.isfinite(s_new) & (s_new > 0)
        s_new = torch.where(ok, s_new, s)
        e_new = offsets(s_new)
        err_new = _group_err(s_new.unsqueeze(-1) * e_new - wg, gram)
        better = ok & (err_new < err)
        s = torch.where(better, s_new, s)
        e = torch.where(better.unsqueeze(-1), e_new, e)
        err = torch.where(better, err_new, err)
    return s

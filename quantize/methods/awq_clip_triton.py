"""AWQ's clip search (`awq_grid.search_clip`) as one Triton kernel: every candidate of every group in one pass.

The torch search runs about a dozen full-size elementwise passes and a batched matmul per candidate (30 for the
per-side zero-point search) over the grouped weights, so it is bound by memory traffic (a large share of each
decoder layer's time on a GPU: docs/BENCHMARKS.md). Here each program owns one group's tile of output rows: it reads
the weights and the
group's Gram matrix once and keeps them in registers while it walks the candidates in the torch search's order,
keeping per row the first candidate of least error (`err < best`, as there).

The candidates' ranges, scales, zero points and fake-quantized weights are the torch search's value for value
(IEEE division where torch divides two tensors, x * fl32(1/d) where torch on CUDA divides by a Python scalar,
round-half-to-even, no fused multiply-add). The error Δ G Δᵀ is a float32 sum in another order than cuBLAS's, so
two candidates whose errors agree to float32 rounding may be ordered the other way: the pick can differ there, by
less than that rounding in the quantity the search minimises. The unit test bounds it.
This module imports triton: `kernels.awq_clip` imports it only when the kernel is wanted.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .awq_search import QSpec
from .gptq_triton import div_scalar, round_half_even

BLOCK_OUT = 32  # output rows per program: with the [g, g] Gram tile in registers at 8 warps


@triton.jit
def _err(w, gram, lo, hi, inv_d, MAX_Q: tl.constexpr, SYMMETRIC: tl.constexpr, RECIP: tl.constexpr):
    """Rows' group error Δ G Δᵀ of fake_quant(clamp(w, lo, hi)) - w on the grid the clamped range sets [R]."""
    lo_eff = tl.minimum(lo, hi)  # the clamped group's least value (torch.clamp gives hi where lo > hi)
    if SYMMETRIC:
        half = (MAX_Q + 1) // 2 * 1.0
        m = tl.maximum(tl.maximum(tl.abs(lo_eff), tl.abs(hi)), 1e-5)
        s = div_scalar(tl.where(tl.abs(hi) >= tl.abs(lo_eff), -m, m), half, inv_d, RECIP)
        z = tl.zeros_like(s) + half
    else:
        s = div_scalar(tl.maximum(hi - lo_eff, 1e-5), MAX_Q * 1.0, inv_d, RECIP)
        z = tl.minimum(tl.maximum(-round_half_even(tl.math.div_rn(lo_eff, s)), 0.0), MAX_Q * 1.0)
    x = tl.minimum(tl.maximum(w, lo[:, None]), hi[:, None])
    q = tl.minimum(tl.maximum(round_half_even(tl.math.div_rn(x, s[:, None])) + z[:, None], 0.0), MAX_Q * 1.0)
    delta = (q - z[:, None]) * s[:, None] - w
    return tl.sum(tl.dot(delta, gram, input_precision="ieee") * delta, axis=1)


@triton.jit
def _keep(err, lo, hi, best, best_lo, best_hi):
    better = err < best
    return tl.where(better, err, best), tl.where(better, lo, best_lo), tl.where(better, hi, best_hi)


@triton.jit
def clip_kernel(W_ptr, stride_w, G_ptr, shrink_ptr, side_ptr, LO_ptr, HI_ptr, n_out, n_steps, inv_d,
                MAX_Q: tl.constexpr, SYMMETRIC: tl.constexpr, PER_SIDE: tl.constexpr, RECIP: tl.constexpr,
                GROUP: tl.constexpr, BLOCK_R: tl.constexpr):
    n = tl.program_id(0)  # the group
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, GROUP)
    live = rows < n_out
    w = tl.load(W_ptr + rows[:, None] * stride_w + n * GROUP + cols[None, :], mask=live[:, None], other=0.0)
    w = w.to(tl.float32)
    gram = tl.load(G_ptr + n * GROUP * GROUP + cols[:, None] * GROUP + cols[None, :])
    w_max = tl.max(w, axis=1)
    w_min = tl.min(w, axis=1)
    best_lo, best_hi = w_min, w_max
    best = tl.zeros_like(w_max) + float("inf")
    abs_max = tl.maximum(w_max, -w_min)
    for i in range(n_steps):  # AutoAWQ's: ±max|w|·(1 - i/n)
        m = abs_max * tl.load(shrink_ptr + i)
        lo, hi = tl.maximum(w_min, -m), tl.minimum(w_max, m)
        best, best_lo, best_hi = _keep(_err(w, gram, lo, hi, inv_d, MAX_Q, SYMMETRIC, RECIP), lo, hi,
                                       best, best_lo, best_hi)
    if PER_SIDE:  # each tail on its own: the upper with the best lower bound so far, then the lower
        half = (w_max - w_min) * 0.5  # torch: / 2, exact either way
        lo = best_lo
        for i in range(n_steps):
            hi = w_max - half * tl.load(side_ptr + i)
            best, best_lo, best_hi = _keep(_err(w, gram, lo, hi, inv_d, MAX_Q, SYMMETRIC, RECIP), lo, hi,
                                           best, best_lo, best_hi)
        hi = best_hi
        for i in range(n_steps):
            lo = w_min + half * tl.load(side_ptr + i)
            best, best_lo, best_hi = _keep(_err(w, gram, lo, hi, inv_d, MAX_Q, SYMMETRIC, RECIP), lo, hi,
                                           best, best_lo, best_hi)
    tl.store(LO_ptr + n * n_out + rows, best_lo, mask=live)
    tl.store(HI_ptr + n * n_out + rows, best_hi, mask=live)


def supports(w: torch.Tensor, group: int) -> bool:
    """Whether the kernel takes this weight and group size: a power-of-two group of 16 to 128 columns (the
    [g, g] Gram tile stays in registers) that divides the row."""
    return 16 <= group <= 128 and group & (group - 1) == 0 and w.shape[1] % group == 0 and w.stride(1) == 1


def search_clip_triton(w: torch.Tensor, gram: torch.Tensor, spec, n_grid: int, max_shrink: float,
                       per_side: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for `awq_grid.search_clip` (`supports(w, spec.group)` must hold): w [out, in], gram
    [in // g, g, g] -> (lo, hi) [out, in // g]."""
    out_f, in_f = w.shape
    g, max_q = spec.group, 2**spec.w_bit - 1
    n_group = in_f // g
    steps = int(max_shrink * n_grid)
    # the candidates' factors as the torch search has them: a Python float times a float32 tensor is a float32 product
    shrink = torch.tensor([1 - i / n_grid for i in range(steps)], dtype=torch.float32, device=w.device)
    side = torch.tensor([i / n_grid for i in range(steps)], dtype=torch.float32, device=w.device)
    divisor = 2 ** (spec.w_bit - 1) if spec.symmetric else max_q
    inv_d = (torch.tensor(1.0) / divisor).item()  # fp32 1/d, as aten's division by a scalar computes it on CUDA
    lo = torch.empty(n_group, out_f, dtype=torch.float32, device=w.device)
    hi = torch.empty_like(lo)
    grid = (n_group, triton.cdiv(out_f, BLOCK_OUT))
    clip_kernel[grid](w, w.stride(0), gram.float().contiguous(), shrink, side, lo, hi, out_f, steps, inv_d,
                      MAX_Q=max_q, SYMMETRIC=spec.symmetric, PER_SIDE=per_side and not spec.symmetric,
                      RECIP=w.device.type == "cuda", GROUP=g, BLOCK_R=BLOCK_OUT, num_warps=8,
                      enable_fp_fusion=False)
    return lo.t().contiguous(), hi.t().contiguous()


def warm(launch: dict, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> None:
    """One search with a run's settings on [rows, cols] weights, so that Triton compiles (or finds in its cache)
    the kernel the run will launch (`warmup`): launch holds group, w_bit, symmetric, n_grid, max_shrink
    and per_side."""
    spec = QSpec(launch["w_bit"], launch["group"], symmetric=launch["symmetric"])
    w = torch.randn(rows, cols, device=device).to(dtype)
    if not supports(w, spec.group):
        return
    gram = torch.randn(cols // spec.group, spec.group, spec.group, device=device)
    search_clip_triton(w, gram, spec, launch["n_grid"], launch["max_shrink"], launch["per_side"])

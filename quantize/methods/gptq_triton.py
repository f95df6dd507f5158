"""GPTQ's in-block column sweep as one Triton kernel per block (the torch sweep launches ~12 kernels per column).

Same maths, same order of float operations as `gptq._sweep_torch`, so the codes are identical:
each program owns a tile of rows, keeps the block's W1 tile [rows, block] (and the original weights W0)
in registers and walks the block's columns in order:

    (group start, no act-order)  s, z = qparams(W1[:, i : i + g])     (updated columns; s rounded to scale_dtype)
    q = clamp(round(w_i / s) + z, 0, 2^b - 1);  deq = (q - z)·s;  d = w0_i - deq  (w_i - deq without act-order)
    W1[:, i+1:] += d · A[i, i+1:];  D1[:, i] = d;  loss += ((w_i - deq)·t_i)²

Bit-exactness needs IEEE division (`div_rn`, not Triton's approximate `/`) where torch divides two
tensors, but x * fl32(1/d) where torch on CUDA divides by a Python scalar d (as in `primitives.qparams`);
round-half-to-even (as torch.round); no fused multiply-add (`enable_fp_fusion=False`), since torch rounds
the product and the difference separately; and the lazy update's matmul called on operands of the same
layout as in the torch sweep (cuBLAS may sum in another order for another layout). The lazy cross-block
update is the torch sweep's own (`gptq.lazy_update`). This module imports triton: `device.gptq_sweep` imports it
only when the Triton sweep is wanted, so CPU-only installs without triton keep the torch sweep.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .awq_grid import clip_grid
from .awq_search import QSpec
from .gptq_sweep import Sweep, _block_start_qparams, gptq_quantize, lazy_update, spec_from_json

BLOCK_ROWS = 16  # rows per program: [16, 128] fp32 tile = 16 registers per thread at 4 warps
_SCALE_KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


@triton.jit
def round_half_even(x):
    r = tl.floor(x)
    d = x - r  # exact (Sterbenz), so the tie test is exact
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where((d > 0.5) | ((d == 0.5) & odd), r + 1.0, r)


@triton.jit
def div_scalar(x, d, inv_d, RECIP: tl.constexpr):
    """x / d for a Python-scalar divisor d, as torch computes it: on CUDA as x * fl32(1 / d)
    (aten's div_true_kernel_cuda), on CPU as an IEEE division."""
    if RECIP:
        return x * inv_d
    else:
        return tl.math.div_rn(x, d)


@triton.jit
def group_qparams(W1, cols, start, group, inv_d, MAX_Q: tl.constexpr, SYMMETRIC: tl.constexpr,
                  SCALE_KIND: tl.constexpr, RECIP: tl.constexpr):
    """W1 [R, B], columns [start, start + group) -> (scale [R] rounded to the stored dtype, zero [R]).

    Same formula as `primitives.qparams`; the zero point uses the fp32 scale, as there."""
    gm = ((cols >= start) & (cols < start + group))[None, :]
    if SYMMETRIC:
        mx = tl.max(tl.where(gm, W1, -float("inf")), axis=1)
        mn = tl.min(tl.where(gm, W1, float("inf")), axis=1)
        m = tl.maximum(tl.maximum(tl.abs(mx), tl.abs(mn)), 1e-5)
        s = div_scalar(tl.where(tl.abs(mx) >= tl.abs(mn), -m, m), (MAX_Q + 1) // 2 * 1.0, inv_d, RECIP)
        z = tl.zeros_like(s) + (MAX_Q + 1) // 2
    else:
        mx = tl.max(tl.where(gm, W1, -float("inf")), axis=1)
        mn = tl.min(tl.where(gm, W1, float("inf")), axis=1)
        s = div_scalar(tl.maximum(mx - mn, 1e-5), MAX_Q * 1.0, inv_d, RECIP)
        z = tl.minimum(tl.maximum(-round_half_even(tl.math.div_rn(mn, s)), 0.0), MAX_Q * 1.0)
    if SCALE_KIND == 1:
        s = s.to(tl.float16).to(tl.float32)
    elif SCALE_KIND == 2:  # to bf16: round-to-nearest-even on the magnitude bits (s finite); the interpreter truncates
        b = s.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        s = b.to(tl.float32, bitcast=True)
    return s, z


@triton.jit
def sweep_block(W_ptr, W0_ptr, stride_w, A_ptr, stride_a0, stride_a1, t_ptr, Q_ptr, stride_q, D_ptr, stride_d,
                S_ptr, Z_ptr, stride_s, gidx_ptr, loss_ptr, n_rows, n_cols, i1, group, inv_d,
                MAX_Q: tl.constexpr, SYMMETRIC: tl.constexpr, SCALE_KIND: tl.constexpr, RECIP: tl.constexpr,
                COMPUTE_GROUPS: tl.constexpr, FEED_ORIGINAL: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [R]
    cols = tl.arange(0, BLOCK)  # [B], block-local column index
    rmask = rows < n_rows
    m2 = rmask[:, None] & (cols < n_cols)[None, :]
    offs = rows[:, None] * stride_w + (i1 + cols)[None, :]
    W1 = tl.load(W_ptr + offs, mask=m2, other=0.0)  # [R, B] with the earlier blocks' feedback
    if FEED_ORIGINAL:
        W0 = tl.load(W0_ptr + offs, mask=m2, other=0.0)  # [R, B] before any feedback
    else:
        W0 = W1
    Q1 = tl.zeros([BLOCK_R, BLOCK], dtype=tl.float32)
    D1 = tl.zeros([BLOCK_R, BLOCK], dtype=tl.float32)
    loss = tl.zeros([BLOCK_R], dtype=tl.float32)
    s = tl.zeros([BLOCK_R], dtype=tl.float32) + 1.0
    z = tl.zeros([BLOCK_R], dtype=tl.float32)
    seg = group if COMPUTE_GROUPS else n_cols  # columns per segment: one group, or the whole block
    for i0 in range(0, n_cols, seg):
        if COMPUTE_GROUPS:  # group inside the block: parameters from its updated columns
            j = tl.load(gidx_ptr + i1 + i0)
            s, z = group_qparams(W1, cols, i0, group, inv_d, MAX_Q, SYMMETRIC, SCALE_KIND, RECIP)
            tl.store(S_ptr + rows * stride_s + j, s, mask=rmask)
            tl.store(Z_ptr + rows * stride_s + j, z.to(tl.int32), mask=rmask)
        for i in range(i0, i0 + seg):
            if not COMPUTE_GROUPS:  # parameters fixed before the sweep (act-order) or at the block start
                j = tl.load(gidx_ptr + i1 + i)
                s = tl.load(S_ptr + rows * stride_s + j, mask=rmask, other=1.0)
                z = tl.load(Z_ptr + rows * stride_s + j, mask=rmask, other=0).to(tl.float32)
            sel = (cols == i)[None, :]
            w = tl.sum(tl.where(sel, W1, 0.0), axis=1)  # [R] column i (one non-zero term: exact)
            if FEED_ORIGINAL:
                w0 = tl.sum(tl.where(sel, W0, 0.0), axis=1)
            else:
                w0 = w
            q = tl.minimum(tl.maximum(round_half_even(tl.math.div_rn(w, s)) + z, 0.0), MAX_Q * 1.0)
            deq = (q - z) * s
            d = w0 - deq
            e = (w - deq) * tl.load(t_ptr + i1 + i)
            a = tl.load(A_ptr + (i1 + i) * stride_a0 + (i1 + cols) * stride_a1, mask=(cols > i) & (cols < n_cols),
                        other=0.0)  # [B]
            W1 = W1 + d[:, None] * a[None, :]
            Q1 = tl.where(sel, q[:, None], Q1)
            D1 = tl.where(sel, d[:, None], D1)
            loss += e * e
    tl.store(Q_ptr + rows[:, None] * stride_q + (i1 + cols)[None, :], Q1.to(tl.uint8), mask=m2)
    tl.store(D_ptr + rows[:, None] * stride_d + cols[None, :], D1, mask=m2)
    tl.store(loss_ptr + rows, tl.load(loss_ptr + rows, mask=rmask, other=0.0) + loss * 0.5, mask=rmask)


def sweep_triton(W: torch.Tensor, W0: torch.Tensor, A: torch.Tensor, t: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor, gidx: list[int], g: int, spec) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for `gptq._sweep_torch`: W [out, in] visiting order, W0 its values before any update, A [in, in]
    upper, t [in], scales/zeros [out, n_group] read or filled in -> codes [out, in] uint8 (visiting order),
    row_loss [out]."""
    out_f, in_f = W.shape
    assert W.is_contiguous() and scales.is_contiguous() and zeros.is_contiguous()
    block = triton.next_power_of_2(spec.block_size)
    max_q = 2**spec.w_bit - 1
    divisor = 2 ** (spec.w_bit - 1) if spec.symmetric else max_q  # primitives.qparams' Python-scalar divisor
    inv_d = (torch.tensor(1.0) / divisor).item()  # fp32 1/d, exactly as aten computes it
    t = t.contiguous()
    codes = torch.zeros(out_f, in_f, dtype=torch.uint8, device=W.device)
    row_loss = torch.zeros(out_f, device=W.device)
    gidx_t = torch.tensor(gidx, dtype=torch.int32, device=W.device)
    grid = (triton.cdiv(out_f, BLOCK_ROWS),)
    for i1 in range(0, in_f, spec.block_size):
        i2 = min(i1 + spec.block_size, in_f)
        if g >= i2 - i1:
            _block_start_qparams(W, i1, g, gidx, scales, zeros, spec)
        D1 = torch.empty(out_f, i2 - i1, device=W.device)  # same layout as the torch sweep's: same matmul
        sweep_block[grid](W, W0, W.stride(0), A, A.stride(0), A.stride(1), t, codes, codes.stride(0), D1,
                          D1.stride(0), scales, zeros, scales.stride(0), gidx_t, row_loss, out_f, i2 - i1, i1, g,
                          inv_d, MAX_Q=max_q, SYMMETRIC=spec.symmetric, SCALE_KIND=_SCALE_KIND[spec.scale_dtype],
                          RECIP=W.device.type == "cuda", COMPUTE_GROUPS=not spec.act_order and g < i2 - i1,
                          FEED_ORIGINAL=spec.act_order, BLOCK_R=BLOCK_ROWS, BLOCK=block, num_warps=4,
                          enable_fp_fusion=False)
        lazy_update(W, i2, D1, A[i1:i2], spec)
    return codes, row_loss


def warm(launch: dict, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> None:
    """One GPTQ problem with a run's settings on [rows, cols] weights (H the identity), so that Triton compiles
    (or finds in its cache) every block's kernel the run will launch (`warmup`); grid: on a given grid
    with static groups, as AWQ's GPTQ rounding sweeps."""
    spec = spec_from_json(launch["spec"])
    W = torch.randn(rows, cols, device=device).to(dtype)
    grid = None
    if launch["grid"]:
        scales, zeros = clip_grid(W, None, None, QSpec(spec.w_bit, spec.group, symmetric=spec.symmetric))
        grid = (scales.to(spec.scale_dtype), zeros)
    gptq_quantize(W, torch.eye(cols, device=device), spec, grid, Sweep("triton", sweep_triton))

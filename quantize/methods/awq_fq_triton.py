"""AWQ's scale-search candidate Q(W · diag(s)) · diag(s)^-1 (`awq_search._scaled_fake_quant`) as one Triton kernel.

Each candidate ratio of the scale search fake-quantizes every linear of its group at the candidate's scales. In
torch that is about a dozen full-size passes over the weights in float32 (the cast, the product with s, the
group minimum and maximum, the division, rounding, zero point, clamp, the way back, the division by s, the cast
back): on a GPU they cost as much time as the block forwards that score the candidates (docs/BENCHMARKS.md,
"Where the GPU time goes"). Here each program owns one group's tile of output rows,
reads the weights once and writes the candidate once.

The values are the torch function's bit for bit: the same float32 operations in the same order, IEEE division
where torch divides two tensors, x * fl32(1/d) where torch on CUDA divides by a Python scalar, round half to even,
no fused multiply-add, and the cast to the weights' dtype rounding to nearest even. There is no sum, so no order
to differ in. `delta=True` writes the candidate minus the weights instead (the single-linear loss's ΔW), formed
in float32 and cast to the output's dtype, as torch forms it.
This module imports triton: `kernels.awq_fake_quant` imports it only when the kernel is wanted.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .awq_search import QSpec
from .gptq_triton import div_scalar, round_half_even

BLOCK_OUT = 16  # output rows per program: a [16, g <= 128] float32 tile at 4 warps


@triton.jit
def bf16_rne(x):
    """float32 x rounded to bfloat16 (nearest, ties to even), still as float32: the cast torch makes. Written out
    because Triton's CPU interpreter truncates where a GPU's conversion rounds; on a GPU both give these values."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536  # -65536 = 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def fake_quant_kernel(W_ptr, stride_w, S_ptr, O_ptr, stride_o, n_out, inv_d, MAX_Q: tl.constexpr,
                      SYMMETRIC: tl.constexpr, RECIP: tl.constexpr, DELTA: tl.constexpr, BF16: tl.constexpr,
                      GROUP: tl.constexpr, BLOCK_R: tl.constexpr):
    n = tl.program_id(0)  # the group
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = n * GROUP + tl.arange(0, GROUP)
    live = rows < n_out
    w_in = tl.load(W_ptr + rows[:, None] * stride_w + cols[None, :], mask=live[:, None], other=0.0)
    w = w_in.to(tl.float32)
    s = tl.load(S_ptr + cols)  # [g] float32: this group's columns of the candidate's scales
    buf = w * s[None, :]
    w_max = tl.max(buf, axis=1)
    w_min = tl.min(buf, axis=1)
    if SYMMETRIC:  # primitives.symmetric_scale, zero 2^(b-1)
        half = (MAX_Q + 1) // 2 * 1.0
        m = tl.maximum(tl.maximum(tl.abs(w_min), tl.abs(w_max)), 1e-5)
        sc = div_scalar(tl.where(tl.abs(w_max) >= tl.abs(w_min), -m, m), half, inv_d, RECIP)
        z = tl.zeros_like(sc) + half
    else:  # primitives.qparams: (max - min) / (2^b - 1), zero round(-min / s) within [0, 2^b - 1]
        sc = div_scalar(tl.maximum(w_max - w_min, 1e-5), MAX_Q * 1.0, inv_d, RECIP)
        z = tl.minimum(tl.maximum(-round_half_even(tl.math.div_rn(w_min, sc)), 0.0), MAX_Q * 1.0) + 0.0
    q = tl.minimum(tl.maximum(round_half_even(tl.math.div_rn(buf, sc[:, None])) + z[:, None], 0.0), MAX_Q * 1.0)
    cand = tl.math.div_rn((q - z[:, None]) * sc[:, None], s[None, :])
    if BF16:
        cand = bf16_rne(cand)
    cand = cand.to(w_in.dtype)
    if DELTA:
        out = cand.to(tl.float32) - w
    else:
        out = cand
    tl.store(O_ptr + rows[:, None] * stride_o + cols[None, :], out.to(O_ptr.dtype.element_ty), mask=live[:, None])


def supports(w: torch.Tensor, group: int) -> bool:
    """Whether the kernel takes this weight and group size: a power-of-two group of 16 to 128 columns that divides
    the row, columns contiguous."""
    return 16 <= group <= 128 and group & (group - 1) == 0 and w.shape[1] % group == 0 and w.stride(1) == 1


def scaled_fake_quant_triton(w: torch.Tensor, s: torch.Tensor, spec, delta: bool = False,
                             out: torch.Tensor | None = None) -> torch.Tensor:
    """Drop-in for `awq_search._scaled_fake_quant` (`supports(w, spec.group)` must hold): w [out, in], s [in] ->
    Q(w · diag(s)) · diag(s)^-1 [out, in] in w's dtype; delta: that minus w, in float32 (or out's dtype).
    out: where to write it ([out, in], columns contiguous), e.g. one candidate's slice of a stacked buffer."""
    out_f, in_f = w.shape
    g, max_q = spec.group, 2**spec.w_bit - 1
    if out is None:
        out = torch.empty(out_f, in_f, dtype=torch.float32 if delta else w.dtype, device=w.device)
    divisor = 2 ** (spec.w_bit - 1) if spec.symmetric else max_q
    inv_d = (torch.tensor(1.0) / divisor).item()  # fp32 1/d, as aten's division by a scalar computes it on CUDA
    grid = (in_f // g, triton.cdiv(out_f, BLOCK_OUT))
    fake_quant_kernel[grid](w, w.stride(0), s.float().contiguous(), out, out.stride(0), out_f, inv_d, MAX_Q=max_q,
                            SYMMETRIC=spec.symmetric, RECIP=w.device.type == "cuda", DELTA=delta,
                            BF16=w.dtype == torch.bfloat16, GROUP=g,
                            BLOCK_R=BLOCK_OUT, num_warps=4, enable_fp_fusion=False)
    return out


def warm(launch: dict, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> None:
    """One launch with a run's settings on [rows, cols] weights, so that Triton compiles (or finds in its cache)
    the kernel the run will launch (`warmup`): launch holds group, w_bit, symmetric and delta."""
    spec = QSpec(launch["w_bit"], launch["group"], symmetric=launch["symmetric"])
    w = torch.randn(rows, cols, device=device).to(dtype)
    if not supports(w, spec.group):
        return
    s = torch.rand(cols, device=device) + 0.5
    if launch["delta"]:
        scaled_fake_quant_triton(w, s, spec, delta=True, out=torch.empty(rows, cols, device=device))
    else:
        scaled_fake_quant_triton(w, s, spec)

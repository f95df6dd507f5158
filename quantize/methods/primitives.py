"""Group-wise integer quantization primitives (fake-quant, qparams, codes).

Granularity: one (scale, zero) pair per `group` consecutive input columns of each output row.

| function      | in                          | out                                             |
|---------------|-----------------------------|-------------------------------------------------|
| qparams       | w [out, in]                 | scales [out, in // g], zeros [out, in // g] int |
| quantize      | w, scales, zeros            | codes [out, in] uint8 in [0, 2^b - 1]           |
| dequantize    | codes, scales, zeros        | w_hat [out, in]: (q - z) * s                    |
| dequantize_by_index | codes, scales, zeros, g_idx [in] | w_hat [out, in], column i in group g_idx[i] |
| fake_quant    | w [out, in]                 | dequantize(quantize(w))                         |
| fake_quant_   | wg [..., g], scales, zeros [...] | wg overwritten with its fake-quant on that grid |

Asymmetric (symmetric=False): s = (max - min) / (2^b - 1), z = round(-min / s).
Symmetric (symmetric=True): z = 2^(b-1) for every group (the value vLLM assumes for AutoAWQ GEMM without zero
points and for symmetric GPTQ), so the codes stand for -2^(b-1) .. 2^(b-1) - 1 steps; the full range of them is
used: the group's value of largest magnitude e lands exactly on the lowest, s = -e / 2^(b-1) (negative where e
is positive), as llama.cpp's Q4_0 and AutoRound set it. An absmax / (2^(b-1) - 1) scale would leave one of the
2^b codes unused.
"""

from __future__ import annotations

import torch


def _grouped(w: torch.Tensor, group: int) -> torch.Tensor:
    out, inp = w.shape
    assert inp % group == 0, f"in={inp} not divisible by group {group}"
    return w.reshape(out, inp // group, group)  # [out, n_group, g]


def symmetric_zero(w_bit: int) -> int:
    """The zero point of every symmetric group: 2^(b-1), the code that stands for 0."""
    return 2 ** (w_bit - 1)


def symmetric_scale(lo: torch.Tensor, hi: torch.Tensor, w_bit: int) -> torch.Tensor:
    """lo, hi: each group's extremes -> its full-range symmetric scale -e / 2^(b-1), e the extreme of larger
    magnitude (hi on a tie) and |e| at least 1e-5. Differentiable in lo and hi (the SignRound range factors)."""
    m = torch.maximum(lo.abs(), hi.abs()).clamp(min=1e-5)
    return torch.where(hi.abs() >= lo.abs(), -m, m) / 2 ** (w_bit - 1)


def qparams(w: torch.Tensor, w_bit: int, group: int, *, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [out, in] -> scales: [out, in // g] (fp32), zeros: [out, in // g] (int32)."""
    wg = _grouped(w.float(), group)  # [out, n_group, g]
    if symmetric:
        scales = symmetric_scale(wg.amin(dim=-1), wg.amax(dim=-1), w_bit)
        zeros = torch.full_like(scales, symmetric_zero(w_bit))
    else:
        max_int = 2**w_bit - 1
        w_max = wg.amax(dim=-1)
        w_min = wg.amin(dim=-1)
        scales = (w_max - w_min).clamp(min=1e-5) / max_int
        zeros = (-torch.round(w_min / scales)).clamp(0, max_int)
    return scales, zeros.to(torch.int32)


def quantize(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, w_bit: int) -> torch.Tensor:
    """w: [out, in], scales/zeros: [out, in // g] -> codes: [out, in] uint8 in [0, 2^b - 1]."""
    out, inp = w.shape
    group = inp // scales.shape[1]
    wg = _grouped(w.float(), group)  # [out, n_group, g]
    q = torch.round(wg / scales.float().unsqueeze(-1)) + zeros.float().unsqueeze(-1)
    q = q.clamp(0, 2**w_bit - 1)
    return q.reshape(out, inp).to(torch.uint8)  # [out, in]


def dequantize(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """codes: [out, in], scales/zeros: [out, in // g] -> w_hat: [out, in] fp32, (q - z) * s."""
    out, inp = codes.shape
    group = inp // scales.shape[1]
    q = _grouped(codes.float(), group)  # [out, n_group, g]
    w = (q - zeros.float().unsqueeze(-1)) * scales.float().unsqueeze(-1)
    return w.reshape(out, inp)


def dequantize_by_index(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                        g_idx: torch.Tensor) -> torch.Tensor:
    """codes: [out, in], scales/zeros: [out, n_group], g_idx: [in] -> w_hat: [out, in] fp32, where input column i
    takes group g_idx[i]'s scale and zero (activation-order checkpoints: groups are not runs of columns)."""
    idx = g_idx.to(torch.int64)
    return (codes.float() - zeros.float()[:, idx]) * scales.float()[:, idx]  # [out, n_group] -> [out, in]


def fake_quant(w: torch.Tensor, w_bit: int, group: int, *, symmetric: bool) -> torch.Tensor:
    """w: [out, in] -> the weight the quantized model computes with, same shape and dtype as w."""
    scales, zeros = qparams(w, w_bit, group, symmetric=symmetric)
    return dequantize(quantize(w, scales, zeros, w_bit), scales, zeros).to(w.dtype)


def fake_quant_(wg: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, w_bit: int) -> torch.Tensor:
    """wg: [..., g] grouped weights, scales/zeros: [...] (float) -> wg, overwritten with its fake-quant on that grid:
    `quantize` then `dequantize`, step for step (the same values), without a temporary per step."""
    sc, z = scales.unsqueeze(-1), zeros.unsqueeze(-1)
    return wg.div_(sc).round_().add_(z).clamp_(0, 2**w_bit - 1).sub_(z).mul_(sc)


def quantize_for_export(
    w: torch.Tensor, w_bit: int, group: int, *, symmetric: bool, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w: [out, in] -> (codes uint8 [out, in], scales [out, in // g] in scale_dtype, zeros int32 [out, in // g]).

    Scales are rounded to the stored dtype *before* the codes are computed, so dequantizing the stored
    tensors gives exactly the weight the codes were chosen for.
    """
    scales, zeros = qparams(w, w_bit, group, symmetric=symmetric)
    scales = scales.to(scale_dtype)
    codes = quantize(w, scales, zeros, w_bit)
    return codes, scales, zeros

"""GPTQ (Frantar et al. 2022): one-shot weight quantization with second-order error compensation.

Pure maths on tensors: no transformers import, no model-type branches. All arithmetic in float32.

    H = 2/n Σ x xᵀ                     (per linear, from its calibration inputs; see `HessianAccumulator`)
    H ← H + λ·mean(diag H)·I           (dampening; raised ×10 until the Cholesky factorisation succeeds)
    Hinv = chol(H⁻¹)ᵀ                  (upper Cholesky factor of the inverse)
    for each column i (in blocks of `block_size`, lazily applying updates to later blocks):
        q_i = Q(w_i);  err = (w_i − q_i) / Hinv[i, i]
        W[:, i:] −= err · Hinv[i, i:]

Group parameters: without act-order, each group's (scale, zero) come from the already-updated columns
when the sweep reaches the group's first column (classic GPTQ). With act-order, columns are visited in
descending diag(H) but groups stay *contiguous* in the original column order ("static" act-order): each
group's parameters are computed from the original weights before the sweep, so g_idx[i] = i // g and
vLLM (which rejects desc_act) serves the result.
Dead inputs (diag H = 0: never activated) get H[i, i] = 1 and W[:, i] = 0.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .primitives import qparams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GptqSpec:
    w_bit: int
    group: int  # -1 = one group per output row (per-channel)
    sym: bool
    block_size: int = 128
    damp: float = 0.01
    act_order: bool = False
    scale_dtype: torch.dtype = torch.float32  # scales are rounded to the stored dtype before codes are chosen


@dataclass
class GptqResult:
    """codes [out, in] uint8; scales [out, n_group] fp32; zeros [out, n_group] int32; stats."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    loss: float
    damp_used: float
    dead_columns: int


class HessianAccumulator:
    """Running H = 2/n Σ x xᵀ over batches of inputs x [..., in], in float32."""

    def __init__(self, in_features: int, device: torch.device | str = "cpu"):
        self.H = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()  # [tokens, in]
        t = x.shape[0]
        self.H.mul_(self.n / (self.n + t))
        self.n += t
        x = x * (2.0 / self.n) ** 0.5
        self.H.addmm_(x.t(), x)


def _inverse_cholesky(H: torch.Tensor, damp: float) -> tuple[torch.Tensor, float]:
    """Upper Cholesky factor of (H + λ·mean(diag)·I)⁻¹, raising λ ×10 until H is positive definite."""
    mean_diag = torch.mean(torch.diag(H)).item()
    eye = torch.eye(H.shape[0], dtype=H.dtype, device=H.device)
    lam = damp
    for _ in range(6):
        L, info = torch.linalg.cholesky_ex(H + lam * mean_diag * eye)
        if info.item() == 0:
            Hinv = torch.cholesky_inverse(L)
            U, info = torch.linalg.cholesky_ex(Hinv, upper=True)
            if info.item() == 0:
                if lam != damp:
                    log.warning("GPTQ: Hessian not positive definite with damp %.3g; used %.3g", damp, lam)
                return U, lam
        lam *= 10
    raise FloatingPointError(f"GPTQ: Hessian is not positive definite even with damp {lam / 10:.3g}; "
                             f"calibrate with more tokens (calibration.n_samples) or raise gptq.damp_percent")


def _qp(w: torch.Tensor, spec: GptqSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [out, g] -> scale [out], zero [out] (one group)."""
    s, z = qparams(w, spec.w_bit, w.shape[1], zero_point=not spec.sym)
    return s[:, 0].to(spec.scale_dtype).float(), z[:, 0]


def gptq_quantize(W: torch.Tensor, H: torch.Tensor, spec: GptqSpec) -> GptqResult:
    """W: [out, in], H: [in, in] -> codes [out, in], scales/zeros [out, in // g] (or [out, 1] for g = -1)."""
    W = W.float().clone()
    H = H.float().clone()
    out_f, in_f = W.shape
    g = in_f if spec.group == -1 else spec.group
    assert in_f % g == 0 and (spec.block_size % g == 0 or g % spec.block_size == 0 or spec.group == -1)
    n_group = in_f // g
    max_q = 2**spec.w_bit - 1

    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0

    scales = torch.zeros(out_f, n_group, device=W.device)
    zeros = torch.zeros(out_f, n_group, dtype=torch.int32, device=W.device)
    if spec.act_order:  # static groups: parameters from the original weights, before any update
        for j in range(n_group):
            scales[:, j], zeros[:, j] = _qp(W[:, j * g : (j + 1) * g], spec)
        perm = torch.argsort(torch.diag(H), descending=True)
    else:
        perm = torch.arange(in_f, device=W.device)
    W = W[:, perm]  # [out, in] in visiting order
    H = H[perm][:, perm]
    Hinv, lam = _inverse_cholesky(H, spec.damp)

    codes = torch.zeros(out_f, in_f, dtype=torch.uint8, device=W.device)  # in visiting order
    losses = torch.zeros(out_f, device=W.device)
    for i1 in range(0, in_f, spec.block_size):
        i2 = min(i1 + spec.block_size, in_f)
        W1 = W[:, i1:i2].clone()  # [out, b]
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = int(perm[i1 + i])
            j = col // g
            if not spec.act_order and (i1 + i) % g == 0:
                # the group's columns from here on, with every update so far (all inside W1 when g <= block)
                span = W1[:, i : i + g] if i + g <= W1.shape[1] else W[:, i1 + i : i1 + i + g]
                scales[:, j], zeros[:, j] = _qp(span, spec)
            w = W1[:, i]
            d = Hinv1[i, i]
            q = torch.clamp(torch.round(w / scales[:, j]) + zeros[:, j], 0, max_q)
            codes[:, i1 + i] = q.to(torch.uint8)
            dq = (q - zeros[:, j]) * scales[:, j]
            losses += (w - dq) ** 2 / d**2 / 2
            err = (w - dq) / d
            W1[:, i:] -= err.unsqueeze(1) @ Hinv1[i, i:].unsqueeze(0)
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    inv = torch.argsort(perm)
    return GptqResult(codes[:, inv].contiguous(), scales, zeros, losses.sum().item(), lam, int(dead.sum()))

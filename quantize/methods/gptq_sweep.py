"""GPTQ (Frantar et al. 2022): one-shot weight quantization with second-order error compensation.

Pure maths on tensors: no transformers import, no model-type branches. All arithmetic in float32 (float64
when given float64 weights: the tests' oracle).

    H = 2/n Σ x xᵀ                     (per linear, from its calibration inputs; `gptq_hessian.py`)
    H ← H + λ·mean(diag H)·I           (dampening; raised ×10 until the Cholesky factorisation succeeds)
    H = T·Tᵀ, T upper triangular (one Cholesky; see `_feedback_factor`)
    for each column i (in blocks of `block_size`, lazily applying updates to later blocks):
        q_i = Q(w_i);  W[:, i+1:] += d_i · A[i, i+1:]
    with act-order: A = T / diag(T) by columns and d_i = w⁰_i − q_i (w⁰: before any update), which is
    GPTQ's update with the upper Cholesky factor U = T⁻¹ of H⁻¹ without inverting anything (LDLQ);
    without: A = −U / diag(U) by rows and d_i = w_i − q_i (current w_i), GPTQ as published.

Group parameters: without act-order, each group's (scale, zero) come from the already-updated columns
when the sweep reaches the group's first column (classic GPTQ). With act-order, columns are visited in
descending diag(H) but groups stay *contiguous* in the original column order ("static" act-order): each
group's parameters are computed from the original weights before the sweep, so g_idx[i] = i // g and
vLLM (which rejects desc_act) serves the result.
Dead inputs (diag H = 0: never activated) get H[i, i] = 1 and W[:, i] = 0.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from .primitives import qparams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GptqSpec:
    w_bit: int
    group: int  # -1 = one group per output row (per-channel)
    symmetric: bool
    block_size: int = 128
    damp: float = 0.01
    act_order: bool = False
    scale_dtype: torch.dtype = torch.float32  # scales are rounded to the stored dtype before codes are chosen
    update: str = "float32"  # cross-block update's matmul: float32 | tf32 (10-bit operands; see `lazy_update`)


def spec_json(spec: GptqSpec) -> dict:
    """The spec as JSON values (the Triton warm-up's side process rebuilds it with `spec_from_json`)."""
    return {**asdict(spec), "scale_dtype": str(spec.scale_dtype).removeprefix("torch.")}


def spec_from_json(d: dict) -> GptqSpec:
    return GptqSpec(**{**d, "scale_dtype": getattr(torch, d["scale_dtype"])})


@dataclass
class GptqResult:
    """codes [out, in] uint8; scales [out, n_group] fp32; zeros [out, n_group] int32; row_loss [out]; stats."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    damp_used: float
    dead_columns: int
    row_loss: torch.Tensor
    kernel: str  # which sweep ran: torch | triton

    @property
    def loss(self) -> float:
        """GPTQ's loss Σ err² / 2 (read from the device when asked: a read waits for the queued work)."""
        return self.row_loss.sum().item()


def _factor_launch(H: torch.Tensor, lam: float, textbook: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One attempt of `_feedback_factor` at dampening λ -> (A, t, ok), ok a 0-dim bool tensor: the
    factorisation succeeded and A, t are finite. The host waits once, for the dampening scalar; the
    factorisation itself is only queued (on the current stream)."""
    Hd = H.clone()
    Hd.diagonal().add_(lam * torch.mean(torch.diagonal(H)).item())  # H + λ·mean(diag H)·I
    L, info = torch.linalg.cholesky_ex(Hd.flip(0, 1))
    del Hd
    if textbook:
        eye = torch.eye(H.shape[0], dtype=H.dtype, device=H.device)
        U = torch.linalg.solve_triangular(L, eye, upper=False).flip(0, 1)  # = T⁻¹, upper
        u = torch.diagonal(U).clone()
        A, t = U.div_(-u[:, None]), 1.0 / u
    else:
        T = L.flip(0, 1)  # upper triangular, H = T·Tᵀ
        t = torch.diagonal(T).clone()
        A = T.div_(t)
    ok = (info == 0) & torch.isfinite(A).all() & torch.isfinite(t).all() & (t > 0).all()
    return A, t, ok


def _feedback_factor(H: torch.Tensor, damp: float, textbook: bool, first: tuple | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, float]:
    """-> (A, t, λ) for the sweep's error feedback  W[:, k] += d_i · A[i, k]  (k > i), loss term (w_i − q_i)·t_i.

    H + λ·mean(diag)·I = T·Tᵀ with T upper triangular: one Cholesky of the reversed H (J·H·J = L·Lᵀ,
    T = J·L·J); λ is raised ×10 until it succeeds. first: the result of `_factor_launch(H, damp, textbook)`
    when it was already queued (on another stream).

    textbook=False (act-order, static groups): A = T / diag(T) (column k divided by T[k, k]), t = diag(T),
    and d_i = w⁰_i − q_i is the *final* rounding error of column i (w⁰: the weights before any update).
    Since GPTQ's upper Cholesky factor of H⁻¹ is U = T⁻¹, this is GPTQ's update summed differently (LDLQ,
    Chee et al. 2023, who show it equals GPTQ), and it needs no triangular inverse, which costs more than the
    Cholesky factorisation itself on down_proj's 18944² H (docs/BENCHMARKS.md).

    textbook=True (groups whose parameters come from partly updated columns): the intermediate column values
    differ between the two sums, so this keeps GPTQ's own: U = T⁻¹, A = −U / diag(U) (row i divided by
    U[i, i]), t = 1 / diag(U), and d_i = w_i − q_i from the *current* w_i.
    """
    lam = damp
    for attempt in range(6):
        A, t, ok = first if attempt == 0 and first is not None else _factor_launch(H, lam, textbook)
        if bool(ok):
            if lam != damp:
                log.warning("GPTQ: Hessian not positive definite with damp %.3g; used %.3g", damp, lam)
            return A, t, lam
        lam *= 10
    raise FloatingPointError(f"GPTQ: Hessian is not positive definite even with damp {lam / 10:.3g}; "
                             f"calibrate with more tokens (calibration.n_samples) or raise gptq.damp_percent")


def _qp(w: torch.Tensor, spec: GptqSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [out, g] -> scale [out], zero [out] (one group)."""
    s, z = qparams(w, spec.w_bit, w.shape[1], symmetric=spec.symmetric)
    return s[:, 0].to(spec.scale_dtype).float(), z[:, 0]


def _static_qparams(W: torch.Tensor, g: int, spec: GptqSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """W: [out, in] -> scales [out, in // g] (rounded to spec.scale_dtype), zeros [out, in // g]."""
    s, z = qparams(W, spec.w_bit, g, symmetric=spec.symmetric)
    return s.to(spec.scale_dtype).float(), z


@dataclass
class _Problem:
    """One linear (or row-stacked linears sharing H) ready for the sweep: weights and H in visiting order."""

    W: torch.Tensor
    H: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    perm: torch.Tensor
    gidx: list[int]
    g: int
    dead: int


def _prepare(W: torch.Tensor, H: torch.Tensor, spec: GptqSpec, grid: tuple | None = None) -> _Problem:
    if grid is not None and not spec.act_order:
        raise ValueError("a given grid is static group parameters: it needs act_order (static groups)")
    dtype = torch.float64 if W.dtype == torch.float64 else torch.float32
    W = W.to(dtype, copy=True)
    H = H.to(dtype, copy=True)
    out_f, in_f = W.shape
    g = in_f if spec.group == -1 else spec.group
    assert in_f % g == 0 and (spec.block_size % g == 0 or g % spec.block_size == 0 or spec.group == -1)

    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0

    if grid is not None:  # static groups, parameters chosen by the caller (e.g. an AWQ clip search)
        scales, zeros = grid[0].to(W.device, spec.scale_dtype).float(), grid[1].to(W.device, torch.int32)
        assert scales.shape == (out_f, in_f // g)
        perm = torch.argsort(torch.diag(H), descending=True)
    elif spec.act_order:  # static groups: parameters from the original weights, before any update
        scales, zeros = _static_qparams(W, g, spec)
        perm = torch.argsort(torch.diag(H), descending=True)
    else:  # filled in during the sweep, from the updated weights
        scales = torch.zeros(out_f, in_f // g, device=W.device)  # float32: scales are stored rounded
        zeros = torch.zeros(out_f, in_f // g, dtype=torch.int32, device=W.device)
        perm = torch.arange(in_f, device=W.device)
    gidx = [int(c) // g for c in perm.tolist()]  # group of each visited column (one host copy, not one per column)
    return _Problem(W[:, perm], H[perm][:, perm], scales, zeros, perm, gidx, g, int(dead.sum()))


def _solve(p: _Problem, spec: GptqSpec, sweep: Sweep, first: tuple | None = None) -> GptqResult:
    A, t, lam = _feedback_factor(p.H, spec.damp, textbook=not spec.act_order, first=first)
    p.H = None  # free it before the sweep
    W0 = p.W.clone() if spec.act_order else p.W  # d_i = W0_i − q_i: the weights before any feedback (LDLQ)
    codes, row_loss = sweep.run(p.W, W0, A, t, p.scales, p.zeros, p.gidx, p.g, spec)  # codes in visiting order
    inv = torch.argsort(p.perm)
    return GptqResult(codes[:, inv].contiguous(), p.scales, p.zeros, lam, p.dead, row_loss, sweep.name)


def gptq_quantize(W: torch.Tensor, H: torch.Tensor, spec: GptqSpec, grid: tuple | None = None,
                  sweep: Sweep | None = None) -> GptqResult:
    """W: [out, in], H: [in, in] -> codes [out, in], scales/zeros [out, in // g] (or [out, 1] for g = -1).

    grid: (scales, zeros) [out, in // g] to round on instead of the weights' own min/max (static groups:
    spec.act_order must be set); the scales are rounded to spec.scale_dtype. Only the rounding is GPTQ's then.
    Rows are independent given H: quantizing a row-concatenation of linears that share H gives exactly
    the codes of separate calls (one sweep instead of several).
    """
    return _solve(_prepare(W, H, spec, grid), spec, sweep or TORCH_SWEEP)


def gptq_quantize_many(problems: list[tuple[torch.Tensor, torch.Tensor]], spec: GptqSpec,
                       grids: list[tuple | None] | None = None, sweep: Sweep | None = None,
                       side: "torch.cuda.Stream | None" = None) -> list[GptqResult]:
    """Several independent (W, H) problems (e.g. every linear of a layer whose Hessians came from one
    forward), with optional grids (see `gptq_quantize`) -> their results, each exactly what `gptq_quantize` gives.

    side: a CUDA stream (`device.side_stream`): the widest problem's factorisation (down_proj's 18944² Cholesky)
    is queued on it first and runs while the others are factorised and swept on the main
    stream. sweep: the column sweep (`device.gptq_sweep`; default the torch one).
    """
    grids = grids or [None] * len(problems)
    sweep = sweep or TORCH_SWEEP
    if len(problems) < 2 or side is None or not problems[0][0].is_cuda:
        return [gptq_quantize(W, H, spec, grid, sweep) for (W, H), grid in zip(problems, grids)]
    big = max(range(len(problems)), key=lambda i: problems[i][1].shape[0])
    main = torch.cuda.current_stream(problems[big][0].device)
    p_big = _prepare(*problems[big], spec, grids[big])
    side.wait_stream(main)
    with torch.cuda.stream(side):
        p_big.H.record_stream(side)
        first = _factor_launch(p_big.H, spec.damp, textbook=not spec.act_order)
    for x in first:
        x.record_stream(main)
    out: list[GptqResult | None] = [None] * len(problems)
    for i, (W, H) in enumerate(problems):
        if i != big:
            out[i] = gptq_quantize(W, H, spec, grids[i], sweep)
    main.wait_stream(side)
    out[big] = _solve(p_big, spec, sweep, first=first)
    return out


def _block_start_qparams(W: torch.Tensor, i1: int, g: int, gidx: list[int], scales, zeros, spec: GptqSpec) -> bool:
    """Without act-order and g >= block: a group starting at block start i1 gets its (scale, zero) from the
    updated W[:, i1 : i1 + g] (every earlier block's lazy update applied) -> True when it did."""
    if spec.act_order or i1 % g:
        return False
    j = gidx[i1]
    scales[:, j], zeros[:, j] = _qp(W[:, i1 : i1 + g], spec)
    return True


def _tf32(x: torch.Tensor) -> torch.Tensor:
    """x (float32) rounded to TF32's 10-bit mantissa (nearest, ties away), as tensor cores read it."""
    bits = x.contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


def lazy_update(W: torch.Tensor, i2: int, D1: torch.Tensor, A_rows: torch.Tensor, spec: GptqSpec) -> None:
    """The sweep's cross-block update W[:, i2:] += D1 @ A_rows[:, i2:], in place (one GEMM that reads and writes
    W[:, i2:] once: no product temporary and no separate add).

    update float32: a float32 GEMM. update tf32 (float32 weights only): the operands are rounded to TF32 (10-bit
    mantissa) and products summed in float32, on CUDA by the tensor cores (several times the float32
    rate) and elsewhere emulated by rounding the operands, so the CPU measures the same approximation.
    """
    rest, A = W[:, i2:], A_rows[:, i2:]
    if spec.update == "float32" or W.dtype != torch.float32:
        rest.addmm_(D1, A)
    elif spec.update != "tf32":
        raise ValueError(f"gptq update {spec.update!r} is unknown; use float32 or tf32")
    elif W.is_cuda:
        before = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            rest.addmm_(D1, A)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = before
    else:
        rest.addmm_(_tf32(D1), _tf32(A))


def _sweep_torch(W: torch.Tensor, W0: torch.Tensor, A: torch.Tensor, t: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor, gidx: list[int], g: int, spec: GptqSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The column sweep with torch ops. W: [out, in] (visiting order, updated in place), W0: W before any
    update (read with act-order only), A: [in, in] upper, t: [in] (see `_feedback_factor`).

    scales/zeros [out, n_group] are read (act-order) or filled in (otherwise) -> codes [out, in] uint8 in
    visiting order, row_loss [out] = Σ_i err_i² / 2 with err_i = (w_i − q_i) · t_i (GPTQ's loss).
    Without act-order the feedback uses the current column (textbook GPTQ), with it the original one.
    """
    out_f, in_f = W.shape
    max_q = 2**spec.w_bit - 1
    codes = torch.zeros(out_f, in_f, dtype=torch.uint8, device=W.device)
    row_loss = torch.zeros(out_f, device=W.device, dtype=W.dtype)
    for i1 in range(0, in_f, spec.block_size):
        i2 = min(i1 + spec.block_size, in_f)
        if g >= i2 - i1:
            _block_start_qparams(W, i1, g, gidx, scales, zeros, spec)
        W1 = W[:, i1:i2].clone()  # [out, b]
        Q1 = torch.zeros_like(W1)
        D1 = torch.zeros_like(W1)
        Err1 = torch.zeros_like(W1)
        A1 = A[i1:i2, i1:i2]
        for i in range(i2 - i1):
            j = gidx[i1 + i]
            if not spec.act_order and g < i2 - i1 and i % g == 0:  # group inside the block: updated columns
                scales[:, j], zeros[:, j] = _qp(W1[:, i : i + g], spec)
            s, z = scales[:, j], zeros[:, j]
            w = W1[:, i]
            q = torch.clamp(torch.round(w / s) + z, 0, max_q)
            Q1[:, i] = q
            deq = (q - z) * s
            d = (W0[:, i1 + i] if spec.act_order else w) - deq
            W1[:, i + 1 :] += d.unsqueeze(1) * A1[i, i + 1 :]
            D1[:, i] = d
            Err1[:, i] = (w - deq) * t[i1 + i]
        codes[:, i1:i2] = Q1.to(torch.uint8)
        row_loss += Err1.pow(2).sum(dim=1) / 2
        lazy_update(W, i2, D1, A[i1:i2], spec)
    return codes, row_loss


@dataclass(frozen=True)
class Sweep:
    """An in-block column sweep: `run(W, W0, A, t, scales, zeros, gidx, g, spec) -> (codes, row_loss)`; every
    sweep gives the same codes (`_sweep_torch` is the reference; `device.gptq_sweep` picks one)."""

    name: str
    run: Callable


TORCH_SWEEP = Sweep("torch", _sweep_torch)

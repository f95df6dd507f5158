"""SignRound's per-layer job: tune every converted linear's rounding offsets and group ranges against the
unquantized layer's outputs by signed gradient descent, then store the codes (see signround.py for the method).

One step: the layer runs on `samples_per_step` calibration samples of its quantized chain's inputs (whole batches,
visited in a seeded random order) with each converted linear's weight replaced by its fake-quantized form; the
mean squared error to the FP layer's outputs on the FP inputs is backpropagated to the offsets V and the range
factors, each moves by lr·sign(gradient) (lr decays linearly to 0), then V is clamped to [-0.5, 0.5] and the
factors to [0, 1]. The parameters that gave the lowest loss are kept.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn as nn
from torch.func import functional_call

from ..capture.device import clock as _clock
from ..capture.loop import LayerData
from .layer import first_output, local_linears, moe_linears, owned, qspec, round_to_nearest, store
from .primitives import symmetric_scale

log = logging.getLogger(__name__)


def _round_ste(x: torch.Tensor) -> torch.Tensor:
    """round(x) forward, identity backward (the straight-through estimator)."""
    return (x.round() - x).detach() + x


class _Tuned:
    """One linear's weight and its tunable rounding: offsets V [out, n_group, g], factors on each group's min
    and max [out, n_group] (float32 leaves)."""

    def __init__(self, w: torch.Tensor, w_bit: int, group: int, symmetric: bool, tune_range: bool):
        out, inp = w.shape
        self.shape, self.w_bit, self.symmetric = w.shape, w_bit, symmetric
        self.wg = w.detach().float().reshape(out, inp // group, group)
        self.wmin, self.wmax = self.wg.amin(dim=-1), self.wg.amax(dim=-1)
        self.v = torch.zeros_like(self.wg, requires_grad=True)
        self.lo = torch.ones_like(self.wmin, requires_grad=tune_range)
        self.hi = torch.ones_like(self.wmax, requires_grad=tune_range)

    def params(self) -> list[torch.Tensor]:
        return [p for p in (self.v, self.lo, self.hi) if p.requires_grad]

    def qparams(self, ste: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (scales, zeros) [out, n_group] float32, as `primitives.qparams` computes them (factors of 1 give
        exactly its values); zeros rounded through the straight-through estimator when `ste`."""
        lo, hi = self.wmin * self.lo, self.wmax * self.hi
        if self.symmetric:
            scales = symmetric_scale(lo, hi, self.w_bit)
            return scales, torch.full_like(scales, 2 ** (self.w_bit - 1))
        max_int = 2**self.w_bit - 1
        scales = (hi - lo).clamp(min=1e-5) / max_int
        z = -lo / scales
        return scales, (_round_ste(z) if ste else z.round()).clamp(0, max_int)

    def fake(self) -> torch.Tensor:
        """The weight the quantized layer computes with, differentiable in V and the factors: [out, in] float32."""
        scales, zeros = self.qparams(ste=True)
        s, z = scales.unsqueeze(-1), zeros.unsqueeze(-1)
        q = (_round_ste(self.wg / s + self.v) + z).clamp(0, 2**self.w_bit - 1)
        return ((q - z) * s).reshape(self.shape)

    def export(self, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (codes uint8 [out, in], scales [out, n_group] in scale_dtype, zeros int32): scales rounded to the
        stored dtype before the codes are chosen, so the stored tensors dequantize to what the codes stand for."""
        with torch.no_grad():
            scales, zeros = self.qparams(ste=False)
            scales = scales.to(scale_dtype)
            s, z = scales.float().unsqueeze(-1), zeros.unsqueeze(-1)
            q = (torch.round(self.wg / s + self.v) + z).clamp(0, 2**self.w_bit - 1)
        return q.reshape(self.shape).to(torch.uint8), scales, zeros.to(torch.int32)

    def snapshot(self) -> list[torch.Tensor]:
        return [t.detach().clone() for t in (self.v, self.lo, self.hi)]

    def restore(self, saved: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for t, s in zip((self.v, self.lo, self.hi), saved):
                t.copy_(s)

    def step(self, lr: float) -> None:
        with torch.no_grad():
            for p in self.params():
                p.sub_(lr * p.grad.sign())
                p.grad = None
            self.v.clamp_(-0.5, 0.5)
            self.lo.clamp_(0, 1)
            self.hi.clamp_(0, 1)


def _visits(n_batches: int, per_step: int, steps: int, seed: int) -> list[list[int]]:
    """The calibration batches each step runs: a seeded random order of all batches, drawn `per_step` at a time,
    a fresh order whenever one is used up."""
    g = torch.Generator().manual_seed(seed)
    order: list[int] = []
    out = []
    for _ in range(steps):
        take = []
        while len(take) < per_step:
            if not order:
                order = torch.randperm(n_batches, generator=g).tolist()
            take.append(order.pop(0))
        out.append(take)
    return out


def tune(layer: nn.Module, names: list[str], data: LayerData, recipe, scale_dtype: torch.dtype) -> tuple[dict, dict]:
    """SignRound over one decoder layer's linears `names` -> (name -> (codes, scales, zeros), statistics)."""
    o, spec = recipe.method_options("signround"), qspec(recipe)
    layer.requires_grad_(False)
    tuned = {}
    for n in names:
        w = layer.get_submodule(n).weight
        tuned[n] = _Tuned(w, spec.w_bit, w.shape[1] if spec.group == -1 else spec.group, spec.symmetric,
                          o.tune_range)
    dtype = next(layer.parameters()).dtype
    per_step = max(1, math.ceil(o.samples_per_step / data.inputs[0].shape[0]))  # whole batches a step
    lr0 = o.lr if o.lr is not None else 1.0 / max(o.iters, 1)

    def loss_of(batches: list[int]) -> float:
        total = 0.0
        weights = {f"{n}.weight": t.fake().to(dtype) for n, t in tuned.items()}
        for b in batches:
            y = first_output(functional_call(layer, weights, (data.inputs[b],), data.kwargs[b]))
            loss = torch.nn.functional.mse_loss(y.float(), data.fp_outputs[b].float()) / len(batches)
            loss.backward(retain_graph=b != batches[-1])
            total += float(loss.detach())
        return total

    best, best_loss, first, skipped = None, math.inf, None, 0
    for k, batches in enumerate(_visits(len(data.inputs), min(per_step, len(data.inputs)), o.iters, o.seed)):
        loss = loss_of(batches)
        first = loss if first is None else first
        if not (math.isfinite(loss) and all(bool(torch.isfinite(p.grad).all()) for t in tuned.values()
                                            for p in t.params())):
            # a half-precision forward that overflowed: its gradient's signs mean nothing, so no step is taken
            skipped += 1
            for t in tuned.values():
                for p in t.params():
                    p.grad = None
            continue
        if loss < best_loss:
            best, best_loss = [t.snapshot() for t in tuned.values()], loss
        lr = lr0 * (1 - k / o.iters)
        for t in tuned.values():
            t.step(lr)
    if best is not None:
        for t, saved in zip(tuned.values(), best):
            t.restore(saved)
    if skipped:
        log.warning("SignRound: %d of %d steps gave a non-finite loss or gradient and were skipped; consider "
                    "compute_dtype: float32", skipped, o.iters)
    stats = {"steps": o.iters, "skipped_steps": skipped, "loss_start": first,
             "loss_best": None if best is None else best_loss}
    return {n: t.export(scale_dtype) for n, t in tuned.items()}, stats


def signround_layer(data: LayerData, job) -> dict:
    """Tune and store the converted linears of one dense decoder layer -> its statistics. Under several ranks one
    rank tunes the layer (every rank holds all batches' inputs and targets) and the codes are shared."""
    names = local_linears(job.arch, data.index, job.convert)
    if not names:
        return {}
    layer, device = data.layer, next(data.layer.parameters()).device
    t0 = _clock(device)
    with torch.enable_grad():
        if job.dist is None:
            codes, stats = tune(layer, names, data, job.recipe, job.scale_dtype)
        else:
            size = float(sum(layer.get_submodule(n).weight.numel() for n in names))
            codes, stats = owned(job.dist, [(size, lambda: tune(layer, names, data, job.recipe, job.scale_dtype))])[0]
    prefix = job.prefix(data.index)
    for n in names:
        store(layer, n, prefix, *codes[n], job.results)
    seconds = _clock(device) - t0
    if job.runlog is not None:
        job.runlog.stage(data.index, job.recipe.name, "signround", tune=seconds)
    log.debug("layer %d: SignRound loss %.3g -> %.3g in %.1f s", data.index + 1, stats["loss_start"] or 0,
              stats["loss_best"] or 0, seconds)
    return stats


def signround_experts(data: LayerData, job) -> dict:
    """A mixture-of-experts block's experts are rounded to nearest: the layer's tuning ran with them unquantized,
    and tuning each expert on its routed tokens is not part of this method yet."""
    names = moe_linears(data.layer, job.arch, data.index, job.convert)
    round_to_nearest(data.layer, names, qspec(job.recipe), job.scale_dtype, job.prefix(data.index), job.results)
    return {"expert_rounding": "nearest"}

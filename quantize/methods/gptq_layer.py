"""GPTQ's per-layer job: per sequential stage, Hessians of the inputs (on quantized predecessors), then the
column sweep of `quantize/methods/gptq_sweep.py`; a mixture-of-experts block expert by expert on its routed tokens.

Under several ranks the Hessians are summed over the ranks' shares of the batches and each sweep's rows are
split between them (docs/DISTRIBUTED.md).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from . import gptq_hessian, gptq_sweep as gptq, output_error
from ..source.arch import Arch, layer_prefix
from ..capture.forward import feed_inputs
from ..capture.loop import LayerData
from ..capture.device import clock as _clock, side_stream
from .kernels import gptq_sweep
from ..capture.distributed import Dist
from ..runlog import RunLog
from .base import ERRORS
from .layer import QuantResult, expert_hidden, feature_of, local_linears, moe_linears, read_back, routing, store, \
    store_rows, unit_inputs, units

log = logging.getLogger(__name__)


def gptq_spec(recipe, scale_dtype: torch.dtype) -> gptq.GptqSpec:
    o, fast = recipe.gptq, recipe.advanced.gptq
    return gptq.GptqSpec(recipe.w_bit, recipe.q_group_size, recipe.symmetric, o.block_size, o.damp_percent,
                         o.act_order, scale_dtype, fast.update)


def sweep_launch(recipe, grid: bool) -> dict:
    """The Triton warm-up's launch of the sweep this recipe runs: the run's own spec as JSON, which the side
    process rebuilds (`gptq_triton.warm`); grid: on AWQ's clip grid, with act_order on as `awq_layer` sets it."""
    spec = gptq_spec(recipe, getattr(torch, recipe.dtype))
    if grid:
        spec = dataclasses.replace(spec, act_order=True)
    return {"module": "gptq_triton", "group": spec.group, "spec": gptq.spec_json(spec), "grid": grid}


class _FpCross:
    """Running Σ (x_fp − x)ᵀ x over the batches of one linear input: x as the quantized chain feeds it, x_fp the
    same rows of `LayerData.fp_features` (what the unquantized model feeds it). Float32 sums; `mean` scales them
    like the Hessian (2/n), so W·C·H⁻¹ is the least-squares correction of `toward_fp`."""

    def __init__(self, fp: torch.Tensor, start: int = 0):
        self.fp, self.row = fp, start
        self.sum = torch.zeros(fp.shape[1], fp.shape[1], dtype=torch.float32, device=fp.device)

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        ref = self.fp[self.row : self.row + x.shape[0]].to(x.device).float()
        self.row += x.shape[0]
        self.sum.addmm_((ref - x).t(), x)

    def mean(self, tokens: int) -> torch.Tensor:
        return self.sum.mul_(2.0 / tokens)


def toward_fp(W: torch.Tensor, H: torch.Tensor, C: torch.Tensor, alpha: float, damp: float) -> torch.Tensor:
    """W moved the fraction alpha towards the least-squares fit of the FP outputs on the quantized inputs:
    W + alpha·W·C·(H + λI)⁻¹, with H = 2/n X̃ᵀX̃, C = 2/n (X − X̃)ᵀX̃ and GPTQ's dampening λ = damp·mean(diag H)
    (a ridge fit: columns the calibration barely excites barely move; dead columns keep a unit diagonal)."""
    Hd = H.clone()
    diag = Hd.diagonal()
    diag[diag == 0] = 1
    diag.add_(damp * diag.mean())
    L, info = torch.linalg.cholesky_ex(Hd)
    if int(info):  # not positive definite even damped: the sweep's own factorisation raises the dampening and says so
        return W
    shift = torch.cholesky_solve((W.float() @ C).t(), L).t()  # (H⁻¹ (W C)ᵀ)ᵀ = W C H⁻¹ (H symmetric)
    return (W.float() + alpha * shift).to(W.dtype)


def _summed_hessians(data: LayerData, keys: list[str], dist: Dist,
                     cross: dict[str, _FpCross] | None = None) -> dict[str, torch.Tensor]:
    """The Hessians 2·XᵀX / n of the inputs of linears `keys` over every rank's tokens: each rank sums xᵀx over
    its share of the batches (`gptq_hessian.HessianAccumulator.add_sum`: float32 sums, half-precision inputs through
    float32-accumulating products, wide inputs by the upper blocks), the sums are added over ranks and divided
    by the total token count once. Exact sums, not a mean of means; the additions run in another order than one
    process's running mean, so H differs from it in the last bits (docs/DISTRIBUTED.md: what that does)."""
    layer, mine = data.layer, dist.span(len(data.inputs))
    accs = {k: gptq_hessian.HessianAccumulator(layer.get_submodule(k).in_features, data.inputs[0].device) for k in keys}
    if cross is not None:  # this rank's batches start this many rows into the gathered FP inputs
        start = sum(t.shape[0] * t.shape[1] for t in data.inputs[: mine.start])
        cross.update({k: _FpCross(data.fp_features[k], start) for k in keys})

    def on_input(k: str, x: torch.Tensor) -> None:
        accs[k].add_sum(x)
        if cross is not None:
            cross[k].add(x)
    if len(mine):
        dist.agree(lambda: feed_inputs(layer, data.inputs[mine.start : mine.stop],
                                       data.kwargs[mine.start : mine.stop], keys, on_input))
    else:
        dist.agree(lambda: None)
    n = sum(t.shape[0] * t.shape[1] for t in data.inputs)
    if cross is not None:
        for c in cross.values():
            dist.all_sum(c.sum)
    return {k: acc.reduced(dist.all_sum, n) for k, acc in accs.items()}


def _row_split_solve(problems: list[tuple[torch.Tensor, torch.Tensor]], spec: gptq.GptqSpec, sweep, device,
                     dist: Dist) -> list[gptq.GptqResult]:
    """`gptq.gptq_quantize_many` with each problem's rows split over the ranks (rows are independent given H:
    every rank factorises the same H, sweeps its contiguous share of the rows) -> the results, rows joined."""
    def fields(x: gptq.GptqResult) -> tuple:
        return x.codes, x.scales, x.zeros, x.row_loss, x.damp_used, x.dead_columns, x.kernel

    def mine():
        spans = [dist.span(w.shape[0]) for w, _ in problems]
        todo = [(w[r.start : r.stop], h) for (w, h), r in zip(problems, spans) if len(r)]
        solved = iter(gptq.gptq_quantize_many(todo, spec, sweep=sweep, side=side_stream(device)) if todo else [])
        return [fields(next(solved)) if len(r) else None for r in spans]
    parts = dist.gather(dist.attempt(mine))
    out = []
    for i in range(len(problems)):
        got = [p[i] for p in parts if p[i] is not None]
        codes, scales, zeros, row_loss = (torch.cat([g[j] for g in got]) for j in range(4))
        out.append(gptq.GptqResult(codes, scales, zeros, max(g[4] for g in got), got[0][5], row_loss, got[0][6]))
    return out


def gptq_layer(data: LayerData, arch: Arch, recipe, convert: set[str], scale_dtype: torch.dtype,
               results: dict[str, QuantResult], runlog: RunLog | None = None, dist: Dist | None = None) -> dict:
    """GPTQ for one decoder layer: per stage, accumulate Hessians (on quantized predecessors), quantize.
    Each stage's Hessian and sweep seconds go to runlog. dist: Hessians summed over the ranks' shares of the
    batches (`_summed_hessians`), each sweep's rows split over the ranks (`_row_split_solve`). gptq.fp_target > 0:
    each problem's weights first move towards the fit of the FP outputs (`toward_fp`, data.fp_features)."""
    layer, opts = data.layer, recipe.gptq
    local = local_linears(arch, data.index, convert)
    stages = arch.sequential if opts.true_sequential else (tuple(arch.linears),)
    input_of = feature_of(arch)
    spec = gptq_spec(recipe, scale_dtype)
    aim = opts.fp_target > 0 and bool(data.fp_features)  # GPTAQ's FP target (`GptqOptions.fp_target`)
    stats: dict = {}
    device = data.inputs[0].device
    sweep = gptq_sweep(recipe.advanced.gptq.kernel, device)
    seconds = {"hessian": 0.0, "sweep": 0.0}
    losses: dict[str, torch.Tensor] = {}  # read back once per layer, not once per linear (each read waits)
    errors: dict[str, torch.Tensor] = {}  # relative output error on the calibration inputs (`output_error`)
    for stage in stages:
        names = [n for n in stage if n in local]
        if not names:
            continue
        t0 = _clock(device)
        keys = sorted({input_of[n] for n in names}, key=arch.linears.index)  # one Hessian per shared input
        cross: dict[str, _FpCross] | None = {} if aim else None
        if dist is None:
            accs = {k: gptq_hessian.HessianAccumulator(layer.get_submodule(k).in_features, data.inputs[0].device)
                    for k in keys}
            if cross is not None:
                cross.update({k: _FpCross(data.fp_features[k]) for k in keys})

            def on_input(k: str, x: torch.Tensor) -> None:
                accs[k].add(x)
                if cross is not None:
                    cross[k].add(x)
            feed_inputs(layer, data.inputs, data.kwargs, keys, on_input)
            hessians = {k: accs[k].H for k in keys}
        else:
            hessians = _summed_hessians(data, keys, dist, cross)
        t1 = _clock(device)
        seconds["hessian"] += t1 - t0
        groups = [[n for n in names if input_of[n] == key] for key in keys]  # linears sharing one Hessian
        weights = [[layer.get_submodule(n).weight.data for n in shared] for shared in groups]
        # one sweep over the row-concatenated weights of each group; independent groups (one-pass Hessians)
        # overlap on CUDA
        problems = [(torch.cat(w), hessians[k]) for w, k in zip(weights, keys)]
        if cross is not None:
            tokens = sum(t.shape[0] * t.shape[1] for t in data.inputs)
            problems = [(toward_fp(w, h, cross.pop(k).mean(tokens), opts.fp_target, opts.damp_percent), h)
                        for (w, h), k in zip(problems, keys)]
        if dist is None:
            solved = gptq.gptq_quantize_many(problems, spec, sweep=sweep, side=side_stream(device))
        else:
            solved = _row_split_solve(problems, spec, sweep, device, dist)
        for shared, ws, r in zip(groups, weights, solved):
            rows = [w.shape[0] for w in ws]
            parts = zip(*([p.clone() for p in t.split(rows)] for t in (r.codes, r.scales, r.zeros, r.row_loss)))
            for n, (codes, scales, zeros, row_loss) in zip(shared, parts):
                store(layer, n, layer_prefix(arch, data.index), codes, scales.to(scale_dtype), zeros, results)
                losses[n] = row_loss.sum()
                stats[n] = {"damp": r.damp_used, "dead_columns": r.dead_columns, "kernel": r.kernel}
        if data.replay is not None:  # final now: the later stages' forwards and the chain's reuse their outputs
            data.replay.freeze(names)
        for shared, ws, k in zip(groups, weights, keys):
            for n, w in zip(shared, ws):
                errors[n] = output_error.from_hessian(w, layer.get_submodule(n).weight.data, hessians[k])
        t2 = _clock(device)
        seconds["sweep"] += t2 - t1
        log.debug("layer %d stage %s: hessian %.4f s, sweep %.4f s", data.index + 1, "+".join(names), t1 - t0,
                  t2 - t1)
        if runlog is not None:
            runlog.stage(data.index, recipe.name, "+".join(names), hessian=t1 - t0, sweep=t2 - t1)
    if losses:
        for n, loss in zip(losses, torch.stack(list(losses.values())).tolist()):
            stats[n] = {"loss": loss, **stats[n]}
    stats["seconds"] = {k: round(v, 4) for k, v in seconds.items()}
    stats[ERRORS] = read_back(errors)
    return stats


def gptq_moe(data: LayerData, arch: Arch, recipe, convert: set[str], scale_dtype: torch.dtype,
             results: dict[str, QuantResult]) -> dict:
    """GPTQ for a MoE block on the quantized attention's output: each MLP in turn (the shared expert on every
    token, each routed expert on its routed tokens): gate and up on one Hessian, then down on the quantized
    gate/up's output. One expert's Hessian and inputs are held at a time -> stats."""
    layer, x_ = data.layer, arch.experts
    local = set(moe_linears(layer, arch, data.index, convert))
    if not local:
        return {}
    parts: list[torch.Tensor] = []
    feed_inputs(layer, data.inputs, data.kwargs, [x_.router], lambda _n, h: parts.append(h.reshape(-1, h.shape[-1])))
    x = torch.cat(parts)  # [T, H]
    del parts
    _, rows, record = routing(layer, arch, x, recipe)
    spec, device = gptq_spec(recipe, scale_dtype), x.device
    sweep, side = gptq_sweep(recipe.advanced.gptq.kernel, device), side_stream(device)
    losses, dead = [], 0
    for path, e in units(layer, arch):
        xe = unit_inputs(x, rows, e)
        mlp = layer.get_submodule(path)
        for stage in (("gate_proj", "up_proj"), ("down_proj",)):
            names = [n for n in stage if f"{path}.{n}" in local]
            if not names:
                continue
            with torch.no_grad():
                z = xe if stage[0] == "gate_proj" else expert_hidden(mlp, xe)  # [n, in]
            acc = gptq_hessian.HessianAccumulator(z.shape[1], device)
            acc.add(z)
            del z
            ws = [mlp.get_submodule(n).weight.data for n in names]
            (r,) = gptq.gptq_quantize_many([(torch.cat(ws), acc.H)], spec, sweep=sweep, side=side)
            del acc
            store_rows(layer, [f"{path}.{n}" for n in names], layer_prefix(arch, data.index), r, scale_dtype,
                        results)
            losses.append(r.row_loss.sum())
            dead += r.dead_columns
    return {"experts": {**record, "loss": float(torch.stack(losses).sum()) if losses else 0.0,
                        "dead_columns": dead}}

"""Apply a method to a model: joins the architecture table, the capture loop and the pure algorithms.

The result of quantizing is data: for every converted linear, its integer codes, scales and zero points
(`QuantResult`). The in-memory model is left holding the dequantized weights, so it computes exactly what
the exported artifact computes. `convert` is the set of full module names the pre-flight plan approved.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.nn as nn

from . import awq, gptq
from .arch import Arch, active_scale_groups, decoder_layers, layer_prefix
from .capture import LayerData, layer_forward, run_layerwise
from .primitives import dequantize, quantize_for_export

log = logging.getLogger(__name__)


@dataclass
class QuantResult:
    """One converted linear: codes [out, in] uint8, scales [out, n_group] (stored dtype), zeros int32."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor


def is_skipped(name: str, modules_to_not_convert: tuple[str, ...]) -> bool:
    """vLLM's rule for AWQ: a module is left unconverted when any entry is a substring of its name."""
    return any(m in name for m in modules_to_not_convert)


def _local(arch: Arch, index: int, convert: set[str]) -> list[str]:
    """Linears of layer `index` (names relative to the layer) that the plan converts, in execution order."""
    prefix = layer_prefix(arch, index)
    return [n for n in arch.linears if f"{prefix}.{n}" in convert]


def _feature_of(arch: Arch) -> dict[str, str]:
    """linear -> the linear whose captured input it shares (q/k/v share q's input, gate/up share gate's)."""
    out = {n: n for n in arch.linears}
    for g in arch.scale_groups:
        for n in g.linears:
            out[n] = g.linears[0]
    return out


def _store(layer: nn.Module, name: str, prefix: str, codes, scales, zeros, results: dict[str, QuantResult]) -> None:
    """Record a converted linear and leave its dequantized weight in the layer."""
    fc = layer.get_submodule(name)
    fc.weight.data = dequantize(codes, scales, zeros).to(fc.weight.device, fc.weight.dtype)
    results[f"{prefix}.{name}"] = QuantResult(codes.cpu(), scales.cpu(), zeros.cpu())


def _round_to_nearest(layer: nn.Module, names: list[str], spec: awq.QSpec, scale_dtype: torch.dtype, prefix: str,
                      results: dict[str, QuantResult]) -> None:
    for n in names:
        w = layer.get_submodule(n).weight.data
        group = w.shape[1] if spec.group == -1 else spec.group
        codes, scales, zeros = quantize_for_export(w, spec.w_bit, group, spec.zero_point, scale_dtype)
        _store(layer, n, prefix, codes, scales, zeros, results)


def _batches(x: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """x: [tokens, in] concatenated over batches -> per batch [b, seq, in], matching `like`'s batch shapes."""
    sizes = [t.shape[0] * t.shape[1] for t in like]
    return [part.reshape(t.shape[0], t.shape[1], -1) for part, t in zip(torch.split(x, sizes), like)]


def _first(y):
    return y[0] if isinstance(y, tuple) else y


def _spec(recipe) -> awq.QSpec:
    return awq.QSpec(recipe.w_bit, recipe.q_group_size, recipe.zero_point)


def _clock(device: torch.device) -> float:
    """Wall clock after the device has finished its queued work (sub-stage timings on CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def search_batches(tokens_per_batch: list[int], search_tokens: int | None, seed: int) -> list[int]:
    """-> sorted indices of a seeded random subset of calibration batches holding >= search_tokens tokens.

    Whole batches, so an inspected attention block sees whole sequences with their own positions and mask.
    Every batch when search_tokens is None or the batches hold no more than that.
    """
    n = len(tokens_per_batch)
    if search_tokens is None or sum(tokens_per_batch) <= search_tokens:
        return list(range(n))
    chosen, total = [], 0
    for i in torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist():
        chosen.append(i)
        total += tokens_per_batch[i]
        if total >= search_tokens:
            break
    return sorted(chosen)


def _rows(x: torch.Tensor, sizes: list[int], chosen: list[int]) -> torch.Tensor:
    """x: [tokens, in] concatenated over batches of `sizes` tokens -> the rows of the chosen batches."""
    if len(chosen) == len(sizes):
        return x
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + n)
    return torch.cat([x[offsets[i] : offsets[i + 1]] for i in chosen])  # [tokens', in]


def _search_group(data: LayerData, g, quantized: list[bool], chosen: list[int], opts, spec: awq.QSpec):
    """Scale search for one scale group of data.layer -> awq.ScaleSearch."""
    layer = data.layer
    linears = [layer.get_submodule(n) for n in g.linears]
    x = data.features[g.linears[0]]  # [tokens, in]
    sizes = [t.shape[0] * t.shape[1] for t in data.inputs]
    x_loss = _rows(x, sizes, chosen)
    xb = _batches(x_loss, [data.inputs[i] for i in chosen])
    kwargs = [data.kwargs[i] for i in chosen]
    block = layer.get_submodule(g.inspect) if g.inspect else None
    if block is None:
        run_inspect = None  # the single linear itself: loss from XᵀX or X ΔWᵀ, no forward per grid point
    elif g.inspect_takes_layer_kwargs:
        def run_inspect():
            return [_first(block(hidden_states=xi, **kw)) for xi, kw in zip(xb, kwargs)]
    else:
        def run_inspect():
            return [_first(block(xi)) for xi in xb]
    with torch.no_grad():
        return awq.search_scales(x, linears, quantized, run_inspect, spec, opts.n_grid, opts.duo_scaling,
                                 coarse_step=opts.coarse_step, x_loss=x_loss, grid_batch=opts.grid_batch)


def _clip_layer(data: LayerData, arch: Arch, local: set[str], opts, spec: awq.QSpec) -> None:
    """Clip search and apply for every converted, clippable linear of data.layer (exact, all tokens)."""
    feature_of = _feature_of(arch)
    grams: dict[str, torch.Tensor] = {}
    for n in [n for n in arch.linears if n in local and n not in arch.no_clip]:
        key = feature_of[n]
        if key not in grams:
            grams[key] = awq.group_gram(data.features[key], spec.group)  # [n_group, g, g]
        fc = data.layer.get_submodule(n)
        with torch.no_grad():
            max_val = awq.search_clip(fc.weight.data, grams[key], spec, opts.clip_grid, opts.max_shrink)
        awq.apply_clip(fc, max_val)


def awq_layer(data: LayerData, arch: Arch, recipe, convert: set[str], scale_dtype: torch.dtype,
              results: dict[str, QuantResult]) -> dict:
    """Search and apply AWQ scales and clips for one decoder layer, then quantize it -> search stats.

    Stats: per scale group (keyed by its `prev`) the chosen ratio, its loss, the RTN loss (α = 0), how many
    ratios were evaluated and the seconds taken; under "seconds" the time of each sub-stage.
    """
    layer, opts, spec = data.layer, recipe.awq, _spec(recipe)
    device = data.inputs[0].device
    local = set(_local(arch, data.index, convert))
    chosen_batches = search_batches([t.shape[0] * t.shape[1] for t in data.inputs], opts.search_tokens,
                                    recipe.calibration.seed + data.index)
    stats: dict = {}
    chosen = []
    t0 = _clock(device)
    for g in active_scale_groups(layer, arch):
        quantized = [n in local for n in g.linears]
        if not any(quantized):
            continue
        t = _clock(device)
        r = _search_group(data, g, quantized, chosen_batches, opts, spec)
        stats[g.prev] = {"best_ratio": r.ratio, "loss": r.losses[r.ratio], "loss_rtn": r.losses[0.0],
                         "n_evaluated": len(r.losses), "seconds": round(_clock(device) - t, 4)}
        chosen.append((g, r.scales))
    for g, s in chosen:  # apply after searching, as all searches assume the unmodified layer
        awq.apply_scales(layer.get_submodule(g.prev), [layer.get_submodule(n) for n in g.linears], s)
        data.features[g.linears[0]].div_(s.to(data.features[g.linears[0]].dtype))
    t1 = _clock(device)
    if opts.apply_clip:
        _clip_layer(data, arch, local, opts, spec)
    t2 = _clock(device)
    _round_to_nearest(layer, [n for n in arch.linears if n in local], spec, scale_dtype,
                      layer_prefix(arch, data.index), results)
    t3 = _clock(device)
    stats["seconds"] = {"scale_search": round(t1 - t0, 4), "clip": round(t2 - t1, 4), "quantize": round(t3 - t2, 4)}
    return stats


def quantize_awq(model, arch: Arch, samples: torch.Tensor, recipe, convert: set[str], device: torch.device,
                 compute_dtype: torch.dtype, scale_dtype: torch.dtype) -> tuple[dict[str, QuantResult], dict]:
    """AWQ over every decoder layer -> (results per linear, search stats per layer)."""
    results: dict[str, QuantResult] = {}
    stats: dict = {}
    feature_names = sorted(set(_feature_of(arch).values()), key=arch.linears.index)

    def process(data: LayerData) -> None:
        stats[data.index] = awq_layer(data, arch, recipe, convert, scale_dtype, results)

    run_layerwise(model, arch, samples, device, compute_dtype, recipe.batch_size, lambda _l: feature_names, process,
                  recipe.awq.propagate)
    return results, stats


def gptq_layer(data: LayerData, arch: Arch, recipe, convert: set[str], scale_dtype: torch.dtype,
               results: dict[str, QuantResult]) -> dict:
    """GPTQ for one decoder layer: per stage, accumulate Hessians (on quantized predecessors), quantize."""
    layer, opts = data.layer, recipe.gptq
    local = _local(arch, data.index, convert)
    stages = arch.sequential if opts.true_sequential else (tuple(arch.linears),)
    feature_of = _feature_of(arch)
    spec = gptq.GptqSpec(recipe.w_bit, recipe.q_group_size, not recipe.zero_point, opts.block_size,
                         opts.damp_percent, opts.act_order, scale_dtype)
    stats: dict = {}
    for stage in stages:
        names = [n for n in stage if n in local]
        if not names:
            continue
        keys = sorted({feature_of[n] for n in names}, key=arch.linears.index)  # one Hessian per shared input
        accs = {k: gptq.HessianAccumulator(layer.get_submodule(k).in_features, data.inputs[0].device) for k in keys}
        handles = [layer.get_submodule(k).register_forward_hook(lambda _m, a, _o, k=k: accs[k].add(a[0]))
                   for k in keys]
        try:
            layer_forward(layer, data.inputs, data.kwargs)
        finally:
            for h in handles:
                h.remove()
        for n in names:
            fc = layer.get_submodule(n)
            r = gptq.gptq_quantize(fc.weight.data, accs[feature_of[n]].H, spec)
            _store(layer, n, layer_prefix(arch, data.index), r.codes, r.scales.to(scale_dtype), r.zeros, results)
            stats[n] = {"loss": r.loss, "damp": r.damp_used, "dead_columns": r.dead_columns}
    return stats


def quantize_gptq(model, arch: Arch, samples: torch.Tensor, recipe, convert: set[str], device: torch.device,
                  compute_dtype: torch.dtype, scale_dtype: torch.dtype) -> tuple[dict[str, QuantResult], dict]:
    """GPTQ over every decoder layer; each layer's calibration inputs come from the quantized layers before it."""
    results: dict[str, QuantResult] = {}
    stats: dict = {}

    def process(data: LayerData) -> None:
        stats[data.index] = gptq_layer(data, arch, recipe, convert, scale_dtype, results)

    run_layerwise(model, arch, samples, device, compute_dtype, recipe.batch_size, lambda _l: [], process,
                  propagate="quantized")
    return results, stats


def quantize_rtn(model, arch: Arch, recipe, convert: set[str], device: torch.device, compute_dtype: torch.dtype,
                 scale_dtype: torch.dtype) -> dict[str, QuantResult]:
    """Round-to-nearest baseline: no calibration, each converted linear quantized as it is."""
    results: dict[str, QuantResult] = {}
    for i, layer in enumerate(decoder_layers(model, arch)):
        storage = next(layer.parameters()).dtype
        layer.to(device, compute_dtype)
        _round_to_nearest(layer, _local(arch, i, convert), _spec(recipe), scale_dtype, layer_prefix(arch, i), results)
        layer.to("cpu", storage)
    return results

"""Apply a method to a model: joins the architecture table, the capture loop and the pure algorithms.

The result of quantizing is data: for every converted linear, its integer codes, scales and zero points
(`QuantResult`). The in-memory model is left holding the dequantized weights, so it computes exactly what
the exported artifact computes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn as nn

from . import awq
from .arch import Arch, active_scale_groups, decoder_layers, layer_prefix
from .capture import LayerData, run_layerwise
from .primitives import dequantize, quantize_for_export

log = logging.getLogger(__name__)


@dataclass
class QuantResult:
    """One converted linear: codes [out, in] uint8, scales [out, in // g], zeros [out, in // g] int32."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor


def is_skipped(name: str, modules_to_not_convert: tuple[str, ...]) -> bool:
    """vLLM's rule for AWQ: a module is left unconverted when any entry is a substring of its name."""
    return any(m in name for m in modules_to_not_convert)


def converted_linears(arch: Arch, index: int, modules_to_not_convert: tuple[str, ...]) -> list[str]:
    """Names (relative to the decoder layer) of the linears of layer `index` that get quantized."""
    prefix = layer_prefix(arch, index)
    return [n for n in arch.linears if not is_skipped(f"{prefix}.{n}", modules_to_not_convert)]


def _feature_of(arch: Arch) -> dict[str, str]:
    """linear -> the linear whose captured input it shares (q/k/v share q's input, gate/up share gate's)."""
    out = {n: n for n in arch.linears}
    for g in arch.scale_groups:
        for n in g.linears:
            out[n] = g.linears[0]
    return out


def _finalize(layer: nn.Module, names: list[str], spec: awq.QSpec, scale_dtype: torch.dtype, prefix: str,
              results: dict[str, QuantResult]) -> None:
    """Quantize each named linear for export; leave the dequantized weight in the layer."""
    for n in names:
        fc = layer.get_submodule(n)
        codes, scales, zeros = quantize_for_export(fc.weight.data, spec.w_bit, spec.group, spec.zero_point, scale_dtype)
        fc.weight.data = dequantize(codes, scales, zeros).to(fc.weight.dtype)
        results[f"{prefix}.{n}"] = QuantResult(codes.cpu(), scales.cpu(), zeros.cpu())


def _batches(x: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """x: [tokens, in] concatenated over batches -> per batch [b, seq, in], matching `like`'s batch shapes."""
    sizes = [t.shape[0] * t.shape[1] for t in like]
    return [part.reshape(t.shape[0], t.shape[1], -1) for part, t in zip(torch.split(x, sizes), like)]


def _first(y):
    return y[0] if isinstance(y, tuple) else y


def awq_layer(data: LayerData, arch: Arch, recipe, scale_dtype: torch.dtype, results: dict[str, QuantResult]) -> dict:
    """Search and apply AWQ scales and clips for one decoder layer, then quantize it -> search stats."""
    layer, opts = data.layer, recipe.awq
    spec = awq.QSpec(recipe.w_bit, recipe.q_group_size, recipe.zero_point)
    convert = set(converted_linears(arch, data.index, recipe.modules_to_not_convert))
    stats: dict = {}
    chosen = []
    for g in active_scale_groups(layer, arch):
        linears = [layer.get_submodule(n) for n in g.linears]
        quantized = [n in convert for n in g.linears]
        if not any(quantized):
            continue
        xb = _batches(data.features[g.linears[0]], data.inputs)
        block = layer.get_submodule(g.inspect) if g.inspect else None
        if block is None:
            run_inspect = None  # the single linear itself: loss from XᵀX, no forward per grid point
        elif g.inspect_takes_layer_kwargs:
            def run_inspect(block=block, xb=xb):
                return [_first(block(hidden_states=x, **kw)) for x, kw in zip(xb, data.kwargs)]
        else:
            def run_inspect(block=block, xb=xb):
                return [_first(block(x)) for x in xb]
        with torch.no_grad():
            s, losses = awq.search_scales(
                data.features[g.linears[0]], linears, quantized, run_inspect, spec, opts.n_grid, opts.duo_scaling
            )
        best = min(range(len(losses)), key=losses.__getitem__)
        stats[g.prev] = {"best_ratio": best / opts.n_grid, "loss": losses[best], "loss_rtn": losses[0]}
        chosen.append((g, s))
    for g, s in chosen:  # apply after searching, as all searches assume the unmodified layer
        awq.apply_scales(layer.get_submodule(g.prev), [layer.get_submodule(n) for n in g.linears], s)
        data.features[g.linears[0]].div_(s.to(data.features[g.linears[0]].dtype))
    if opts.apply_clip:
        feature_of = _feature_of(arch)
        grams: dict[str, torch.Tensor] = {}
        for n in sorted(convert - set(arch.no_clip), key=arch.linears.index):
            fc = layer.get_submodule(n)
            key = feature_of[n]
            if key not in grams:
                grams[key] = awq.group_gram(data.features[key], spec.group)  # [n_group, g, g]
            with torch.no_grad():
                max_val = awq.search_clip(fc.weight.data, grams[key], spec, opts.clip_grid, opts.max_shrink)
            awq.apply_clip(fc, max_val)
    _finalize(layer, sorted(convert, key=arch.linears.index), spec, scale_dtype, layer_prefix(arch, data.index), results)
    return stats


def quantize_awq(model, arch: Arch, samples: torch.Tensor, recipe, device: torch.device, compute_dtype: torch.dtype,
                 scale_dtype: torch.dtype) -> tuple[dict[str, QuantResult], dict]:
    """AWQ over every decoder layer -> (results per linear, search stats per layer)."""
    results: dict[str, QuantResult] = {}
    stats: dict = {}
    feature_names = sorted(set(_feature_of(arch).values()), key=arch.linears.index)

    def process(data: LayerData) -> None:
        stats[data.index] = awq_layer(data, arch, recipe, scale_dtype, results)

    run_layerwise(model, arch, samples, device, compute_dtype, recipe.batch_size, lambda _l: feature_names, process,
                  recipe.awq.propagate)
    return results, stats


def quantize_rtn(model, arch: Arch, recipe, device: torch.device, compute_dtype: torch.dtype,
                 scale_dtype: torch.dtype) -> dict[str, QuantResult]:
    """Round-to-nearest baseline: no calibration, each converted linear quantized as it is."""
    spec = awq.QSpec(recipe.w_bit, recipe.q_group_size, recipe.zero_point)
    results: dict[str, QuantResult] = {}
    for i, layer in enumerate(decoder_layers(model, arch)):
        storage = next(layer.parameters()).dtype
        layer.to(device, compute_dtype)
        _finalize(layer, converted_linears(arch, i, recipe.modules_to_not_convert), spec, scale_dtype,
                  layer_prefix(arch, i), results)
        layer.to("cpu", storage)
    return results

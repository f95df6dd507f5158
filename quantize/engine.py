"""Apply a method to a model: joins the architecture table, the capture loop and the pure algorithms.

The result of quantizing is data: for every converted linear, its integer codes, scales and zero points
(`QuantResult`). The in-memory model is left holding the dequantized weights, so it computes exactly what
the exported artifact computes. `convert` is the set of full module names the pre-flight plan approved.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from . import awq, gptq
from .arch import Arch, active_scale_groups, layer_prefix
from .capture import LayerData, NumericalError, layer_forward
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


def awq_layer(data: LayerData, arch: Arch, recipe, convert: set[str], scale_dtype: torch.dtype,
              results: dict[str, QuantResult]) -> dict:
    """Search and apply AWQ scales and clips for one decoder layer, then quantize it -> search stats."""
    layer, opts, spec = data.layer, recipe.awq, _spec(recipe)
    local = set(_local(arch, data.index, convert))
    stats: dict = {}
    chosen = []
    for g in active_scale_groups(layer, arch):
        linears = [layer.get_submodule(n) for n in g.linears]
        quantized = [n in local for n in g.linears]
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
        for n in [n for n in arch.linears if n in local and n not in arch.no_clip]:
            key = feature_of[n]
            if key not in grams:
                grams[key] = awq.group_gram(data.features[key], spec.group)  # [n_group, g, g]
            fc = layer.get_submodule(n)
            with torch.no_grad():
                max_val = awq.search_clip(fc.weight.data, grams[key], spec, opts.clip_grid, opts.max_shrink)
            awq.apply_clip(fc, max_val)
    _round_to_nearest(layer, [n for n in arch.linears if n in local], spec, scale_dtype,
                      layer_prefix(arch, data.index), results)
    return stats


def gptq_layer(data: LayerData, arch: Arch, recipe, convert: set[str], scale_dtype: torch.dtype,
               results: dict[str, QuantResult]) -> dict:
    """GPTQ for one decoder layer: per stage, accumulate Hessians (on quantized predecessors), quantize."""
    layer, opts = data.layer, recipe.gptq
    local = _local(arch, data.index, convert)
    stages = arch.sequential if opts.true_sequential else (tuple(arch.linears),)
    feature_of = _feature_of(arch)
    spec = gptq.GptqSpec(recipe.w_bit, recipe.q_group_size, not recipe.zero_point, opts.block_size,
                         opts.damp_percent, opts.act_order, scale_dtype, opts.kernel)
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
        for key in keys:  # linears sharing one Hessian: one sweep over their row-concatenated weights
            shared = [n for n in names if feature_of[n] == key]
            weights = [layer.get_submodule(n).weight.data for n in shared]
            r = gptq.gptq_quantize(torch.cat(weights), accs[key].H, spec)
            rows = [w.shape[0] for w in weights]
            parts = zip(*([p.clone() for p in t.split(rows)] for t in (r.codes, r.scales, r.zeros, r.row_loss)))
            for n, (codes, scales, zeros, row_loss) in zip(shared, parts):
                _store(layer, n, layer_prefix(arch, data.index), codes, scales.to(scale_dtype), zeros, results)
                stats[n] = {"loss": row_loss.sum().item(), "damp": r.damp_used, "dead_columns": r.dead_columns,
                            "kernel": r.kernel}
    return stats


@dataclass
class Job:
    """One recipe in a shared layer-by-layer pass (`capture.run_shared`): its settings and what it produced.

    results: converted linear -> codes/scales/zeros; stats: per layer; overrides: every other tensor of each
    decoder layer as the method left it (AWQ folds its scales into norms and biases), written at export.
    """

    recipe: object
    arch: Arch
    convert: set[str]
    scale_dtype: torch.dtype
    results: dict[str, QuantResult] = field(default_factory=dict)
    stats: dict = field(default_factory=dict)
    overrides: dict[str, torch.Tensor] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def propagate(self) -> str:
        method = self.recipe.method
        return "none" if method == "rtn" else "quantized" if method == "gptq" else self.recipe.awq.propagate

    @property
    def wants_features(self) -> bool:
        return self.recipe.method == "awq"

    def process(self, data: LayerData) -> None:
        r, arch = self.recipe, self.arch
        if r.method == "awq":
            self.stats[data.index] = awq_layer(data, arch, r, self.convert, self.scale_dtype, self.results)
        elif r.method == "gptq":
            self.stats[data.index] = gptq_layer(data, arch, r, self.convert, self.scale_dtype, self.results)
        else:
            _round_to_nearest(data.layer, _local(arch, data.index, self.convert), _spec(r), self.scale_dtype,
                              layer_prefix(arch, data.index), self.results)
        prefix = layer_prefix(arch, data.index) + "."
        for name, res in self.results.items():
            if name.startswith(prefix) and not bool(torch.isfinite(res.scales).all()):
                raise NumericalError(f"{name}: {r.method} produced NaN/inf scales (the weights or their "
                                     f"calibration inputs overflow in {res.scales.dtype}); try compute_dtype: float32")

    def keep(self, index: int, layer: nn.Module) -> None:
        prefix = layer_prefix(self.arch, index)
        for name, t in layer.state_dict().items():
            full = f"{prefix}.{name}"
            if full.removesuffix(".weight") not in self.results:
                self.overrides[full] = t.detach().to("cpu", copy=True)


    def _in(self, name: str, lo: int, hi: int) -> bool:
        return any(name.startswith(layer_prefix(self.arch, i) + ".") for i in range(lo, hi))

    def snapshot(self, lo: int, hi: int) -> dict:
        """What this job produced for layers [lo, hi), as plain tensors (for `checkpoint`, weights_only loads)."""
        return {"results": {k: {"codes": _nibbles(r.codes), "scales": r.scales, "zeros": r.zeros}
                            for k, r in self.results.items() if self._in(k, lo, hi)},
                "overrides": {k: t for k, t in self.overrides.items() if self._in(k, lo, hi)},
                "stats": json.dumps({i: self.stats[i] for i in range(lo, hi) if i in self.stats}),
                "seconds": self.seconds}

    def restore(self, snap: dict) -> None:
        self.results.update({k: QuantResult(_from_nibbles(r["codes"]), r["scales"], r["zeros"])
                             for k, r in snap["results"].items()})
        self.overrides.update(snap["overrides"])
        self.stats.update({int(i): v for i, v in json.loads(snap["stats"]).items()})
        self.seconds = snap["seconds"]


def _nibbles(codes: torch.Tensor) -> dict:
    """uint8 codes [out, in] < 16 -> two per byte [out, in / 2] (halves a checkpoint); others unchanged."""
    if codes.shape[-1] % 2 or int(codes.max()) > 15:
        return {"raw": codes}
    return {"nibbles": codes[:, 0::2] | (codes[:, 1::2] << 4)}


def _from_nibbles(d: dict) -> torch.Tensor:
    if "raw" in d:
        return d["raw"]
    p = d["nibbles"]
    return torch.stack([p & 0xF, p >> 4], dim=-1).reshape(p.shape[0], -1)  # [out, in / 2, 2] -> [out, in]


def feature_names(arch: Arch) -> list[str]:
    """The linears whose inputs AWQ needs (one per group of linears sharing an input), in execution order."""
    return sorted(set(_feature_of(arch).values()), key=arch.linears.index)

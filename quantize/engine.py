"""Apply a method to a model: joins the architecture table, the capture loop and the pure algorithms.

The result of quantizing is data: for every converted linear, its integer codes, scales and zero points
(`QuantResult`). The in-memory model is left holding the dequantized weights, so it computes exactly what
the exported artifact computes. `convert` is the set of full module names the pre-flight plan approved.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from . import awq, gptq, output_error
from .arch import Arch, ScaleGroup, active_scale_groups, get_module, layer_prefix
from .capture import LayerData, NumericalError, feed_inputs
from .experts import routed_tokens
from .device import clock as _clock
from .device import gptq_sweep, side_stream
from .distributed import Dist
from .formats.packing import pack_int32, unpack_int32
from .primitives import dequantize, quantize, quantize_for_export
from .runlog import RunLog

log = logging.getLogger(__name__)

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}  # recipe dtype names


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


def _units(layer: nn.Module, arch: Arch) -> list[tuple[str, int | None]]:
    """A MoE layer's MLPs: (path, routed expert index), the shared expert (index None) first."""
    x = arch.experts
    routed = [(x.expert(e), e) for e in range(len(get_module(layer, x.module)))]
    return ([(x.shared, None)] if x.shared else []) + routed


def _moe_local(layer: nn.Module, arch: Arch, index: int, convert: set[str]) -> list[str]:
    """The MoE block's linears of layer `index` that the plan converts, in execution order ([] for dense)."""
    if arch.experts is None:
        return []
    prefix = layer_prefix(arch, index)
    names = [f"{path}.{n}" for path, _ in _units(layer, arch) for n in arch.experts.linears]
    return [n for n in names if f"{prefix}.{n}" in convert]


def _feature_of(arch: Arch) -> dict[str, str]:
    """linear -> the linear whose captured input it shares (q/k/v share q's input, gate/up share gate's)."""
    out = {n: n for n in arch.linears}
    for g in arch.scale_groups:
        for n in g.linears:
            out[n] = g.linears[0]
    return out


RESULTS_DEVICE_SHARE = 0.25  # results may stay on a CUDA device while they hold at most this share of its memory


def _result_home(t: torch.Tensor, results: dict[str, QuantResult]) -> torch.device:
    """Where a new result tensor is kept: on its CUDA device while the results there stay under
    RESULTS_DEVICE_SHARE of the device's memory, else on the CPU.

    Profile (H200, 7B shape): copying each layer's codes to pageable host memory ran at ~1 GB/s and took
    ~0.26 s per layer with the GPU idle; export packs on the device anyway, so codes kept there never make
    the round trip. Large models spill to the CPU once the share is used up.
    """
    if t.device.type != "cuda":
        return torch.device("cpu")
    kept = sum(x.numel() * x.element_size() for r in results.values() for x in (r.codes, r.scales, r.zeros)
               if x.device == t.device)
    total = torch.cuda.get_device_properties(t.device).total_memory
    return t.device if kept + 2 * t.numel() * t.element_size() <= RESULTS_DEVICE_SHARE * total else torch.device("cpu")


def _store_rows(layer: nn.Module, names: list[str], prefix: str, r, scale_dtype: torch.dtype,
                results: dict[str, QuantResult]) -> None:
    """One GPTQ problem solved for several linears stacked by rows (q/k/v, gate/up): each linear's rows stored."""
    rows = [layer.get_submodule(n).weight.shape[0] for n in names]
    for n, codes, scales, zeros in zip(names, *(t.split(rows) for t in (r.codes, r.scales, r.zeros))):
        _store(layer, n, prefix, codes.contiguous(), scales.to(scale_dtype).contiguous(), zeros.contiguous(), results)


def _search_stats(r) -> dict:
    """An AWQ scale search's record: the chosen ratio, its loss, round-to-nearest's loss, candidates tried."""
    return {"best_ratio": r.ratio, "loss": r.losses[r.ratio], "loss_rtn": r.losses[0.0], "n_evaluated": len(r.losses)}


def _store(layer: nn.Module, name: str, prefix: str, codes, scales, zeros, results: dict[str, QuantResult]) -> None:
    """Record a converted linear and leave its dequantized weight in the layer."""
    fc = layer.get_submodule(name)
    fc.weight.data = dequantize(codes, scales, zeros).to(fc.weight.device, fc.weight.dtype)
    home = _result_home(codes, results)
    results[f"{prefix}.{name}"] = QuantResult(codes.to(home), scales.to(home), zeros.to(home))


def _owned(dist: Dist, units: list[tuple[float, Callable[[], object]]]) -> list:
    """Units of work (cost, fn) -> their results in order, each computed once by its owner (`Dist.owner`) and
    broadcast. Every rank first computes all it owns, then the results travel: the ranks work at the same time."""
    owners = [dist.owner(cost) for cost, _ in units]
    mine = {i: dist.attempt(fn) for i, ((_, fn), o) in enumerate(zip(units, owners)) if o == dist.rank}
    return [dist.share(o, mine.get(i)) for i, o in enumerate(owners)]


def _round_to_nearest(layer: nn.Module, names: list[str], spec: awq.QSpec, scale_dtype: torch.dtype, prefix: str,
                      results: dict[str, QuantResult]) -> None:
    for n in names:
        w = layer.get_submodule(n).weight.data
        group = w.shape[1] if spec.group == -1 else spec.group
        codes, scales, zeros = quantize_for_export(w, spec.w_bit, group, symmetric=spec.symmetric,
                                                   scale_dtype=scale_dtype)
        _store(layer, n, prefix, codes, scales, zeros, results)


def _batches(x: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """x: [tokens, in] concatenated over batches -> per batch [b, seq, in], matching `like`'s batch shapes."""
    sizes = [t.shape[0] * t.shape[1] for t in like]
    return [part.reshape(t.shape[0], t.shape[1], -1) for part, t in zip(torch.split(x, sizes), like)]


def _first(y):
    return y[0] if isinstance(y, tuple) else y


def _spec(recipe) -> awq.QSpec:
    return awq.QSpec(recipe.w_bit, recipe.q_group_size, symmetric=recipe.symmetric)


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


def _search_group(data: LayerData, g, quantized: list[bool], chosen: list[int], recipe, spec: awq.QSpec,
                  dist: Dist | None = None):
    """Scale search for one scale group of data.layer -> awq.ScaleSearch. dist: the candidate ratios of each round
    are shared out over the ranks (`Dist.spread`), each loss computed whole on one rank."""
    opts, fast = recipe.awq, recipe.advanced.awq
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
                                 coarse_step=fast.coarse_step, x_loss=x_loss, grid_batch=fast.grid_batch,
                                 spread=None if dist is None else dist.spread)


def _clip_layer(data: LayerData, arch: Arch, local: set[str], opts, spec: awq.QSpec,
                grams: dict[str, torch.Tensor], dist: Dist | None = None
                ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Clip search for every converted, clippable linear of data.layer (exact, all tokens) -> name -> (lo, hi)
    per group. grams: feature name -> its group Gram matrices, filled in as needed. dist: one owner per linear."""
    names = [n for n in arch.linears if n in local and n not in arch.no_clip]

    def clip(n: str) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            return awq.search_clip(data.layer.get_submodule(n).weight.data, _group_gram(data, arch, n, spec, grams),
                                   spec, opts.clip_grid, opts.max_shrink, per_side=opts.clip_search == "per_side")
    if dist is None:
        return {n: clip(n) for n in names}
    return dict(zip(names, _owned(dist, [(_cost(data.layer, [n]), lambda n=n: clip(n)) for n in names])))


def _cost(layer: nn.Module, names: list[str]) -> float:
    """The work of a unit over these linears, for the balanced assignment: in · out summed."""
    return float(sum(layer.get_submodule(n).weight.numel() for n in names))


def _group_gram(data: LayerData, arch: Arch, name: str, spec: awq.QSpec, grams: dict[str, torch.Tensor]):
    """The group Gram matrices [in // g, g, g] of linear `name`'s input (cached per shared input in grams)."""
    key = _feature_of(arch)[name]
    if key not in grams:
        grams[key] = awq.group_gram(data.features[key], spec.group)  # [n_group, g, g]
    return grams[key]


def _awq_round(data: LayerData, arch: Arch, names: list[str], ranges: dict, grams: dict, recipe, spec: awq.QSpec,
               scale_dtype: torch.dtype, results: dict[str, QuantResult]) -> None:
    """Quantize the scaled linears `names` of data.layer on their clip grids: grid from the clip range, scales
    refit by least squares (awq.refit_iters), codes by round-to-nearest or GPTQ (awq.rounding)."""
    layer, opts, prefix = data.layer, recipe.awq, layer_prefix(arch, data.index)
    grids = {}
    for n in names:
        w = layer.get_submodule(n).weight.data
        scales, zeros = awq.clip_grid(w, *ranges.get(n, (None, None)), spec)
        if opts.refit_iters:
            scales = awq.refit_scales(w, _group_gram(data, arch, n, spec, grams), scales, zeros, spec,
                                      opts.refit_iters, scale_dtype)
        grids[n] = (scales.to(scale_dtype), zeros)
    if opts.rounding == "rtn":
        for n in names:
            scales, zeros = grids[n]
            codes = quantize(layer.get_submodule(n).weight.data, scales, zeros, spec.w_bit)
            _store(layer, n, prefix, codes, scales, zeros, results)
        return
    feature_of = _feature_of(arch)
    keys = sorted({feature_of[n] for n in names}, key=arch.linears.index)  # one Hessian per shared input
    shared = [[n for n in names if feature_of[n] == k] for k in keys]
    problems, cat_grids = [], []
    for k, group in zip(keys, shared):
        acc = gptq.HessianAccumulator(data.features[k].shape[1], data.features[k].device)
        acc.add(data.features[k])  # the scaled input [tokens, in]
        problems.append((torch.cat([layer.get_submodule(n).weight.data for n in group]), acc.H))
        cat_grids.append(tuple(torch.cat([grids[n][i] for n in group]) for i in (0, 1)))
    gspec = dataclasses.replace(gptq_spec(recipe, scale_dtype), act_order=True)  # static groups: the clip grid
    dev = problems[0][0].device
    solved = gptq.gptq_quantize_many(problems, gspec, cat_grids, gptq_sweep(recipe.advanced.gptq.kernel, dev),
                                     side_stream(dev))
    for group, r in zip(shared, solved):
        _store_rows(layer, group, prefix, r, scale_dtype, results)


def _awq_round_owned(data: LayerData, arch: Arch, names: list[str], ranges: dict, grams: dict, recipe,
                     spec: awq.QSpec, scale_dtype: torch.dtype, results: dict[str, QuantResult], dist: Dist) -> None:
    """`_awq_round` with each unit on its owner: a linear (round-to-nearest) or the linears sharing one input
    (GPTQ rounding, one Hessian); each unit computes exactly what `_awq_round` computes for it."""
    layer, opts, prefix = data.layer, recipe.awq, layer_prefix(arch, data.index)

    def grid(n: str):
        w = layer.get_submodule(n).weight.data
        scales, zeros = awq.clip_grid(w, *ranges.get(n, (None, None)), spec)
        if opts.refit_iters:
            scales = awq.refit_scales(w, _group_gram(data, arch, n, spec, grams), scales, zeros, spec,
                                      opts.refit_iters, scale_dtype)
        return scales.to(scale_dtype), zeros

    def rtn(n: str):
        with torch.no_grad():
            scales, zeros = grid(n)
            return [(quantize(layer.get_submodule(n).weight.data, scales, zeros, spec.w_bit), scales, zeros)]

    def rounded(group: list[str], k: str):
        with torch.no_grad():
            grids = [grid(n) for n in group]
            acc = gptq.HessianAccumulator(data.features[k].shape[1], data.features[k].device)
            acc.add(data.features[k])
            gspec = dataclasses.replace(gptq_spec(recipe, scale_dtype), act_order=True)
            w = torch.cat([layer.get_submodule(n).weight.data for n in group])
            dev = w.device
            r = gptq.gptq_quantize_many([(w, acc.H)], gspec, [tuple(torch.cat([g[i] for g in grids]) for i in (0, 1))],
                                        gptq_sweep(recipe.advanced.gptq.kernel, dev), side_stream(dev))[0]
            rows = [layer.get_submodule(n).weight.shape[0] for n in group]
            return [(c.contiguous(), s_.to(scale_dtype).contiguous(), z.contiguous())
                    for c, s_, z in zip(*(t.split(rows) for t in (r.codes, r.scales, r.zeros)))]

    if opts.rounding == "rtn":
        units, groups = [(_cost(layer, [n]), lambda n=n: rtn(n)) for n in names], [[n] for n in names]
    else:
        feature_of = _feature_of(arch)
        keys = sorted({feature_of[n] for n in names}, key=arch.linears.index)
        groups = [[n for n in names if feature_of[n] == k] for k in keys]
        units = [(_cost(layer, g), lambda g=g, k=k: rounded(g, k)) for g, k in zip(groups, keys)]
    for group, parts in zip(groups, _owned(dist, units)):
        for n, (codes, scales, zeros) in zip(group, parts):
            _store(layer, n, prefix, codes, scales, zeros, results)


def awq_layer(data: LayerData, arch: Arch, recipe, convert: set[str], scale_dtype: torch.dtype,
              results: dict[str, QuantResult], runlog: RunLog | None = None, dist: Dist | None = None) -> dict:
    """Search and apply AWQ scales, search clips, then quantize the layer on those grids -> search stats.

    Stats: per scale group (keyed by its `prev`) the chosen ratio, its loss, the RTN loss (α = 0), how many
    ratios were evaluated and the seconds taken; under "seconds" the time of each sub-stage (also into runlog).
    dist: every rank holds every token's features; each scale search's candidates are shared out over the ranks
    and each clip and rounding unit is computed by one owner and broadcast, so the results are those of one
    process, bit for bit.
    """
    opts, spec = recipe.awq, _spec(recipe)
    device = data.inputs[0].device
    local = set(_local(arch, data.index, convert))
    t0 = _clock(device)
    chosen, stats = search_layer_scales(data, arch, recipe, local, dist)
    fold_scales(data, arch, chosen)
    t1 = _clock(device)
    grams: dict[str, torch.Tensor] = {}
    ranges = _clip_layer(data, arch, local, opts, spec, grams, dist) if opts.apply_clip else {}
    t2 = _clock(device)
    names = [n for n in arch.linears if n in local]
    scaled = {n: data.layer.get_submodule(n).weight.data for n in names}  # W·s: rounding replaces, never edits
    if dist is None:
        with torch.no_grad():
            _awq_round(data, arch, names, ranges, grams, recipe, spec, scale_dtype, results)
    else:
        _awq_round_owned(data, arch, names, ranges, grams, recipe, spec, scale_dtype, results, dist)
    t3 = _clock(device)
    stats[ERRORS] = _awq_errors(data, arch, recipe, scaled)
    stats["seconds"] = {"scale_search": round(t1 - t0, 4), "clip": round(t2 - t1, 4), "quantize": round(t3 - t2, 4)}
    if runlog is not None:
        runlog.stage(data.index, recipe.name, "awq", **stats["seconds"])
    return stats


def _awq_errors(data: LayerData, arch: Arch, recipe, scaled: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each AWQ linear's relative output error (`output_error.from_inputs`) on the tokens its scale search scored:
    scaled weights W·s against their codes, on the scaled inputs X / s."""
    sizes = [t.shape[0] * t.shape[1] for t in data.inputs]
    chosen = search_batches(sizes, recipe.awq.search_tokens, recipe.calibration.seed + data.index)
    feature_of, rows = _feature_of(arch), {}
    errors = {}
    with torch.no_grad():
        for n, w in scaled.items():
            key = feature_of[n]
            if key not in rows:
                rows[key] = _rows(data.features[key], sizes, chosen)  # [tokens', in]
            errors[n] = output_error.from_inputs(w, data.layer.get_submodule(n).weight.data, rows[key])
    return _read_back(errors)


def _hidden(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """An expert MLP's down_proj input: x [n, H] -> act(gate(x)) · up(x) [n, I]."""
    return mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)


def expert_tokens(top_k_index: torch.Tensor, n_experts: int, min_tokens: int):
    """top_k_index [T, k] -> (routed token count per expert, rows per expert: its routed tokens [n_e], or None
    where it got fewer than max(min_tokens, 1): that expert is calibrated on every token (the recipe's
    moe.min_expert_tokens rule; never on none, which would leave GPTQ nothing but zeros to write))."""
    counts = torch.bincount(top_k_index.flatten(), minlength=n_experts).tolist()
    rows = [None if c < max(min_tokens, 1) else routed_tokens(top_k_index, e) for e, c in enumerate(counts)]
    return counts, rows


def _routing(layer: nn.Module, arch: Arch, x: torch.Tensor, recipe) -> tuple[list[int], list, dict]:
    """The router's choice for the MoE block's input x [T, H] -> (counts, rows as `expert_tokens`, record)."""
    with torch.no_grad():
        top_k_index = get_module(layer, arch.experts.router)(x)[2]  # (logits, weights, indices [T, k])
    n = len(get_module(layer, arch.experts.module))
    m = recipe.moe_options.min_expert_tokens
    counts, rows = expert_tokens(top_k_index, n, m)
    record = {"tokens": int(x.shape[0]), "routed_tokens": counts, "min_expert_tokens": m,
              "calibrated_on_all_tokens": [e for e, r in enumerate(rows) if r is None]}
    return counts, rows, record


def norm_consumers(layer: nn.Module, arch: Arch) -> list[str]:
    """Every module a MoE block's norm feeds, so an AWQ scale folded into the norm is folded into each: the
    gate/up of the shared and the routed experts, then the router and the shared-expert gate (kept 16-bit)."""
    fed = [f"{path}.{n}" for path, _ in _units(layer, arch) for n in ("gate_proj", "up_proj")]
    return fed + list(arch.experts.unconverted())


def _unit_inputs(x: torch.Tensor, rows: list, e: int | None) -> torch.Tensor:
    """The calibration inputs of one MLP: the shared expert and under-fed experts see every token."""
    return x if e is None or rows[e] is None else x[rows[e]]  # [n_e, H]


def awq_moe(data: LayerData, arch: Arch, recipe, convert: set[str], scale_dtype: torch.dtype,
            results: dict[str, QuantResult]) -> dict:
    """AWQ for a MoE block: one scale for its norm (searched on the block's output, every expert it feeds
    fake-quantized, the router and shared-expert gate scaled but kept 16-bit), then each MLP in turn on its own
    tokens: the up -> down scale, clips and rounding. Only one expert's inputs are held at a time -> stats."""
    layer, opts, spec, x_ = data.layer, recipe.awq, _spec(recipe), arch.experts
    local = set(_moe_local(layer, arch, data.index, convert))
    if not local:
        return {}
    x = data.features[x_.router]  # [T, H] the block's input on every token
    _, rows, record = _routing(layer, arch, x, recipe)
    stats: dict = {"experts": record}
    consumers = norm_consumers(layer, arch)  # every one is scaled, converted or not, so the block is unchanged
    fed = [n for n in consumers if n not in x_.unconverted()]
    if any(n in local for n in fed):
        chosen = search_batches([t.shape[0] * t.shape[1] for t in data.inputs], opts.search_tokens,
                                recipe.calibration.seed + data.index)
        g = ScaleGroup(prev=x_.norm, linears=tuple(fed), inspect=x_.block)
        r = _search_group(dataclasses.replace(data, features={fed[0]: x}), g, [n in local for n in fed], chosen,
                          recipe, spec)
        stats[x_.norm] = _search_stats(r)
        awq.apply_scales(layer.get_submodule(x_.norm), [layer.get_submodule(n) for n in consumers], r.scales,
                         arch.norm_offset)
        x = x / r.scales.to(x.dtype)  # [T, H] what the scaled linears now see
    for path, e in _units(layer, arch):
        _awq_unit(data, arch, path, _unit_inputs(x, rows, e), local, recipe, spec, scale_dtype, results)
    return stats


def _awq_unit(data: LayerData, arch: Arch, path: str, x: torch.Tensor, local: set[str], recipe, spec: awq.QSpec,
              scale_dtype: torch.dtype, results: dict[str, QuantResult]) -> None:
    """One expert MLP at `path` on its calibration inputs x [n, H] (already scaled by the norm's AWQ scale)."""
    opts, fast, layer = recipe.awq, recipe.advanced.awq, data.layer
    mlp = layer.get_submodule(path)
    gate, up, down = (f"{path}.{n}" for n in arch.experts.linears)
    names = [n for n in (gate, up, down) if n in local]
    if not names:
        return
    with torch.no_grad():
        z = _hidden(mlp, x)  # [n, I]
        if down in local:
            r = awq.search_scales(z, [mlp.down_proj], [True], None, spec, opts.n_grid, opts.duo_scaling,
                                  coarse_step=fast.coarse_step, grid_batch=fast.grid_batch)
            awq.apply_scales(mlp.up_proj, [mlp.down_proj], r.scales)
            z = z / r.scales.to(z.dtype)
    # the expert as a one-MLP table, so clipping and rounding run exactly as for a dense MLP
    unit = dataclasses.replace(arch, linears=(gate, up, down), no_clip=(), fused=((gate, up),),
                               scale_groups=(ScaleGroup(arch.experts.norm, (gate, up), ""), ScaleGroup(up, (down,), "")),
                               sequential=((gate, up), (down,)), row_parallel=(down,), experts=None)
    ud = LayerData(data.index, layer, data.inputs, data.kwargs, {gate: x, down: z})
    grams: dict[str, torch.Tensor] = {}
    ranges = _clip_layer(ud, unit, set(names), opts, spec, grams) if opts.apply_clip else {}
    with torch.no_grad():
        _awq_round(ud, unit, names, ranges, grams, recipe, spec, scale_dtype, results)


def gptq_moe(data: LayerData, arch: Arch, recipe, convert: set[str], scale_dtype: torch.dtype,
             results: dict[str, QuantResult]) -> dict:
    """GPTQ for a MoE block on the quantized attention's output: each MLP in turn (the shared expert on every
    token, each routed expert on its routed tokens): gate and up on one Hessian, then down on the quantized
    gate/up's output. One expert's Hessian and inputs are held at a time -> stats."""
    layer, x_ = data.layer, arch.experts
    local = set(_moe_local(layer, arch, data.index, convert))
    if not local:
        return {}
    parts: list[torch.Tensor] = []
    feed_inputs(layer, data.inputs, data.kwargs, [x_.router], lambda _n, h: parts.append(h.reshape(-1, h.shape[-1])))
    x = torch.cat(parts)  # [T, H]
    del parts
    _, rows, record = _routing(layer, arch, x, recipe)
    spec, device = gptq_spec(recipe, scale_dtype), x.device
    sweep, side = gptq_sweep(recipe.advanced.gptq.kernel, device), side_stream(device)
    losses, dead = [], 0
    for path, e in _units(layer, arch):
        xe = _unit_inputs(x, rows, e)
        mlp = layer.get_submodule(path)
        for stage in (("gate_proj", "up_proj"), ("down_proj",)):
            names = [n for n in stage if f"{path}.{n}" in local]
            if not names:
                continue
            with torch.no_grad():
                z = xe if stage[0] == "gate_proj" else _hidden(mlp, xe)  # [n, in]
            acc = gptq.HessianAccumulator(z.shape[1], device)
            acc.add(z)
            del z
            ws = [mlp.get_submodule(n).weight.data for n in names]
            (r,) = gptq.gptq_quantize_many([(torch.cat(ws), acc.H)], spec, sweep=sweep, side=side)
            del acc
            _store_rows(layer, [f"{path}.{n}" for n in names], layer_prefix(arch, data.index), r, scale_dtype,
                        results)
            losses.append(r.row_loss.sum())
            dead += r.dead_columns
    return {"experts": {**record, "loss": float(torch.stack(losses).sum()) if losses else 0.0,
                        "dead_columns": dead}}


def search_layer_scales(data: LayerData, arch: Arch, recipe, local: set[str],
                        dist: Dist | None = None) -> tuple[list, dict]:
    """AWQ scale search for every foldable group of data.layer with a converted linear, all on the unmodified
    layer -> ([(group, scales [in])], stats per group keyed by its `prev`). Nothing is changed."""
    spec = _spec(recipe)
    device = data.inputs[0].device
    chosen_batches = search_batches([t.shape[0] * t.shape[1] for t in data.inputs], recipe.awq.search_tokens,
                                    recipe.calibration.seed + data.index)
    stats: dict = {}
    chosen = []
    for g in active_scale_groups(data.layer, arch):
        quantized = [n in local for n in g.linears]
        if not any(quantized):
            continue
        t = _clock(device)
        r = _search_group(data, g, quantized, chosen_batches, recipe, spec, dist)
        stats[g.prev] = {**_search_stats(r), "seconds": round(_clock(device) - t, 4)}
        chosen.append((g, r.scales))
    return chosen, stats


def fold_scales(data: LayerData, arch: Arch, chosen: list) -> None:
    """Fold each group's scales into data.layer (prev / s, linears · s) and its captured input (/ s): the layer
    computes the same function, its linears now hold the scaled weights AWQ quantizes."""
    layer = data.layer
    for g, s in chosen:
        awq.apply_scales(layer.get_submodule(g.prev), [layer.get_submodule(n) for n in g.linears], s,
                         arch.norm_offset)
        if g.linears[0] in data.features:
            data.features[g.linears[0]].div_(s.to(data.features[g.linears[0]].dtype))


def gptq_spec(recipe, scale_dtype: torch.dtype) -> gptq.GptqSpec:
    o, fast = recipe.gptq, recipe.advanced.gptq
    return gptq.GptqSpec(recipe.w_bit, recipe.q_group_size, recipe.symmetric, o.block_size, o.damp_percent,
                         o.act_order, scale_dtype, fast.update)


def _summed_hessians(data: LayerData, keys: list[str], dist: Dist) -> dict[str, torch.Tensor]:
    """The Hessians 2·XᵀX / n of the inputs of linears `keys` over every rank's tokens: each rank sums xᵀx over
    its share of the batches (`gptq.HessianAccumulator.add_sum`: float32 sums, half-precision inputs through
    float32-accumulating products, wide inputs by the upper blocks), the sums are added over ranks and divided
    by the total token count once. Exact sums, not a mean of means; the additions run in another order than one
    process's running mean, so H differs from it in the last bits (docs/DISTRIBUTED.md: what that does)."""
    layer, mine = data.layer, dist.span(len(data.inputs))
    accs = {k: gptq.HessianAccumulator(layer.get_submodule(k).in_features, data.inputs[0].device) for k in keys}
    if len(mine):
        dist.agree(lambda: feed_inputs(layer, data.inputs[mine.start : mine.stop],
                                       data.kwargs[mine.start : mine.stop], keys, lambda k, x: accs[k].add_sum(x)))
    else:
        dist.agree(lambda: None)
    n = sum(t.shape[0] * t.shape[1] for t in data.inputs)
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
    batches (`_summed_hessians`), each sweep's rows split over the ranks (`_row_split_solve`)."""
    layer, opts = data.layer, recipe.gptq
    local = _local(arch, data.index, convert)
    stages = arch.sequential if opts.true_sequential else (tuple(arch.linears),)
    feature_of = _feature_of(arch)
    spec = gptq_spec(recipe, scale_dtype)
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
        keys = sorted({feature_of[n] for n in names}, key=arch.linears.index)  # one Hessian per shared input
        if dist is None:
            accs = {k: gptq.HessianAccumulator(layer.get_submodule(k).in_features, data.inputs[0].device)
                    for k in keys}
            feed_inputs(layer, data.inputs, data.kwargs, keys, lambda k, x: accs[k].add(x))
            hessians = {k: accs[k].H for k in keys}
        else:
            hessians = _summed_hessians(data, keys, dist)
        t1 = _clock(device)
        seconds["hessian"] += t1 - t0
        groups = [[n for n in names if feature_of[n] == key] for key in keys]  # linears sharing one Hessian
        weights = [[layer.get_submodule(n).weight.data for n in shared] for shared in groups]
        # one sweep over the row-concatenated weights of each group; independent groups (one-pass Hessians)
        # overlap on CUDA
        problems = [(torch.cat(w), hessians[k]) for w, k in zip(weights, keys)]
        if dist is None:
            solved = gptq.gptq_quantize_many(problems, spec, sweep=sweep, side=side_stream(device))
        else:
            solved = _row_split_solve(problems, spec, sweep, device, dist)
        for shared, ws, r in zip(groups, weights, solved):
            rows = [w.shape[0] for w in ws]
            parts = zip(*([p.clone() for p in t.split(rows)] for t in (r.codes, r.scales, r.zeros, r.row_loss)))
            for n, (codes, scales, zeros, row_loss) in zip(shared, parts):
                _store(layer, n, layer_prefix(arch, data.index), codes, scales.to(scale_dtype), zeros, results)
                losses[n] = row_loss.sum()
                stats[n] = {"damp": r.damp_used, "dead_columns": r.dead_columns, "kernel": r.kernel}
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
    stats[ERRORS] = _read_back(errors)
    return stats


ERRORS = "output_error"  # a layer's per-linear errors travel in its stats until `Job.process` files them apart


def _read_back(errors: dict[str, torch.Tensor]) -> dict[str, float]:
    """name -> 0-dim tensor on the device -> name -> float, in one read-back."""
    return dict(zip(errors, torch.stack(list(errors.values())).tolist())) if errors else {}


def propagation(recipe) -> str:
    """What a recipe's layer inputs are: "fp" (the FP model's, shareable), "quantized" (its own chain of
    quantized layers) or "none" (no calibration inputs: round-to-nearest)."""
    if recipe.method == "rtn":
        return "none"
    return "quantized" if recipe.method == "gptq" else recipe.awq.propagate


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
    errors: dict = field(default_factory=dict)  # layer -> linear -> relative output error (`output_error`)
    overrides: dict[str, torch.Tensor] = field(default_factory=dict)
    seconds: float = 0.0
    runlog: RunLog | None = None  # receives each layer's method stage seconds
    dist: Dist | None = None  # several ranks share the work (`distributed`)

    @property
    def propagate(self) -> str:
        return propagation(self.recipe)

    @property
    def wants_features(self) -> bool:
        return self.recipe.method == "awq"

    def process(self, data: LayerData) -> None:
        r, arch = self.recipe, self.arch
        moe_local = _moe_local(data.layer, arch, data.index, self.convert)
        if r.method == "awq":
            self.stats[data.index] = awq_layer(data, arch, r, self.convert, self.scale_dtype, self.results, self.runlog,
                                               self.dist)
        elif r.method == "gptq":
            self.stats[data.index] = gptq_layer(data, arch, r, self.convert, self.scale_dtype, self.results,
                                                self.runlog, self.dist)
        else:
            _round_to_nearest(data.layer, _local(arch, data.index, self.convert) + moe_local, _spec(r),
                              self.scale_dtype, layer_prefix(arch, data.index), self.results)
        if r.method in ("awq", "gptq"):
            self.errors[data.index] = self.stats[data.index].pop(ERRORS, {})
        if moe_local and r.method in ("awq", "gptq"):
            t0 = _clock(data.inputs[0].device)
            moe = awq_moe if r.method == "awq" else gptq_moe
            self.stats[data.index].update(moe(data, arch, r, self.convert, self.scale_dtype, self.results))
            if self.runlog is not None:
                self.runlog.stage(data.index, r.name, "experts", experts=_clock(data.inputs[0].device) - t0)
        prefix = layer_prefix(arch, data.index)
        for name in (f"{prefix}.{n}" for n in _local(arch, data.index, self.convert) + moe_local):
            res = self.results[name]
            if not bool(torch.isfinite(res.scales).all()):
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
        return {"results": {k: {"codes": _nibbles(r.codes.cpu()), "scales": r.scales.cpu(), "zeros": r.zeros.cpu()}
                            for k, r in self.results.items() if self._in(k, lo, hi)},
                "overrides": {k: t for k, t in self.overrides.items() if self._in(k, lo, hi)},
                "stats": json.dumps({i: self.stats[i] for i in range(lo, hi) if i in self.stats}),
                "errors": json.dumps({i: self.errors[i] for i in range(lo, hi) if i in self.errors}),
                "seconds": self.seconds}

    def restore(self, snap: dict) -> None:
        self.results.update({k: QuantResult(_from_nibbles(r["codes"]), r["scales"], r["zeros"])
                             for k, r in snap["results"].items()})
        self.overrides.update(snap["overrides"])
        self.stats.update({int(i): v for i, v in json.loads(snap["stats"]).items()})
        self.errors.update({int(i): v for i, v in json.loads(snap.get("errors", "{}")).items()})
        self.seconds = snap["seconds"]


def _nibbles(codes: torch.Tensor) -> dict:
    """uint8 codes [out, in] < 16 -> eight per int32 [out, in / 8] (halves a checkpoint); others unchanged."""
    if codes.shape[-1] % 8 or int(codes.max()) > 15:
        return {"raw": codes}
    return {"int4": pack_int32(codes, 4)}


def _from_nibbles(d: dict) -> torch.Tensor:
    return d["raw"] if "raw" in d else unpack_int32(d["int4"], 4).to(torch.uint8)  # [out, in]


def feature_names(arch: Arch) -> list[str]:
    """The linears whose inputs AWQ needs (one per group of linears sharing an input), in execution order;
    for a MoE block, the router's input (every token: each expert's rows are selected from it)."""
    names = sorted(set(_feature_of(arch).values()), key=arch.linears.index)
    return names + ([arch.experts.router] if arch.experts else [])

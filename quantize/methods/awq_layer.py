"""AWQ's per-layer job: scale search on the unmodified layer, folding, clip search, then rounding on the grids.

Joins the architecture table (which linears share an input, what feeds them, which block to inspect) with the
capture loop's data (`capture.LayerData`) and the pure algorithm (`quantize/methods/awq_search.py`); GPTQ's error feedback
(`quantize/methods/gptq_sweep.py`) picks the codes when the recipe sets `awq.rounding: gptq`.
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext

import torch
import torch.nn as nn

from . import awq_grid, awq_search, gptq_hessian, gptq_sweep as gptq, output_error
from ..source.arch import Arch, ScaleGroup, active_scale_groups, layer_prefix
from ..capture.loop import LayerData
from ..capture.device import clock as _clock, side_stream
from ..capture.distributed import Dist
from .primitives import quantize
from ..runlog import RunLog
from .base import ERRORS
from .gptq_layer import gptq_spec
from .kernels import awq_clip, awq_fake_quant, awq_search_dtype, gptq_sweep
from .layer import (QuantResult, batches, cost, expert_hidden, feature_of, first_output, local_linears, moe_linears,
                    owned, qspec, read_back, routing, rows_of, screen_split, search_batches, store, store_rows, unit_inputs,
                    units)


def _search_stats(r, forward_dtype: torch.dtype | None) -> dict:
    """An AWQ scale search's record: the chosen ratio, its loss, round-to-nearest's loss, candidates tried, and for
    a search that ran an inspected block, the dtype of those forwards."""
    return {"best_ratio": r.ratio, "loss": r.losses[r.ratio], "loss_rtn": r.losses[0.0], "n_evaluated": len(r.losses),
            "n_pruned": r.pruned, "n_screened_out": r.screened,
            **({"forward_dtype": str(forward_dtype).removeprefix("torch.")} if forward_dtype is not None else {})}


def _search_group(data: LayerData, g, quantized: list[bool], chosen: list[int], recipe, spec: awq_search.QSpec,
                  dist: Dist | None = None, shared: dict | None = None):
    """Scale search for one scale group of data.layer -> (awq.ScaleSearch, the dtype its block forwards ran in, None
    for a single linear's search). dist: the candidate ratios of each round
    are shared out over the ranks (`Dist.spread`), each loss computed whole on one rank. shared: `LayerData.shared`
    where data.layer is still unmodified: the inspected block's FP output (or the single linear's Gram matrix) on
    the chosen batches is computed once for every variant of a comparison, whatever its group size."""
    opts, fast = recipe.awq, recipe.advanced.awq
    layer = data.layer
    linears = [layer.get_submodule(n) for n in g.linears]
    x = data.features[g.linears[0]]  # [tokens, in]
    sizes = [t.shape[0] * t.shape[1] for t in data.inputs]
    x_loss = rows_of(x, sizes, chosen)
    block = layer.get_submodule(g.inspect) if g.inspect else None
    xb, kwargs, screen = batches(x_loss, [data.inputs[i] for i in chosen]), [data.kwargs[i] for i in chosen], 0
    if block is not None and opts.screen_keep:
        xb, kwargs, screen = screen_split(xb, kwargs if g.inspect_takes_layer_kwargs else [None] * len(xb))
    weights = next((linears[0] if block is None else block).parameters()).dtype
    cast = None if block is None else awq_search_dtype(fast.search_dtype, x.device, weights)

    def forward(xi, kw):  # autocast is left before a generator yields: the loss itself is formed in fp32
        with torch.autocast(x.device.type, dtype=cast) if cast is not None else nullcontext():
            return first_output(block(xi) if kw is None else block(hidden_states=xi, **kw))
    if block is None:
        run_inspect = None  # the single linear itself: loss from XᵀX or X ΔWᵀ, no forward per grid point
    elif g.inspect_takes_layer_kwargs:  # generators: the search may stop a candidate after any batch
        def run_inspect(start: int = 0):
            return (forward(xi, kw) for xi, kw in zip(xb[start:], kwargs[start:]))
    else:
        def run_inspect(start: int = 0):
            return (forward(xi, None) for xi in xb[start:])
    reference = gram = None
    with torch.no_grad():
        if shared is not None:  # the name holds what the value depends on besides the shared inputs
            key = ("awq.search", g.inspect or g.linears[0], tuple(chosen), len(xb), x.dtype, weights, cast)
            if key not in shared:
                shared[key] = awq_search.loss_gram(x_loss) if run_inspect is None else list(run_inspect())
            gram, reference = (shared[key], None) if run_inspect is None else (None, shared[key])
        r = awq_search.search_scales(x, linears, quantized, run_inspect, spec, opts.n_grid, opts.duo_scaling,
                                     coarse_step=fast.coarse_step, x_loss=x_loss, grid_batch=fast.grid_batch,
                                     spread=None if dist is None else dist.spread, reference=reference, gram=gram,
                                     fq=awq_fake_quant(fast.search_kernel, x.device), screen_batches=screen,
                                     screen_keep=opts.screen_keep or 0)
    return r, None if block is None else cast or weights


def _clip_layer(data: LayerData, arch: Arch, local: set[str], opts, spec: awq_search.QSpec,
                grams: dict[str, torch.Tensor], kernel: str, dist: Dist | None = None
                ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Clip search for every converted, clippable linear of data.layer (exact, all tokens) -> name -> (lo, hi)
    per group. grams: feature name -> its group Gram matrices, filled in as needed. dist: one owner per linear."""
    names = [n for n in arch.linears if n in local and n not in arch.no_clip]

    search = awq_clip(kernel, data.inputs[0].device)

    def clip(n: str) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            return search(data.layer.get_submodule(n).weight.data, _group_gram(data, arch, n, spec, grams),
                                   spec, opts.clip_grid, opts.max_shrink, per_side=opts.clip_search == "per_side")
    if dist is None:
        return {n: clip(n) for n in names}
    return dict(zip(names, owned(dist, [(cost(data.layer, [n]), lambda n=n: clip(n)) for n in names])))


def _group_gram(data: LayerData, arch: Arch, name: str, spec: awq_search.QSpec, grams: dict[str, torch.Tensor]):
    """The group Gram matrices [in // g, g, g] of linear `name`'s input (cached per shared input in grams)."""
    key = feature_of(arch)[name]
    if key not in grams:
        grams[key] = awq_grid.group_gram(data.features[key], spec.group)  # [n_group, g, g]
    return grams[key]


def _awq_round(data: LayerData, arch: Arch, names: list[str], ranges: dict, grams: dict, recipe, spec: awq_search.QSpec,
               scale_dtype: torch.dtype, results: dict[str, QuantResult]) -> None:
    """Quantize the scaled linears `names` of data.layer on their clip grids: grid from the clip range, scales
    refit by least squares (awq.refit_iters), codes by round-to-nearest or GPTQ (awq.rounding)."""
    layer, opts, prefix = data.layer, recipe.awq, layer_prefix(arch, data.index)
    grids = {}
    for n in names:
        w = layer.get_submodule(n).weight.data
        scales, zeros = awq_grid.clip_grid(w, *ranges.get(n, (None, None)), spec)
        if opts.refit_iters:
            scales = awq_grid.refit_scales(w, _group_gram(data, arch, n, spec, grams), scales, zeros, spec,
                                           opts.refit_iters, scale_dtype)
        grids[n] = (scales.to(scale_dtype), zeros)
    if opts.rounding == "rtn":
        for n in names:
            scales, zeros = grids[n]
            codes = quantize(layer.get_submodule(n).weight.data, scales, zeros, spec.w_bit)
            store(layer, n, prefix, codes, scales, zeros, results)
        return
    input_of = feature_of(arch)
    keys = sorted({input_of[n] for n in names}, key=arch.linears.index)  # one Hessian per shared input
    shared = [[n for n in names if input_of[n] == k] for k in keys]
    problems, cat_grids = [], []
    for k, group in zip(keys, shared):
        acc = gptq_hessian.HessianAccumulator(data.features[k].shape[1], data.features[k].device)
        acc.add(data.features[k])  # the scaled input [tokens, in]
        problems.append((torch.cat([layer.get_submodule(n).weight.data for n in group]), acc.H))
        cat_grids.append(tuple(torch.cat([grids[n][i] for n in group]) for i in (0, 1)))
    gspec = dataclasses.replace(gptq_spec(recipe, scale_dtype), act_order=True)  # static groups: the clip grid
    dev = problems[0][0].device
    solved = gptq.gptq_quantize_many(problems, gspec, cat_grids, gptq_sweep(recipe.advanced.gptq.kernel, dev),
                                     side_stream(dev))
    for group, r in zip(shared, solved):
        store_rows(layer, group, prefix, r, scale_dtype, results)


def _awq_round_owned(data: LayerData, arch: Arch, names: list[str], ranges: dict, grams: dict, recipe,
                     spec: awq_search.QSpec, scale_dtype: torch.dtype, results: dict[str, QuantResult],
                     dist: Dist) -> None:
    """`_awq_round` with each unit on its owner: a linear (round-to-nearest) or the linears sharing one input
    (GPTQ rounding, one Hessian); each unit computes exactly what `_awq_round` computes for it."""
    layer, opts, prefix = data.layer, recipe.awq, layer_prefix(arch, data.index)

    def grid(n: str):
        w = layer.get_submodule(n).weight.data
        scales, zeros = awq_grid.clip_grid(w, *ranges.get(n, (None, None)), spec)
        if opts.refit_iters:
            scales = awq_grid.refit_scales(w, _group_gram(data, arch, n, spec, grams), scales, zeros, spec,
                                           opts.refit_iters, scale_dtype)
        return scales.to(scale_dtype), zeros

    def rtn(n: str):
        with torch.no_grad():
            scales, zeros = grid(n)
            return [(quantize(layer.get_submodule(n).weight.data, scales, zeros, spec.w_bit), scales, zeros)]

    def rounded(group: list[str], k: str):
        with torch.no_grad():
            grids = [grid(n) for n in group]
            acc = gptq_hessian.HessianAccumulator(data.features[k].shape[1], data.features[k].device)
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
        units, groups = [(cost(layer, [n]), lambda n=n: rtn(n)) for n in names], [[n] for n in names]
    else:
        input_of = feature_of(arch)
        keys = sorted({input_of[n] for n in names}, key=arch.linears.index)
        groups = [[n for n in names if input_of[n] == k] for k in keys]
        units = [(cost(layer, g), lambda g=g, k=k: rounded(g, k)) for g, k in zip(groups, keys)]
    for group, parts in zip(groups, owned(dist, units)):
        for n, (codes, scales, zeros) in zip(group, parts):
            store(layer, n, prefix, codes, scales, zeros, results)


def awq_layer(data: LayerData, arch: Arch, recipe, convert: set[str], scale_dtype: torch.dtype,
              results: dict[str, QuantResult], runlog: RunLog | None = None, dist: Dist | None = None) -> dict:
    """Search and apply AWQ scales, search clips, then quantize the layer on those grids -> search stats.

    Stats: per scale group (keyed by its `prev`) the chosen ratio, its loss, the RTN loss (α = 0), how many
    ratios were evaluated and the seconds taken; under "seconds" the time of each sub-stage (also into runlog).
    dist: every rank holds every token's features; each scale search's candidates are shared out over the ranks
    and each clip and rounding unit is computed by one owner and broadcast, so the results are those of one
    process, bit for bit.
    """
    opts, spec = recipe.awq, qspec(recipe)
    device = data.inputs[0].device
    local = set(local_linears(arch, data.index, convert))
    t0 = _clock(device)
    chosen, stats = search_layer_scales(data, arch, recipe, local, dist)
    fold_scales(data, arch, chosen)
    t1 = _clock(device)
    grams: dict[str, torch.Tensor] = {}
    ranges = _clip_layer(data, arch, local, opts, spec, grams, recipe.advanced.awq.clip_kernel, dist) \
        if opts.apply_clip else {}
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
    """Each AWQ linear's relative output error on the tokens its scale search scored: scaled weights W·s against
    their codes, on the scaled inputs X / s. Where `awq.input_gram` takes the Gram form (float32 inputs with
    at least as many tokens as columns: the CPU) it comes from XᵀX, one per shared input (`output_error.from_hessian`,
    the same quantity), else from the products with X (`output_error.from_inputs`).

    The denominators (||X Wᵀ||² of the scaled W and X) are values of the scale search's result: in a comparison
    (`data.shared`) the variants that took one search (`search_layer_scales`) compute each once."""
    sizes = [t.shape[0] * t.shape[1] for t in data.inputs]
    chosen = search_batches(sizes, recipe.awq.search_tokens, recipe.calibration.seed + data.index)
    input_of, rows, grams = feature_of(arch), {}, {}
    errors = {}
    searched = ("awq.error_den", tuple(scaled), _search_settings(recipe))  # the linears searched, and how
    with torch.no_grad():
        for n, w in scaled.items():
            key = input_of[n]
            if key not in rows:
                rows[key] = rows_of(data.features[key], sizes, chosen)  # [tokens', in]
                grams[key] = awq_search.input_gram(rows[key])  # [in, in] or None
            q = data.layer.get_submodule(n).weight.data
            den = None if data.shared is None else data.shared.get((*searched, n))
            if den is None:
                den = (output_error.norm_from_inputs(w, rows[key]) if grams[key] is None
                       else output_error.norm_from_hessian(w, grams[key]))
                if data.shared is not None:
                    data.shared[(*searched, n)] = den
            errors[n] = (output_error.from_inputs(w, q, rows[key], den) if grams[key] is None
                         else output_error.from_hessian(w, q, grams[key], den))
    return read_back(errors)


def search_spec(recipe) -> awq_search.QSpec:
    """The quantizer the scale search scores its candidates with (`awq.search_group_size`)."""
    return awq_search.QSpec(recipe.w_bit, recipe.awq.search_group(recipe.q_group_size), symmetric=recipe.symmetric)


def _search_settings(recipe) -> tuple:
    """Every recipe setting a scale search reads besides its inputs: two recipes equal here search alike."""
    o, fast = recipe.awq, recipe.advanced.awq
    return (search_spec(recipe), o.n_grid, o.duo_scaling, o.search_tokens, o.screen_keep, recipe.calibration.seed,
            fast.coarse_step, fast.grid_batch, fast.search_kernel, fast.search_dtype)


def search_layer_scales(data: LayerData, arch: Arch, recipe, local: set[str],
                        dist: Dist | None = None) -> tuple[list, dict]:
    """AWQ scale search for every foldable group of data.layer with a converted linear, all on the unmodified
    layer -> ([(group, scales [in])], stats per group keyed by its `prev`). Nothing is changed.

    In a comparison (`data.shared`), a search is run once for every variant whose search settings are the same
    (`_search_settings`: e.g. recipes differing only in q_group_size that set one awq.search_group_size): the
    others take its result, which is what their own search would compute from the same unmodified layer and
    inputs; their stats say `shared` and give the seconds of the search they took it from."""
    spec = search_spec(recipe)
    device = data.inputs[0].device
    chosen_batches = search_batches([t.shape[0] * t.shape[1] for t in data.inputs], recipe.awq.search_tokens,
                                    recipe.calibration.seed + data.index)
    stats: dict = {}
    chosen = []
    for g in active_scale_groups(data.layer, arch):
        quantized = [n in local for n in g.linears]
        if not any(quantized):
            continue
        key = ("awq.scales", g.prev, tuple(quantized), tuple(chosen_batches), _search_settings(recipe))
        if data.shared is not None and key in data.shared:
            r, forward_dtype, seconds = data.shared[key]
            stats[g.prev] = {**_search_stats(r, forward_dtype), "seconds": seconds, "shared": True}
        else:
            t = _clock(device)
            r, forward_dtype = _search_group(data, g, quantized, chosen_batches, recipe, spec, dist, data.shared)
            seconds = round(_clock(device) - t, 4)
            stats[g.prev] = {**_search_stats(r, forward_dtype), "seconds": seconds}
            if data.shared is not None:
                data.shared[key] = (r, forward_dtype, seconds)
        chosen.append((g, r.scales))
    return chosen, stats


def fold_scales(data: LayerData, arch: Arch, chosen: list) -> None:
    """Fold each group's scales into data.layer (prev / s, linears · s) and its captured input (/ s): the layer
    computes the same function, its linears now hold the scaled weights AWQ quantizes."""
    layer = data.layer
    for g, s in chosen:
        awq_search.apply_scales(layer.get_submodule(g.prev), [layer.get_submodule(n) for n in g.linears], s,
                                arch.norm_offset)
        if g.linears[0] in data.features:
            data.features[g.linears[0]].div_(s.to(data.features[g.linears[0]].dtype))


def norm_consumers(layer: nn.Module, arch: Arch) -> list[str]:
    """Every module a MoE block's norm feeds, so an AWQ scale folded into the norm is folded into each: the
    gate/up of the shared and the routed experts, then the router and the shared-expert gate (kept 16-bit)."""
    fed = [f"{path}.{n}" for path, _ in units(layer, arch) for n in ("gate_proj", "up_proj")]
    return fed + list(arch.experts.unconverted())


def awq_moe(data: LayerData, arch: Arch, recipe, convert: set[str], scale_dtype: torch.dtype,
            results: dict[str, QuantResult]) -> dict:
    """AWQ for a MoE block: one scale for its norm (searched on the block's output, every expert it feeds
    fake-quantized, the router and shared-expert gate scaled but kept 16-bit), then each MLP in turn on its own
    tokens: the up -> down scale, clips and rounding. Only one expert's inputs are held at a time -> stats."""
    layer, opts, spec, x_ = data.layer, recipe.awq, qspec(recipe), arch.experts
    local = set(moe_linears(layer, arch, data.index, convert))
    if not local:
        return {}
    x = data.features[x_.router]  # [T, H] the block's input on every token
    _, rows, record = routing(layer, arch, x, recipe)
    stats: dict = {"experts": record}
    consumers = norm_consumers(layer, arch)  # every one is scaled, converted or not, so the block is unchanged
    fed = [n for n in consumers if n not in x_.unconverted()]
    if any(n in local for n in fed):
        chosen = search_batches([t.shape[0] * t.shape[1] for t in data.inputs], opts.search_tokens,
                                recipe.calibration.seed + data.index)
        g = ScaleGroup(prev=x_.norm, linears=tuple(fed), inspect=x_.block)
        r, forward_dtype = _search_group(dataclasses.replace(data, features={fed[0]: x}), g,
                                         [n in local for n in fed], chosen, recipe, search_spec(recipe))
        stats[x_.norm] = _search_stats(r, forward_dtype)
        awq_search.apply_scales(layer.get_submodule(x_.norm), [layer.get_submodule(n) for n in consumers], r.scales,
                                arch.norm_offset)
        x = x / r.scales.to(x.dtype)  # [T, H] what the scaled linears now see
    for path, e in units(layer, arch):
        _awq_unit(data, arch, path, unit_inputs(x, rows, e), local, recipe, spec, scale_dtype, results)
    return stats


def _awq_unit(data: LayerData, arch: Arch, path: str, x: torch.Tensor, local: set[str], recipe, spec: awq_search.QSpec,
              scale_dtype: torch.dtype, results: dict[str, QuantResult]) -> None:
    """One expert MLP at `path` on its calibration inputs x [n, H] (already scaled by the norm's AWQ scale)."""
    opts, fast, layer = recipe.awq, recipe.advanced.awq, data.layer
    mlp = layer.get_submodule(path)
    gate, up, down = (f"{path}.{n}" for n in arch.experts.linears)
    names = [n for n in (gate, up, down) if n in local]
    if not names:
        return
    with torch.no_grad():
        z = expert_hidden(mlp, x)  # [n, I]
        if down in local:
            r = awq_search.search_scales(z, [mlp.down_proj], [True], None, search_spec(recipe), opts.n_grid,
                                         opts.duo_scaling, coarse_step=fast.coarse_step, grid_batch=fast.grid_batch,
                                         fq=awq_fake_quant(fast.search_kernel, z.device))
            awq_search.apply_scales(mlp.up_proj, [mlp.down_proj], r.scales)
            z = z / r.scales.to(z.dtype)
    # the expert as a one-MLP table, so clipping and rounding run exactly as for a dense MLP
    unit = dataclasses.replace(arch, linears=(gate, up, down), no_clip=(), fused=((gate, up),),
                               scale_groups=(ScaleGroup(arch.experts.norm, (gate, up), ""), ScaleGroup(up, (down,), "")),
                               sequential=((gate, up), (down,)), row_parallel=(down,), experts=None)
    ud = LayerData(data.index, layer, data.inputs, data.kwargs, {gate: x, down: z})
    grams: dict[str, torch.Tensor] = {}
    ranges = _clip_layer(ud, unit, set(names), opts, spec, grams, recipe.advanced.awq.clip_kernel) \
        if opts.apply_clip else {}
    with torch.no_grad():
        _awq_round(ud, unit, names, ranges, grams, recipe, spec, scale_dtype, results)

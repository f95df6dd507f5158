"""What every method's per-layer job shares: where results go, which linears a layer converts, work split.

A converted linear's result is data (`QuantResult`: codes, scales, zeros); `store` records it and leaves the
dequantized weight in the layer, so the in-memory model computes exactly what the exported artifact computes.
Names are relative to the decoder layer unless a `prefix` (the layer's full name) is joined.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from . import awq_search
from ..source.arch import Arch, get_module, layer_prefix
from ..capture.distributed import Dist
from ..source.experts import routed_tokens
from .primitives import dequantize, quantize_for_export


@dataclass
class QuantResult:
    """One converted linear: codes [out, in] uint8, scales [out, n_group] (stored dtype), zeros int32."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor


def local_linears(arch: Arch, index: int, convert: set[str]) -> list[str]:
    """Linears of layer `index` (names relative to the layer) that the plan converts, in execution order."""
    prefix = layer_prefix(arch, index)
    return [n for n in arch.linears if f"{prefix}.{n}" in convert]


def units(layer: nn.Module, arch: Arch) -> list[tuple[str, int | None]]:
    """A MoE layer's MLPs: (path, routed expert index), the shared expert (index None) first."""
    x = arch.experts
    routed = [(x.expert(e), e) for e in range(len(get_module(layer, x.module)))]
    return ([(x.shared, None)] if x.shared else []) + routed


def moe_linears(layer: nn.Module, arch: Arch, index: int, convert: set[str]) -> list[str]:
    """The MoE block's linears of layer `index` that the plan converts, in execution order ([] for dense)."""
    if arch.experts is None:
        return []
    prefix = layer_prefix(arch, index)
    names = [f"{path}.{n}" for path, _ in units(layer, arch) for n in arch.experts.linears]
    return [n for n in names if f"{prefix}.{n}" in convert]


def feature_of(arch: Arch) -> dict[str, str]:
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

    Copying each layer's codes to pageable host memory is slow and leaves the GPU idle; export packs on the
    device anyway, so codes kept there never make the round trip (profile: docs/BENCHMARKS.md). Large models spill
    to the CPU once the share is used up.
    """
    if t.device.type != "cuda":
        return torch.device("cpu")
    kept = sum(x.numel() * x.element_size() for r in results.values() for x in (r.codes, r.scales, r.zeros)
               if x.device == t.device)
    total = torch.cuda.get_device_properties(t.device).total_memory
    return t.device if kept + 2 * t.numel() * t.element_size() <= RESULTS_DEVICE_SHARE * total else torch.device("cpu")


def store(layer: nn.Module, name: str, prefix: str, codes, scales, zeros, results: dict[str, QuantResult]) -> None:
    """Record a converted linear and leave its dequantized weight in the layer."""
    fc = layer.get_submodule(name)
    fc.weight.data = dequantize(codes, scales, zeros).to(fc.weight.device, fc.weight.dtype)
    home = _result_home(codes, results)
    results[f"{prefix}.{name}"] = QuantResult(codes.to(home), scales.to(home), zeros.to(home))


def store_rows(layer: nn.Module, names: list[str], prefix: str, r, scale_dtype: torch.dtype,
                results: dict[str, QuantResult]) -> None:
    """One GPTQ problem solved for several linears stacked by rows (q/k/v, gate/up): each linear's rows stored."""
    rows = [layer.get_submodule(n).weight.shape[0] for n in names]
    for n, codes, scales, zeros in zip(names, *(t.split(rows) for t in (r.codes, r.scales, r.zeros))):
        store(layer, n, prefix, codes.contiguous(), scales.to(scale_dtype).contiguous(), zeros.contiguous(), results)


def owned(dist: Dist, units: list[tuple[float, Callable[[], object]]]) -> list:
    """Units of work (cost, fn) -> their results in order, each computed once by its owner (`Dist.owner`) and
    broadcast. Every rank first computes all it owns, then the results travel: the ranks work at the same time."""
    owners = [dist.owner(cost) for cost, _ in units]
    mine = {i: dist.attempt(fn) for i, ((_, fn), o) in enumerate(zip(units, owners)) if o == dist.rank}
    return [dist.share(o, mine.get(i)) for i, o in enumerate(owners)]


def cost(layer: nn.Module, names: list[str]) -> float:
    """The work of a unit over these linears, for the balanced assignment: in · out summed."""
    return float(sum(layer.get_submodule(n).weight.numel() for n in names))


def batches(x: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """x: [tokens, in] concatenated over batches -> per batch [b, seq, in], matching `like`'s batch shapes."""
    sizes = [t.shape[0] * t.shape[1] for t in like]
    return [part.reshape(t.shape[0], t.shape[1], -1) for part, t in zip(torch.split(x, sizes), like)]


def screen_split(xb: list[torch.Tensor], kwargs: list) -> tuple[list[torch.Tensor], list, int]:
    """A scale search's batches [b, seq, in] and their layer keyword arguments (None: the block takes none) ->
    (batches, kwargs, screen): the first `screen` batches are a screened search's screening half (0: none).

    Two or more batches: the first half of them, rounded down. A single batch of b >= 2 sequences is cut into its
    first and second half when its keyword arguments hold no tensor with b rows (positions and masks shared by
    every sequence: what a decoder stack hands its layers without padding); the halves hold the same sequences."""
    if len(xb) >= 2:
        return xb, kwargs, len(xb) // 2
    b = xb[0].shape[0] if xb else 0
    if b < 2 or _per_sequence(kwargs[0], b):
        return xb, kwargs, 0
    return [xb[0][: b // 2], xb[0][b // 2 :]], [kwargs[0], kwargs[0]], 1


def _per_sequence(obj, b: int) -> bool:
    """Whether obj (nested tuples, lists, dicts) holds a tensor whose first dimension is b."""
    if isinstance(obj, torch.Tensor):
        return obj.dim() > 0 and obj.shape[0] == b
    if isinstance(obj, (tuple, list)):
        return any(_per_sequence(o, b) for o in obj)
    if isinstance(obj, dict):
        return any(_per_sequence(o, b) for o in obj.values())
    return False


def first_output(y):
    return y[0] if isinstance(y, tuple) else y


def qspec(recipe) -> awq_search.QSpec:
    return awq_search.QSpec(recipe.w_bit, recipe.q_group_size, symmetric=recipe.symmetric)


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


def rows_of(x: torch.Tensor, sizes: list[int], chosen: list[int]) -> torch.Tensor:
    """x: [tokens, in] concatenated over batches of `sizes` tokens -> the rows of the chosen batches."""
    if len(chosen) == len(sizes):
        return x
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + n)
    return torch.cat([x[offsets[i] : offsets[i + 1]] for i in chosen])  # [tokens', in]


def expert_hidden(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """An expert MLP's down_proj input: x [n, H] -> act(gate(x)) · up(x) [n, I]."""
    return mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)


def expert_tokens(top_k_index: torch.Tensor, n_experts: int, min_tokens: int):
    """top_k_index [T, k] -> (routed token count per expert, rows per expert: its routed tokens [n_e], or None
    where it got fewer than max(min_tokens, 1): that expert is calibrated on every token (the recipe's
    moe.min_expert_tokens rule; never on none, which would leave GPTQ nothing but zeros to write))."""
    counts = torch.bincount(top_k_index.flatten(), minlength=n_experts).tolist()
    rows = [None if c < max(min_tokens, 1) else routed_tokens(top_k_index, e) for e, c in enumerate(counts)]
    return counts, rows


def routing(layer: nn.Module, arch: Arch, x: torch.Tensor, recipe) -> tuple[list[int], list, dict]:
    """The router's choice for the MoE block's input x [T, H] -> (counts, rows as `expert_tokens`, record)."""
    with torch.no_grad():
        top_k_index = get_module(layer, arch.experts.router)(x)[2]  # (logits, weights, indices [T, k])
    n = len(get_module(layer, arch.experts.module))
    m = recipe.moe_options.min_expert_tokens
    counts, rows = expert_tokens(top_k_index, n, m)
    record = {"tokens": int(x.shape[0]), "routed_tokens": counts, "min_expert_tokens": m,
              "calibrated_on_all_tokens": [e for e, r in enumerate(rows) if r is None]}
    return counts, rows, record


def unit_inputs(x: torch.Tensor, rows: list, e: int | None) -> torch.Tensor:
    """The calibration inputs of one MLP: the shared expert and under-fed experts see every token."""
    return x if e is None or rows[e] is None else x[rows[e]]  # [n_e, H]


def round_to_nearest(layer: nn.Module, names: list[str], spec: awq_search.QSpec, scale_dtype: torch.dtype, prefix: str,
                      results: dict[str, QuantResult]) -> None:
    for n in names:
        w = layer.get_submodule(n).weight.data
        group = w.shape[1] if spec.group == -1 else spec.group
        codes, scales, zeros = quantize_for_export(w, spec.w_bit, group, symmetric=spec.symmetric,
                                                   scale_dtype=scale_dtype)
        store(layer, n, prefix, codes, scales, zeros, results)


def read_back(errors: dict[str, torch.Tensor]) -> dict[str, float]:
    """name -> 0-dim tensor on the device -> name -> float, in one read-back."""
    return dict(zip(errors, torch.stack(list(errors.values())).tolist())) if errors else {}

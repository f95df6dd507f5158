"""A budgeted mixed group size (a recipe's `mixed:`): every converted linear quantized at each size in one pass, then
a greedy knapsack picks one size per module vLLM loads, within a bits-per-weight budget.

In the pass a `MixedJob` runs the recipe's method once per size (`Method.at_group_size`: AWQ keeps one scale
search for all sizes, so the norms and every other 16-bit tensor come out the same at each) on copies of each
decoder layer; the base size works on the layer itself, so a method with its own chain (GPTQ) carries the
base size's chain and every size of a layer sees the same inputs. Each size's job records every linear's relative
output error e (`methods/output_error.py`). After the pass (`settle`):

    bits per weight = Σ bytes the quantized linears store x 8 / Σ their weights   (compare's "bits / weight";
                      each linear's bytes from its format: `Format.linear_bytes`)
    unit            = the linears vLLM loads as one module (q/k/v, gate/up) or one linear: one size for all
    start           every unit at the coarsest size (base_group, or the coarsest of mixed.coarser)
    repeat          among the moves of a unit to a finer size whose extra bits still fit the budget, take the one
                    that lowers Σ e of the unit's linears most per extra bit; stop when none fits or lowers it

The artifact holds each linear as its chosen size's job made it; the manifest's `mixed` record holds every
linear's size, its error at every size and the bits per weight reached.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace

import torch

from . import formats, methods
from .methods.job import Job
from .methods.layer import local_linears
from .source.arch import Arch, checkpoint_name, layer_prefix

OBJECTIVE = "sum of the unit's linears' relative output errors (methods/output_error.py) lowered per extra bit"


@dataclass(frozen=True)
class Unit:
    """Linears that take one group size (vLLM loads them as one module): their bits and summed error per size."""

    names: tuple[str, ...]  # full module names
    bits: dict[int, int]  # group size -> bits the unit's linears store at it
    error: dict[int, float]  # group size -> Σ relative output error of its linears at it


def choose(units: list[Unit], sizes: tuple[int, ...], weights: int, budget: float) -> list[int]:
    """units, sizes (coarsest to finest: `MixedOptions.ladder`), weights (every quantized weight), budget (bits
    per weight) -> the group size of each unit: the greedy knapsack of the module docstring."""
    allowed = budget * weights
    chosen = [sizes[0]] * len(units)
    spent = sum(u.bits[sizes[0]] for u in units)
    if spent > allowed:
        raise ValueError(f"the coarsest size alone stores {spent / weights:.4f} bits per weight, above the budget "
                         f"{budget}")
    while True:
        best = None  # (error lowered per bit, unit index, size, extra bits)
        for k, u in enumerate(units):
            now = chosen[k]
            for g in sizes[sizes.index(now) + 1:]:
                extra, gain = u.bits[g] - u.bits[now], u.error[now] - u.error[g]
                assert extra > 0, (u.names, now, g)  # a finer size stores more scales
                if gain > 0 and spent + extra <= allowed and (best is None or gain / extra > best[0]):
                    best = (gain / extra, k, g, extra)
        if best is None:
            return chosen
        _, k, g, extra = best
        chosen[k], spent = g, spent + extra


def units_of(arch: Arch, index: int, convert: set[str]) -> list[tuple[str, ...]]:
    """Decoder layer `index`'s converted linears grouped as vLLM loads them (names relative to the layer)."""
    local = local_linears(arch, index, convert)
    fused = [tuple(n for n in f if n in local) for f in arch.fused]
    fused = [f for f in fused if f]
    inside = {n for f in fused for n in f}
    return fused + [(n,) for n in local if n not in inside]


@dataclass
class MixedJob(Job):
    """A `mixed:` recipe in the pass: one job per group size (`candidates`, base size last), one artifact.

    results, errors, stats, overrides and `mixed` are filled by `settle` from the size each linear gets."""

    candidates: list[Job] = field(default_factory=list)

    @classmethod
    def of(cls, recipe, arch: Arch, convert: set[str], scale_dtype: torch.dtype, **kw) -> "MixedJob":
        method = methods.get(recipe.method)
        sizes = recipe.mixed.sizes
        cands = [Job(method.at_group_size(recipe, g).model_copy(update={"name": f"{recipe.name}-g{g}"}), arch,
                     convert, scale_dtype, **kw) for g in reversed(sizes)]  # the base size last
        return cls(recipe, arch, convert, scale_dtype, candidates=cands, **kw)

    @property
    def wants_features(self) -> bool:
        return any(c.wants_features for c in self.candidates)

    def process(self, data) -> None:
        """Every size on the layer: the finer ones on copies of it, the base size on the layer itself."""
        shared = data.shared if data.shared is not None or self.propagate != "fp" else {}
        last = len(self.candidates) - 1
        for k, job in enumerate(self.candidates):
            if k == last:
                job.process(replace(data, shared=shared))
                continue
            clone = {"features": {n: t.clone() for n, t in data.features.items()},
                     "fp_features": {n: t.clone() for n, t in data.fp_features.items()}}
            work = copy.deepcopy(data.layer)
            job.process(replace(data, layer=work, shared=shared, replay=None, **clone))
            job.keep(data.index, work)
            del work, clone

    def keep(self, index: int, layer) -> None:
        self.candidates[-1].keep(index, layer)  # no layer is written before `settle` has chosen

    def snapshot(self, lo: int, hi: int) -> dict:
        return {"candidates": [c.snapshot(lo, hi) for c in self.candidates], "seconds": self.seconds}

    def restore(self, snap: dict) -> None:
        for c, s in zip(self.candidates, snap["candidates"]):
            c.restore(s)
        self.seconds = snap["seconds"]

    def settle(self) -> None:
        """Choose each unit's size (`choose`) and take each linear, its error and the layer tensors from there."""
        base = self.candidates[-1]
        by_size = {c.recipe.q_group_size: c for c in self.candidates}
        _same_tensors(base, self.candidates)
        opts, fmt, r = self.recipe.mixed, formats.get(self.recipe.out_format), self.recipe
        layers = sorted(base.errors)
        units, where = [], []
        for i in layers:
            for names in units_of(self.arch, i, self.convert):
                full = tuple(f"{layer_prefix(self.arch, i)}.{n}" for n in names)
                shapes = [tuple(base.results[f].codes.shape) for f in full]
                units.append(Unit(full, {g: sum(8 * fmt.linear_bytes(o, n, g, r.w_bit, r.symmetric)
                                                for o, n in shapes) for g in opts.sizes},
                                  {g: sum(by_size[g].errors[i][n] for n in names) for g in opts.sizes}))
                where.append((i, names))
        weights = sum(res.codes.numel() for res in base.results.values())
        chosen = choose(units, opts.ladder, weights, opts.budget_bits_per_weight)
        self._take(by_size, units, where, chosen, weights)

    def _take(self, by_size: dict, units: list[Unit], where: list, chosen: list[int], weights: int) -> None:
        base, opts = self.candidates[-1], self.recipe.mixed
        self.overrides, self.stats = base.overrides, base.stats
        self.groups = {}
        groups: dict[str, dict[str, int]] = {}
        for u, (i, names), g in zip(units, where, chosen):
            for full, n in zip(u.names, names):
                self.results[full] = by_size[g].results[full]
                self.errors.setdefault(i, {})[n] = by_size[g].errors[i][n]
                self.groups[checkpoint_name(self.arch, full)] = g
                groups.setdefault(str(i), {})[n] = g
        spent = sum(u.bits[g] for u, g in zip(units, chosen))
        self.mixed = {
            "base_group": opts.base_group, "finer": list(opts.finer), "coarser": list(opts.coarser),
            "budget_bits_per_weight": opts.budget_bits_per_weight,
            "bits_per_weight": round(spent / weights, 6),
            "bits_per_weight_at": {str(g): round(sum(u.bits[g] for u in units) / weights, 6) for g in opts.sizes},
            "weights": weights,
            "linears": {str(g): sum(len(u.names) for u, c in zip(units, chosen) if c == g) for g in opts.sizes},
            "error_sum": {**{str(g): round(sum(u.error[g] for u in units), 6) for g in opts.sizes},
                          "chosen": round(sum(u.error[g] for u, g in zip(units, chosen)), 6)},
            "objective": OBJECTIVE,
            "groups": groups,
            "errors": {str(i): {n: {str(g): by_size[g].errors[i][n] for g in opts.sizes} for n in per}
                       for i, per in sorted(base.errors.items())},
        }


def _same_tensors(base: Job, candidates: list[Job]) -> None:
    """Every size must have left the same tensors outside the converted linears (norms, biases), or linears of
    different sizes could not share them."""
    for c in candidates:
        if c is base:
            continue
        for name, t in base.overrides.items():
            other = c.overrides.get(name)
            if other is None or not torch.equal(other, t):
                raise RuntimeError(f"mixed: group size {c.recipe.q_group_size} left {name} different from group size "
                                   f"{base.recipe.q_group_size}: method {base.recipe.method} changes tensors outside "
                                   f"the linears with the group size, so its linears of different sizes cannot be "
                                   f"combined")

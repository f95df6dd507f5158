"""One recipe's state in a shared layer-by-layer pass: its method's results, statistics and the tensors it left.

The capture loop (`capture.run_shared`) hands each job (a `capture.loop.LayerJob`) every decoder layer; the job
asks its method (`methods.get(recipe.method)`) for the work. Snapshots of what a job produced feed per-layer
checkpoints.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from .. import methods
from ..source.arch import Arch, layer_prefix
from ..capture.loop import LayerData, NumericalError
from ..capture.device import clock as _clock
from ..capture.distributed import Dist
from .base import ERRORS
from .layer import QuantResult, feature_of, local_linears, moe_linears
from ..runlog import RunLog


DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}  # recipe dtype names


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
    weights: object | None = None  # an `export.stream.WeightStream`: told when each layer is final
    # where one artifact mixes group sizes (`quantize.mixed`): each converted linear's checkpoint name -> its
    # group size, and the manifest's `mixed` record
    groups: dict[str, int] | None = None
    mixed: dict | None = None

    @property
    def method(self) -> methods.Method:
        return methods.get(self.recipe.method)

    @property
    def propagate(self) -> str:
        return self.method.propagation(self.recipe)

    @property
    def wants_features(self) -> bool:
        return self.method.wants_features(self.recipe)

    @property
    def wants_fp_features(self) -> bool:
        return self.propagate == "quantized" and self.method.wants_fp_features(self.recipe)

    @property
    def wants_fp_outputs(self) -> bool:
        return self.propagate == "quantized" and self.method.wants_fp_outputs(self.recipe)

    def prefix(self, index: int) -> str:
        """The full module name of decoder layer `index`."""
        return layer_prefix(self.arch, index)

    def process(self, data: LayerData) -> None:
        """The method's job on one decoder layer, then on its mixture-of-experts block if it has one."""
        m, device = self.method, next(data.layer.parameters()).device
        stats = m.layer(data, self)
        if ERRORS in stats:
            self.errors[data.index] = stats.pop(ERRORS)
        moe = moe_linears(data.layer, self.arch, data.index, self.convert)
        if moe:
            t0 = _clock(device)
            stats = {**stats, **m.experts(data, self)}
            if self.runlog is not None:
                self.runlog.stage(data.index, self.recipe.name, "experts", experts=_clock(device) - t0)
        if stats:
            self.stats[data.index] = stats
        prefix = self.prefix(data.index)
        for name in (f"{prefix}.{n}" for n in local_linears(self.arch, data.index, self.convert) + moe):
            res = self.results[name]
            if not bool(torch.isfinite(res.scales).all()):
                raise NumericalError(f"{name}: {m.name} produced NaN/inf scales (the weights or their "
                                     f"calibration inputs overflow in {res.scales.dtype}); try compute_dtype: float32")

    def keep(self, index: int, layer: nn.Module) -> None:
        prefix = layer_prefix(self.arch, index)
        for name, t in layer.state_dict().items():
            full = f"{prefix}.{name}"
            if full.removesuffix(".weight") not in self.results:
                self.overrides[full] = t.detach().to("cpu", copy=True)
        if self.weights is not None:  # the layer's results and tensors are final now
            self.weights.layer(index)

    def settle(self) -> None:
        """The pass is over: what the artifact holds is final here (a mixed job picks its sizes now)."""

    def _in(self, name: str, lo: int, hi: int) -> bool:
        return any(name.startswith(layer_prefix(self.arch, i) + ".") for i in range(lo, hi))

    def snapshot(self, lo: int, hi: int) -> dict:
        """What this job produced for layers [lo, hi), as plain tensors (for `checkpoint`, weights_only loads)."""
        return {"results": {k: {"codes": _nibbles(r.codes), "scales": r.scales.cpu(), "zeros": r.zeros.cpu()}
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
    """uint8 codes [out, in] < 16 -> two per byte [out, in / 2] (halves a checkpoint), on the CPU; others
    unchanged. Packed where the codes are, in uint8 arithmetic: packing eight to an int32 through int64 (the
    formats' `pack_int32`) took 7 s for one 7B MLP matrix on one CPU core, and a shared pass snapshots every
    variant's codes; on a GPU packing first also halves the copy to the host."""
    if codes.shape[-1] % 2 or int(codes.max()) > 15:
        return {"raw": codes.cpu()}
    return {"u4": (codes[:, 0::2] | (codes[:, 1::2] << 4)).cpu()}  # [out, in / 2]


def _from_nibbles(d: dict) -> torch.Tensor:
    if "raw" in d:
        return d["raw"]
    u4 = d["u4"]
    return torch.stack([u4 & 15, u4 >> 4], dim=-1).reshape(u4.shape[0], -1)  # [out, in]


def feature_names(arch: Arch) -> list[str]:
    """The linears whose inputs AWQ needs (one per group of linears sharing an input), in execution order;
    for a MoE block, the router's input (every token: each expert's rows are selected from it)."""
    names = sorted(set(feature_of(arch).values()), key=arch.linears.index)
    return names + ([arch.experts.router] if arch.experts else [])

"""Layer-by-layer calibration loop. Knows decoder layers and linears; knows nothing about AWQ or GPTQ.

The model stays on the CPU. Only the embeddings (to make the first layer's inputs) and then one decoder
layer at a time move to the compute device, so a model far larger than the accelerator's memory only
needs one layer plus the calibration activations there.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn as nn
from .arch import Arch, decoder_layers, get_module

log = logging.getLogger(__name__)


class _Stop(Exception):
    pass


@dataclass
class LayerData:
    """What an algorithm gets for one decoder layer."""

    index: int
    layer: nn.Module  # on the compute device, in the compute dtype
    inputs: list[torch.Tensor]  # per batch: [b, seq, hidden], the layer's inputs
    kwargs: list[dict]  # per batch: keyword arguments the layer is called with (positions, mask)
    features: dict[str, torch.Tensor] = field(default_factory=dict)  # linear name -> its input [tokens, in]


def _to(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple):
        return tuple(_to(o, device) for o in obj)
    if isinstance(obj, list):
        return [_to(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj


def first_layer_inputs(
    model: nn.Module, arch: Arch, samples: torch.Tensor, device: torch.device, dtype: torch.dtype, batch_size: int
) -> tuple[list[torch.Tensor], list[dict]]:
    """samples: [n, seq] token ids -> per batch: layer-0 inputs [b, seq, hidden] and layer kwargs, on device."""
    layers = decoder_layers(model, arch)
    captured: list[tuple[torch.Tensor, dict]] = []

    def hook(_module, args, kwargs):
        hidden = args[0] if args else kwargs.pop("hidden_states")
        kwargs = {k: v for k, v in kwargs.items() if k not in ("past_key_values", "past_key_value", "use_cache")}
        captured.append((hidden, kwargs))
        raise _Stop

    moved = [get_module(model, arch.embed)] + ([get_module(model, arch.rotary)] if arch.rotary else [])
    for m in moved:
        m.to(device, dtype)
    handle = layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    base = model.get_submodule(arch.layers.rsplit(".", 1)[0])  # the decoder stack (e.g. model.model)
    try:
        with torch.no_grad():
            for start in range(0, samples.shape[0], batch_size):
                try:
                    base(input_ids=samples[start : start + batch_size].to(device), use_cache=False)
                except _Stop:
                    pass
    finally:
        handle.remove()
        for m in moved:
            m.to("cpu")
    return [h for h, _ in captured], [kw for _, kw in captured]


def layer_forward(layer: nn.Module, inputs: list[torch.Tensor], kwargs: list[dict]) -> list[torch.Tensor]:
    """Run one decoder layer over every batch -> outputs per batch [b, seq, hidden]."""
    outs = []
    with torch.no_grad():
        for x, kw in zip(inputs, kwargs):
            y = layer(x, **kw)
            outs.append(y[0] if isinstance(y, tuple) else y)
    return outs


def forward_with_features(
    layer: nn.Module, inputs: list[torch.Tensor], kwargs: list[dict], names: list[str]
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Layer outputs per batch, and the inputs each named linear saw: name -> [tokens, in]."""
    parts: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    handles = []
    for n in names:
        def hook(_m, args, _out, n=n):
            parts[n].append(args[0].reshape(-1, args[0].shape[-1]))  # [b * seq, in]
        handles.append(layer.get_submodule(n).register_forward_hook(hook))
    try:
        outs = layer_forward(layer, inputs, kwargs)
    finally:
        for h in handles:
            h.remove()
    return outs, {n: torch.cat(p, dim=0) for n, p in parts.items()}


class LayerJob(Protocol):
    """One recipe's work in a shared layer-by-layer pass (see `run_shared`).

    propagate: "fp" - this layer's inputs are the FP model's (shared by every such job);
    "quantized" - the outputs of the previous layer as this job left it (a private chain);
    "none" - needs no calibration inputs at all (round-to-nearest).
    """

    propagate: str
    wants_features: bool
    seconds: float

    def process(self, data: LayerData) -> None: ...

    def keep(self, index: int, layer: nn.Module) -> None: ...


def run_shared(
    model: nn.Module,
    arch: Arch,
    samples: torch.Tensor | None,
    device: torch.device,
    compute_dtype: torch.dtype,
    batch_size: int,
    feature_names: list[str],
    jobs: Sequence[LayerJob],
) -> None:
    """One pass over the decoder layers serving several jobs (recipes) that share a model and calibration.

    Each layer moves to `device` once. The FP forward (layer outputs and linear inputs) is computed once for
    every job that propagates "fp"; a job with a private chain gets its own inputs. With one job the layer is
    processed in place; with several, each job works on its own copy, so every job sees the unmodified layer
    and computes exactly what it would compute alone. `job.keep(i, layer)` receives the layer as the job left it.
    """
    needs_inputs = any(j.propagate != "none" for j in jobs)
    inputs, kwargs = ([], [])
    if needs_inputs:
        inputs, kwargs = first_layer_inputs(model, arch, samples, device, compute_dtype, batch_size)
    chains = {id(j): inputs for j in jobs if j.propagate == "quantized"}
    layers = decoder_layers(model, arch)
    start = time.perf_counter()
    for i, layer in enumerate(layers):
        t0 = time.perf_counter()
        storage_dtype = next(layer.parameters()).dtype
        layer.to(device, compute_dtype)
        fp_jobs = [j for j in jobs if j.propagate == "fp"]
        fp_outs, fp_feats = None, {}
        if fp_jobs:
            names = feature_names if any(j.wants_features for j in fp_jobs) else []
            fp_outs, fp_feats = forward_with_features(layer, inputs, kwargs, names)
        for n, job in enumerate(jobs):
            tj = time.perf_counter()
            own = chains.get(id(job), inputs)
            feats: dict[str, torch.Tensor] = {}
            if job.wants_features and job.propagate == "fp":
                last_user = all(not (j.wants_features and j.propagate == "fp") for j in jobs[n + 1 :])
                feats = fp_feats if last_user else {k: t.clone() for k, t in fp_feats.items()}
            elif job.wants_features:
                _, feats = forward_with_features(layer, own, kwargs, feature_names)
            work = layer if len(jobs) == 1 else copy.deepcopy(layer)
            job.process(LayerData(i, work, own, kwargs, feats))
            del feats
            if job.propagate == "quantized":
                chains[id(job)] = layer_forward(work, own, kwargs)
            job.keep(i, work)
            del work
            job.seconds += time.perf_counter() - tj
        del fp_feats
        layer.to("cpu", storage_dtype)
        if fp_outs is not None:
            inputs = fp_outs
        done, total = i + 1, len(layers)
        eta = (time.perf_counter() - start) / done * (total - done)
        log.info("layer %d/%d done in %.1f s (eta %.0f s)", done, total, time.perf_counter() - t0, eta)
        if device.type == "cuda":
            torch.cuda.empty_cache()

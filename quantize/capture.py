"""Layer-by-layer calibration loop. Knows decoder layers and linears; knows nothing about AWQ or GPTQ.

The model stays on the CPU. Only the embeddings (to make the first layer's inputs) and then one decoder
layer at a time move to the compute device, so a model far larger than the accelerator's memory only
needs one layer plus the calibration activations there.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

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


def run_layerwise(
    model: nn.Module,
    arch: Arch,
    samples: torch.Tensor,
    device: torch.device,
    compute_dtype: torch.dtype,
    batch_size: int,
    feature_names: Callable[[nn.Module], list[str]],
    process: Callable[[LayerData], None],
    propagate: str = "fp",
) -> None:
    """For each decoder layer: move it to `device`, capture features, call `process`, move it back.

    propagate="fp": the next layer sees this layer's outputs from before `process` changed it (AutoAWQ);
    "quantized": it sees the outputs of the layer as `process` left it (GPTQ's sequential convention).
    """
    inputs, kwargs = first_layer_inputs(model, arch, samples, device, compute_dtype, batch_size)
    layers = decoder_layers(model, arch)
    start = time.perf_counter()
    for i in range(len(layers)):
        t0 = time.perf_counter()
        layer = layers[i]
        storage_dtype = next(layer.parameters()).dtype
        layer.to(device, compute_dtype)
        names = feature_names(layer)
        outs, feats = None, {}
        if names or propagate == "fp":
            outs, feats = forward_with_features(layer, inputs, kwargs, names)
        process(LayerData(i, layer, inputs, kwargs, feats))
        del feats
        if propagate == "quantized":
            outs = layer_forward(layer, inputs, kwargs)
        layer.to("cpu", storage_dtype)
        inputs = outs
        done, total = i + 1, len(layers)
        eta = (time.perf_counter() - start) / done * (total - done)
        log.info("layer %d/%d done in %.1f s (eta %.0f s)", done, total, time.perf_counter() - t0, eta)
        if device.type == "cuda":
            torch.cuda.empty_cache()

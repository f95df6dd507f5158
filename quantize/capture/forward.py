"""Running decoder layers for the capture loop, and catching what their parts see.

`first_layer_inputs` runs the model's stack up to its decoder layers, with recorders standing in for them, to get
the first layer's inputs and the keyword arguments every layer is called with; `layer_forward`,
`forward_with_features` and `feed_inputs` run one decoder layer over the calibration batches, the last two with
hooks that hand on the inputs each named linear sees. Nothing here knows an algorithm or which layer comes next:
the pass (`loop.run_shared`) decides what runs where.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from ..source.arch import Arch, decoder_layers, get_module
from . import hostpages
from .device import device_copy


class _Stop(Exception):
    pass


class _Recorder(nn.Module):
    """Stands in for decoder layer `index` while layer inputs are captured: records what the decoder stack
    hands that layer (the hidden states for layer 0, the keyword arguments for every layer) and passes the
    hidden states on unchanged; the last one stops the forward."""

    DROP = ("past_key_values", "past_key_value", "use_cache")

    def __init__(self, index: int, last: bool, sink: list):
        super().__init__()
        self.index, self.last, self.sink = index, last, sink

    def forward(self, *args, **kwargs):
        hidden = args[0] if args else kwargs.pop("hidden_states")
        self.sink.append((self.index, hidden, {k: v for k, v in kwargs.items() if k not in self.DROP}))
        if self.last:
            raise _Stop
        return hidden


def first_layer_inputs(
    model: nn.Module, arch: Arch, samples: torch.Tensor, device: torch.device, dtype: torch.dtype, batch_size: int
) -> tuple[list[torch.Tensor], list[list[dict]]]:
    """samples: [n, seq] token ids -> per batch the layer-0 inputs [b, seq, hidden], and per layer, per batch
    the keyword arguments the stack calls that layer with (positions, mask), on device.

    Layers may differ in those (Gemma 3 alternates sliding-window and global attention, each with its own
    rotary table): each layer gets its own. Where the stack hands several layers the same tensors (Llama),
    they stay one object, so this costs no memory per layer.
    """
    layers = decoder_layers(model, arch)
    captured: list[tuple[int, torch.Tensor, dict]] = []

    # Device copies are swapped in and the CPU originals put back: nothing is copied back to the host (moving a
    # 7B model's 1.1 GB embedding back to pageable memory cost ~1 s on an H200 host). The rotary module keeps
    # its buffers' dtype (float32 inv_freq, as the model computes and serves its positions). The decoder layers
    # are replaced by recorders for the same time: no layer computes anything here.
    swapped = [(arch.embed, device_copy(get_module(model, arch.embed), device, dtype))]
    if arch.rotary:
        swapped.append((arch.rotary, device_copy(get_module(model, arch.rotary), device, None)))
    swapped += [(f"{arch.layers}.{i}", _Recorder(i, i == len(layers) - 1, captured)) for i in range(len(layers))]
    originals = [(path, _swap(model, path, copy_)) for path, copy_ in swapped]
    base = model.get_submodule(arch.layers.rsplit(".", 1)[0])  # the decoder stack (e.g. model.model)
    try:
        with torch.no_grad():
            for start in range(0, samples.shape[0], batch_size):
                try:
                    base(input_ids=samples[start : start + batch_size].to(device), use_cache=False)
                except _Stop:
                    pass
    finally:
        for path, original in reversed(originals):
            _swap(model, path, original)
        hostpages.release_module(get_module(model, arch.embed), swapped[0][1])  # read again only by export
    inputs = [h for i, h, _ in captured if i == 0]
    per_layer = [[kw for i, _, kw in captured if i == j] for j in range(len(layers))]
    return inputs, per_layer


def _swap(model: nn.Module, path: str, module: nn.Module) -> nn.Module:
    """Put `module` at dotted `path` in model -> the module that was there."""
    parent, _, leaf = path.rpartition(".")
    owner = get_module(model, parent)
    old = getattr(owner, leaf)
    setattr(owner, leaf, module)
    return old


def layer_forward(layer: nn.Module, inputs: list[torch.Tensor], kwargs: list[dict]) -> list[torch.Tensor]:
    """Run one decoder layer over every batch -> outputs per batch [b, seq, hidden]."""
    outs = []
    with torch.no_grad():
        for x, kw in zip(inputs, kwargs):
            y = layer(x, **kw)
            outs.append(y[0] if isinstance(y, tuple) else y)
    return outs


def feed_inputs(layer: nn.Module, inputs: list[torch.Tensor], kwargs: list[dict], names: list[str],
                on_input: Callable[[str, torch.Tensor], None]) -> None:
    """Run the layer over every batch just far enough to hand each named linear's input to on_input(name, x).

    names: in execution order; each batch's forward stops before the last of them computes anything, so
    the rest of the layer (for GPTQ's early stages: the attention or the whole MLP) is never run.
    """
    last = names[-1]

    def hook(module, args, name):
        on_input(name, args[0])
        if name == last:
            raise _Stop

    handles = [layer.get_submodule(n).register_forward_pre_hook(lambda m, a, n=n: hook(m, a, n)) for n in names]
    try:
        with torch.no_grad():
            for x, kw in zip(inputs, kwargs):
                try:
                    layer(x, **kw)
                except _Stop:
                    pass
    finally:
        for h in handles:
            h.remove()


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

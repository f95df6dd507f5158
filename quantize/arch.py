"""Architecture knowledge as data: the ONLY model-aware file.

Each supported `config.architectures[0]` maps to a table that names the decoder-layer list, the linears
inside a decoder layer, the AWQ scaling groups (which op feeds which linears, and which module's output
the search measures), and the linears vLLM fuses (they must be converted all-or-none).
Adding a model = one entry here + a tiny-config test.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch.nn as nn


@dataclass(frozen=True)
class ScaleGroup:
    """AWQ scaling group: `prev` feeds `linears`; the search loss is measured on `inspect`'s output."""

    prev: str  # a norm or a linear inside the decoder layer
    linears: tuple[str, ...]
    inspect: str  # module whose output the loss is measured on ("" = the single linear itself)
    inspect_takes_layer_kwargs: bool = False  # attention needs position embeddings / mask
    only_if_square: bool = False  # v_proj -> o_proj only when shapes allow (not with grouped-query attention)


@dataclass(frozen=True)
class Arch:
    """Where things are in one family of decoder-only models."""

    layers: str  # dotted path of the ModuleList of decoder layers
    embed: str
    rotary: str | None
    linears: tuple[str, ...]  # quantizable linears of one decoder layer, in execution order
    scale_groups: tuple[ScaleGroup, ...]
    fused: tuple[tuple[str, ...], ...]  # linears vLLM loads as one (convert all or none)
    no_clip: tuple[str, ...]  # AWQ skips clipping these (their outputs go through softmax)
    sequential: tuple[tuple[str, ...], ...]  # GPTQ true-sequential stages, in execution order
    row_parallel: tuple[str, ...]  # linears whose *input* dimension tensor parallelism splits
    norm_offset: float = 0.0  # the norms compute x̂ · (offset + weight): Gemma's RMSNorm stores weight - 1


_LLAMA_LIKE = Arch(
    layers="model.layers",
    embed="model.embed_tokens",
    rotary="model.rotary_emb",
    linears=(
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    ),
    scale_groups=(
        ScaleGroup(
            prev="input_layernorm",
            linears=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            inspect="self_attn",
            inspect_takes_layer_kwargs=True,
        ),
        ScaleGroup(prev="self_attn.v_proj", linears=("self_attn.o_proj",), inspect="", only_if_square=True),
        ScaleGroup(prev="post_attention_layernorm", linears=("mlp.gate_proj", "mlp.up_proj"), inspect="mlp"),
        ScaleGroup(prev="mlp.up_proj", linears=("mlp.down_proj",), inspect=""),
    ),
    fused=(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")),
    no_clip=("self_attn.q_proj", "self_attn.k_proj"),
    sequential=(
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        ("self_attn.o_proj",),
        ("mlp.gate_proj", "mlp.up_proj"),
        ("mlp.down_proj",),
    ),
    row_parallel=("self_attn.o_proj", "mlp.down_proj"),
)

# Gemma 3 (text): the same linears; the MLP reads `pre_feedforward_layernorm` (`post_attention_layernorm` norms
# the attention's output before the residual add), its norms scale by (1 + weight), and q_norm/k_norm follow
# q_proj/k_proj as in Qwen3. Sliding-window and global layers get their own masks and rotary tables from the
# stack (capture.first_layer_inputs keeps each layer's).
_GEMMA3 = replace(
    _LLAMA_LIKE,
    scale_groups=tuple(replace(g, prev="pre_feedforward_layernorm") if g.prev == "post_attention_layernorm" else g
                       for g in _LLAMA_LIKE.scale_groups),
    norm_offset=1.0,
)

# Qwen3 adds q_norm/k_norm after q_proj/k_proj (per head): AWQ's input-side scaling is unaffected.
ARCHITECTURES: dict[str, Arch] = {
    "LlamaForCausalLM": _LLAMA_LIKE,
    "MistralForCausalLM": _LLAMA_LIKE,
    "Qwen2ForCausalLM": _LLAMA_LIKE,
    "Qwen3ForCausalLM": _LLAMA_LIKE,
    "Gemma3ForCausalLM": _GEMMA3,
}


# GGUF `general.architecture` -> the transformers architecture it converts to (read before converting anything).
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",  # the text model: transformers converts a gemma3 GGUF to Gemma3ForCausalLM
}


class UnsupportedArchitecture(ValueError):
    pass


def check_gguf_architecture(name: str, where: str) -> str:
    """A GGUF header's `general.architecture` -> the transformers architecture; unknown ones are refused."""
    if name not in GGUF_ARCHITECTURES:
        raise UnsupportedArchitecture(
            f"{where}: GGUF architecture {name[:80]!r} (general.architecture) is not supported; supported: "
            f"{', '.join(sorted(GGUF_ARCHITECTURES))}")
    return GGUF_ARCHITECTURES[name]


def arch_for(config) -> Arch:
    """config.architectures -> table; an unknown architecture is an error naming the supported ones."""
    names = list(getattr(config, "architectures", None) or [])
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    raise UnsupportedArchitecture(
        f"architecture {names or '(none in config.json)'} is not supported; "
        f"supported: {', '.join(sorted(ARCHITECTURES))}"
    )


def get_module(root: nn.Module, dotted: str) -> nn.Module:
    return root.get_submodule(dotted) if dotted else root


def decoder_layers(model: nn.Module, arch: Arch) -> nn.ModuleList:
    return get_module(model, arch.layers)


def layer_prefix(arch: Arch, index: int) -> str:
    """Checkpoint name prefix of decoder layer `index`: 'model.layers.3'."""
    return f"{arch.layers}.{index}"


def active_scale_groups(layer: nn.Module, arch: Arch) -> list[ScaleGroup]:
    """The scale groups that apply to this layer (drops v->o under grouped-query attention)."""
    groups = []
    for g in arch.scale_groups:
        if g.only_if_square:
            prev = get_module(layer, g.prev)
            nxt = get_module(layer, g.linears[0])
            if prev.weight.shape != nxt.weight.shape:
                continue
        groups.append(g)
    return groups

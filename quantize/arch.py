"""Architecture knowledge as data: the ONLY model-aware file.

Each supported `config.architectures[0]` maps to a table that names the decoder-layer list, the linears
inside a decoder layer, the AWQ scaling groups (which op feeds which linears, and which module's output
the search measures), and the linears vLLM fuses (they must be converted all-or-none).
Adding a model = one entry here + a tiny-config test.

What differs between families, as fields: the norm kind (`norm_offset`: x̂·w or x̂·(1 + w)); which norm feeds
which linears (`ScaleGroup.prev`; "" where nothing foldable precedes them, as in OLMo 2, whose norms sit after
the attention and the MLP); fused projections whose output rows are equal slices (`ScaleGroup.prev_parts`: Phi-3's
gate_up_proj feeds down_proj from its `up` half only); the attention implementation calibration and our reader
run (`attn_implementation`: Gemma 2's softcapping exists only in transformers' eager attention); modules that are
never converted (`unquantized`). Per-layer inputs (masks, rotary tables, sliding windows) need no field: the
capture loop records what the stack hands each layer (capture.first_layer_inputs).
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
    # prev's output rows are this many equal slices (a fused projection) and `linears` read the last one: 1/s
    # folds into those rows only (Phi-3: gate_up_proj -> down_proj reads `up`, qkv_proj -> o_proj reads `v`)
    prev_parts: int = 1


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
    attn_implementation: str = "sdpa"  # transformers' attention for calibration and for reading artifacts back
    unquantized: tuple[str, ...] = ()  # modules of a decoder layer never converted (kept 16-bit whatever the recipe)
    serve_dtypes: tuple[str, ...] = ("float16", "bfloat16")  # the 16-bit dtypes vLLM serves the model in


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
    serve_dtypes=("bfloat16",),  # vLLM refuses Gemma in float16 (its activations overflow there)
)

# Gemma 2: Gemma 3's layout without q_norm/k_norm; its attention logits are soft-capped, which transformers
# computes only in its eager attention (sdpa would calibrate, and read back, a different function than vLLM serves).
_GEMMA2 = replace(_GEMMA3, attn_implementation="eager")

# Phi-3 (and Phi-4-mini): q/k/v and gate/up are single fused linears, read by vLLM under these names. The v slice
# of qkv_proj feeds o_proj only with as many key/value heads as query heads (equal slices); otherwise the group
# is dropped, as v -> o is for grouped-query attention in Llama.
_PHI3 = Arch(
    layers="model.layers",
    embed="model.embed_tokens",
    rotary="model.rotary_emb",
    linears=("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"),
    scale_groups=(
        ScaleGroup(prev="input_layernorm", linears=("self_attn.qkv_proj",), inspect="self_attn",
                   inspect_takes_layer_kwargs=True),
        ScaleGroup(prev="self_attn.qkv_proj", linears=("self_attn.o_proj",), inspect="", prev_parts=3),
        ScaleGroup(prev="post_attention_layernorm", linears=("mlp.gate_up_proj",), inspect="mlp"),
        ScaleGroup(prev="mlp.gate_up_proj", linears=("mlp.down_proj",), inspect="", prev_parts=2),
    ),
    fused=(),  # already one module each
    no_clip=("self_attn.qkv_proj",),
    sequential=(("self_attn.qkv_proj",), ("self_attn.o_proj",), ("mlp.gate_up_proj",), ("mlp.down_proj",)),
    row_parallel=("self_attn.o_proj", "mlp.down_proj"),
)

# OLMo 2: no norm before the attention or the MLP (post_attention_layernorm and post_feedforward_layernorm norm
# their outputs before the residual add), so the residual stream itself feeds q/k/v and gate/up: nothing can take
# 1/s, and those groups only say which linears share an input. q_norm/k_norm run over the whole q/k projection;
# v and up feed o_proj and down_proj directly, so those two groups stay.
_OLMO2 = replace(
    _LLAMA_LIKE,
    scale_groups=tuple(replace(g, prev="") if g.prev.endswith("layernorm") else g for g in _LLAMA_LIKE.scale_groups),
)

# Qwen3 adds q_norm/k_norm after q_proj/k_proj (per head): AWQ's input-side scaling is unaffected.
# Granite is Llama with constant multipliers (embedding, residual, attention, logits): none sits between a
# scaled linear and what feeds it.
ARCHITECTURES: dict[str, Arch] = {
    "LlamaForCausalLM": _LLAMA_LIKE,
    "MistralForCausalLM": _LLAMA_LIKE,
    "Qwen2ForCausalLM": _LLAMA_LIKE,
    "Qwen3ForCausalLM": _LLAMA_LIKE,
    "Gemma3ForCausalLM": _GEMMA3,
    "Gemma2ForCausalLM": _GEMMA2,
    "Phi3ForCausalLM": _PHI3,
    "GraniteForCausalLM": _LLAMA_LIKE,
    "Olmo2ForCausalLM": _OLMO2,
}


# GGUF `general.architecture` -> the transformers architecture it converts to (read before converting anything).
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",  # the text model: transformers converts a gemma3 GGUF to Gemma3ForCausalLM
    "gemma2": "Gemma2ForCausalLM",
    "phi3": "Phi3ForCausalLM",
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
    """The scale groups whose scales can be folded in this layer: drops groups with no `prev` and v->o under
    grouped-query attention (the v slice is not the rows o_proj reads)."""
    groups = []
    for g in arch.scale_groups:
        if not g.prev:
            continue
        prev, nxt = get_module(layer, g.prev), get_module(layer, g.linears[0])
        if g.only_if_square and prev.weight.shape != nxt.weight.shape:
            continue
        if isinstance(prev, nn.Linear) and prev.out_features != g.prev_parts * nxt.in_features:
            continue
        groups.append(g)
    return groups


def attn_implementation(config) -> str:
    """The attention implementation transformers should run this config's model with (sdpa where unknown)."""
    names = list(getattr(config, "architectures", None) or [])
    return next((ARCHITECTURES[n].attn_implementation for n in names if n in ARCHITECTURES), "sdpa")

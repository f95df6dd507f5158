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
capture loop records what the stack hands each layer (capture.forward.first_layer_inputs).

A config's linears and their sizes, read through an entry: `linears.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ..errors import UserError

if TYPE_CHECKING:  # torch takes seconds to import: pre-flight's refusals from config.json alone need none of it
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
    experts: "Experts | None" = None  # the MLP is a sparse mixture of experts (see `Experts`)
    # (linear, in, out) of each linear in `linears`, as the sizes `linears.config_sizes` names: read from config.json
    # alone (pre-flight's kernel checks need no model); tests/unit/test_arch_shapes.py holds them to transformers'
    shapes: tuple[tuple[str, str, str], ...] = ()
    head_dim_default: int | None = None  # head_dim where config.json omits it (None: hidden_size / heads)


@dataclass(frozen=True)
class Experts:
    """A sparse mixture-of-experts MLP: where its parts live inside a decoder layer and what stays 16-bit.

    transformers 5 stores the routed experts fused (`gate_up` [E, 2I, H], gate rows first, and `down` [E, H, I]
    parameters of one module); vLLM reads one linear per expert. `experts.split_experts` replaces the fused
    module by one linear per expert named `<module>.<e>.<gate|up|down>_proj`, which the pass calibrates and the
    export writes (renamed by `renames` where the checkpoint vLLM reads names them otherwise).
    The router (and a shared expert's gate) read the norm's output too: AWQ scales them with the experts but
    they are never converted (vLLM keeps them 16-bit).
    """

    block: str  # the sparse MoE block ("mlp"); its output is what the norm group's AWQ search measures
    module: str  # the fused experts module ("mlp.experts")
    router: str  # the router (weight [E, H]); called on [tokens, H], returns (logits, weights, indices)
    norm: str  # the norm whose output feeds the router, the experts and a shared expert
    count_key: str  # config key holding the number of routed experts
    count_aliases: tuple[str, ...] = ()  # config.json keys transformers maps onto count_key (its attribute_map)
    top_k_key: str = "num_experts_per_tok"
    intermediate_key: str = "moe_intermediate_size"  # config key of one routed expert's intermediate size
    shared_intermediate_key: str | None = None  # config key of the shared expert's intermediate size
    shared: str | None = None  # a dense MLP every token goes through (Qwen2-MoE's shared_expert)
    shared_gate: str | None = None  # its sigmoid gate, a [1, H] linear (kept 16-bit)
    renames: tuple[tuple[str, str], ...] = ()  # (module-name part, checkpoint-name part) at export

    @property
    def linears(self) -> tuple[str, ...]:
        """One expert's linears relative to the expert, in execution order."""
        return ("gate_proj", "up_proj", "down_proj")

    def expert(self, e: int, linear: str = "") -> str:
        """'mlp.experts.3' or 'mlp.experts.3.gate_proj' (relative to the decoder layer)."""
        return f"{self.module}.{e}" + (f".{linear}" if linear else "")

    def shared_linears(self) -> tuple[str, ...]:
        return tuple(f"{self.shared}.{n}" for n in self.linears) if self.shared else ()

    def unconverted(self) -> tuple[str, ...]:
        """Modules the norm feeds that stay 16-bit (vLLM builds them unquantized)."""
        return (self.router,) + ((self.shared_gate,) if self.shared_gate else ())


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
    shapes=(
        ("self_attn.q_proj", "hidden", "q"),
        ("self_attn.k_proj", "hidden", "kv"),
        ("self_attn.v_proj", "hidden", "kv"),
        ("self_attn.o_proj", "q", "hidden"),
        ("mlp.gate_proj", "hidden", "mlp"),
        ("mlp.up_proj", "hidden", "mlp"),
        ("mlp.down_proj", "mlp", "hidden"),
    ),
)

# Gemma 3 (text): the same linears; the MLP reads `pre_feedforward_layernorm` (`post_attention_layernorm` norms
# the attention's output before the residual add), its norms scale by (1 + weight), and q_norm/k_norm follow
# q_proj/k_proj as in Qwen3. Sliding-window and global layers get their own masks and rotary tables from the
# stack (capture.forward.first_layer_inputs keeps each layer's).
_GEMMA3 = replace(
    _LLAMA_LIKE,
    scale_groups=tuple(replace(g, prev="pre_feedforward_layernorm") if g.prev == "post_attention_layernorm" else g
                       for g in _LLAMA_LIKE.scale_groups),
    norm_offset=1.0,
    serve_dtypes=("bfloat16",),  # vLLM refuses Gemma in float16 (its activations overflow there)
    head_dim_default=256,  # transformers' Gemma2Config / Gemma3TextConfig
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
    shapes=(("self_attn.qkv_proj", "hidden", "qkv"), ("self_attn.o_proj", "q", "hidden"),
            ("mlp.gate_up_proj", "hidden", "gate_up"), ("mlp.down_proj", "mlp", "hidden")),
)

# OLMo 2: no norm before the attention or the MLP (post_attention_layernorm and post_feedforward_layernorm norm
# their outputs before the residual add), so the residual stream itself feeds q/k/v and gate/up: nothing can take
# 1/s, and those groups only say which linears share an input. q_norm/k_norm run over the whole q/k projection;
# v and up feed o_proj and down_proj directly, so those two groups stay.
_OLMO2 = replace(
    _LLAMA_LIKE,
    scale_groups=tuple(replace(g, prev="") if g.prev.endswith("layernorm") else g for g in _LLAMA_LIKE.scale_groups),
)

# Mixture-of-experts models: the table lists the attention; the MLP is described by `Experts`. The checkpoints
# vLLM reads name Mixtral's experts `block_sparse_moe.experts.<e>.w1/w3/w2` (transformers 5 renames them on load).
_ATTENTION_ONLY = replace(
    _LLAMA_LIKE,
    linears=_LLAMA_LIKE.linears[:4],
    scale_groups=_LLAMA_LIKE.scale_groups[:2],
    fused=_LLAMA_LIKE.fused[:1],
    sequential=_LLAMA_LIKE.sequential[:2],
    row_parallel=("self_attn.o_proj",),
    shapes=_LLAMA_LIKE.shapes[:4],
)
_MIXTRAL = replace(_ATTENTION_ONLY, experts=Experts(
    block="mlp", module="mlp.experts", router="mlp.gate", norm="post_attention_layernorm",
    count_key="num_local_experts", count_aliases=("num_experts",), intermediate_key="intermediate_size",
    renames=((".mlp.", ".block_sparse_moe."), (".gate_proj.", ".w1."), (".up_proj.", ".w3."),
             (".down_proj.", ".w2."))))
_QWEN3_MOE = replace(_ATTENTION_ONLY, experts=Experts(  # Qwen3MoeConfig has no head_dim of its own (unlike Qwen3's)
    block="mlp", module="mlp.experts", router="mlp.gate", norm="post_attention_layernorm", count_key="num_experts",
    count_aliases=("num_local_experts",)))
_QWEN2_MOE = replace(_ATTENTION_ONLY, experts=replace(
    _QWEN3_MOE.experts, count_aliases=(), shared="mlp.shared_expert", shared_gate="mlp.shared_expert_gate",
    shared_intermediate_key="shared_expert_intermediate_size"))

# Qwen3 adds q_norm/k_norm after q_proj/k_proj (per head): AWQ's input-side scaling is unaffected.
# Granite is Llama with constant multipliers (embedding, residual, attention, logits): none sits between a
# scaled linear and what feeds it.
ARCHITECTURES: dict[str, Arch] = {
    "LlamaForCausalLM": _LLAMA_LIKE,
    "MistralForCausalLM": _LLAMA_LIKE,
    "Qwen2ForCausalLM": _LLAMA_LIKE,
    "Qwen3ForCausalLM": replace(_LLAMA_LIKE, head_dim_default=128),  # transformers' Qwen3Config
    "Gemma3ForCausalLM": _GEMMA3,
    "MixtralForCausalLM": _MIXTRAL,
    "Qwen2MoeForCausalLM": _QWEN2_MOE,
    "Qwen3MoeForCausalLM": _QWEN3_MOE,
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


class UnsupportedArchitecture(UserError, ValueError):
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
            arch = ARCHITECTURES[name]
            if arch.experts is not None:
                _check_every_layer_sparse(config, name)
            return arch
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
    import torch.nn as nn

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


def _check_every_layer_sparse(config, name: str) -> None:
    """Qwen-MoE configs may make some layers dense (mlp_only_layers, decoder_sparse_step): not supported yet."""
    dense = list(getattr(config, "mlp_only_layers", None) or [])
    step = getattr(config, "decoder_sparse_step", 1) or 1
    if dense or step != 1:
        raise UnsupportedArchitecture(
            f"{name}: a mix of dense and sparse layers (mlp_only_layers {dense}, decoder_sparse_step {step}) is "
            f"not supported; only models whose every layer is a mixture of experts are (quantize/source/arch.py)")


def checkpoint_name(arch: Arch, name: str) -> str:
    """A tensor's name in the model -> its name in the checkpoint vLLM reads (Mixtral's experts are renamed)."""
    if arch.experts is None or not arch.experts.renames or f".{arch.experts.block}." not in f".{name}":
        return name
    for ours, theirs in arch.experts.renames:
        name = name.replace(ours, theirs)
    return name


def attn_implementation(config) -> str:
    """The attention implementation transformers should run this config's model with (sdpa where unknown)."""
    names = list(getattr(config, "architectures", None) or [])
    return next((ARCHITECTURES[n].attn_implementation for n in names if n in ARCHITECTURES), "sdpa")

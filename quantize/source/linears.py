"""A decoder layer's quantizable linears and their sizes, read through its architecture table (`arch.py`).

Names: the table's `linears`, then a mixture of experts' shared and routed experts (one linear per expert, as
`experts.split_experts` makes them and vLLM reads them), in execution order: the linears pre-flight plans to
convert. Sizes: each linear's (in, out) from config.json's keys alone (no model is built,
no torch imported), which pre-flight's kernel checks and the Triton warm-up read before any weight loads.
"""

from __future__ import annotations

from .arch import Arch


def expert_count(arch: Arch, config) -> int:
    """Routed experts per layer (0 for a dense model); AttributeError when the config gives none."""
    if arch.experts is None:
        return 0
    x = arch.experts
    key = next((k for k in (x.count_key, *x.count_aliases) if getattr(config, k, None) is not None), x.count_key)
    return int(getattr(config, key))


def expert_linears(arch: Arch, config) -> list[str]:
    """Every linear of a decoder layer's MoE block (relative to the layer): the shared expert's, then each
    routed expert's gate/up/down; [] for a dense model."""
    if arch.experts is None:
        return []
    x = arch.experts
    return [*x.shared_linears(), *(x.expert(e, n) for e in range(expert_count(arch, config)) for n in x.linears)]


def all_linears(arch: Arch, config) -> list[str]:
    """Every quantizable linear of a decoder layer (relative to it), in execution order."""
    return [*arch.linears, *expert_linears(arch, config)]


def config_sizes(arch: Arch, config) -> dict[str, int]:
    """A config -> the sizes `Arch.shapes` names (hidden, q, kv, qkv, mlp, gate_up; expert, shared for experts).

    config: transformers' config, or config.json's keys as attributes (pre-flight reads it before importing
    torch); KeyError names a key config.json does not give (transformers' default is then unknown here).
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config

    def need(key: str) -> int:
        value = getattr(text, key, None)
        if value is None:
            raise KeyError(key)
        return int(value)

    hidden, heads, kv = need("hidden_size"), need("num_attention_heads"), need("num_key_value_heads")
    head_dim = getattr(text, "head_dim", None) or arch.head_dim_default or hidden // heads
    sizes = {"hidden": hidden, "q": heads * head_dim, "kv": kv * head_dim, "qkv": (heads + 2 * kv) * head_dim}
    if any(size in ("mlp", "gate_up") for _, i, o in arch.shapes for size in (i, o)):
        sizes |= {"mlp": need("intermediate_size"), "gate_up": 2 * need("intermediate_size")}
    if arch.experts is not None:
        sizes["expert"] = need(arch.experts.intermediate_key)
        if arch.experts.shared:
            sizes["shared"] = need(arch.experts.shared_intermediate_key)
    return sizes


def linear_shapes(arch: Arch, config) -> dict[str, tuple[int, int]]:
    """A config -> every quantizable linear of one decoder layer {local name: (in, out)}, routed experts included,
    from the table alone (no model is built); KeyError as in `config_sizes`."""
    sizes = config_sizes(arch, config)
    table = {n: (sizes[i], sizes[o]) for n, i, o in arch.shapes}
    if arch.experts is not None:
        x = arch.experts
        mlps = [(x.shared, "shared")] if x.shared else []
        for prefix, inter in mlps + [(x.expert(e), "expert") for e in range(expert_count(arch, config))]:
            table |= {f"{prefix}.gate_proj": (sizes["hidden"], sizes[inter]),
                      f"{prefix}.up_proj": (sizes["hidden"], sizes[inter]),
                      f"{prefix}.down_proj": (sizes[inter], sizes["hidden"])}
    missing = [n for n in all_linears(arch, config) if n not in table]
    assert not missing, f"quantize/source/arch.py: no shapes entry for {missing}"
    return {n: table[n] for n in all_linears(arch, config) if n not in arch.unquantized}

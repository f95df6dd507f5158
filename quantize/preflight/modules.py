"""What is asked of vLLM: the modules it builds for one decoder layer's converted linears (fused q/k/v, fused
gate/up, row- and column-parallel linears, the fused MoE block), from the model's config alone."""

from __future__ import annotations


def config_linears(config, arch) -> dict[str, tuple[int, int]]:
    """A model config -> one decoder layer's quantizable linears {local name: (in, out)}, from the architecture
    table's shapes (`linears.linear_shapes`: no model is built, no torch is imported)."""
    from ..source.linears import linear_shapes

    return linear_shapes(arch, config)


def vllm_modules(linears: dict[str, tuple[int, int]], arch, config) -> list[dict]:
    """One decoder layer's converted linears {local name: (in, out)} -> the modules vLLM builds for them.

    q/k/v -> one QKVParallelLinear, gate/up -> one MergedColumnParallelLinear (split or already fused), o and
    down -> RowParallelLinear, routed experts -> one fused MoE block; other linears are column-parallel.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    out, used = [], set()
    for fused in [*arch.fused, *((n,) for n in arch.linears)]:
        names = [n for n in fused if n in linears]
        if not names or used & set(names):
            continue
        used |= set(names)
        base = names[0].rsplit(".", 1)[0]
        tail = [n.rsplit(".", 1)[1] for n in names]
        in_f = linears[names[0]][0]
        if tail == ["q_proj", "k_proj", "v_proj"] or tail == ["qkv_proj"]:
            total = sum(linears[n][1] for n in names)
            head_dim = total // (heads + 2 * kv)
            out.append({"name": f"{base}.qkv_proj", "kind": "qkv", "hidden": in_f, "head_dim": head_dim,
                        "heads": heads, "kv_heads": kv})
        elif tail == ["gate_proj", "up_proj"] or tail == ["gate_up_proj"]:
            outs = [linears[n][1] for n in names] if len(names) == 2 else [linears[names[0]][1] // 2] * 2
            out.append({"name": f"{base}.gate_up_proj", "kind": "merged", "in": in_f, "outs": outs})
        else:
            kind = "row" if names[0] in arch.row_parallel else "column"
            out.append({"name": names[0], "kind": kind, "in": in_f, "out": linears[names[0]][1]})
    out += _expert_modules(linears, arch, config)
    return out


def _expert_modules(linears: dict[str, tuple[int, int]], arch, config) -> list[dict]:
    from ..source.linears import expert_count

    if arch.experts is None:
        return []
    x, mods = arch.experts, []
    if x.shared and f"{x.shared}.gate_proj" in linears:
        (i, o), (di, do) = linears[f"{x.shared}.gate_proj"], linears[f"{x.shared}.down_proj"]
        mods += [{"name": f"{x.shared}.gate_up_proj", "kind": "merged", "in": i, "outs": [o, o]},
                 {"name": f"{x.shared}.down_proj", "kind": "row", "in": di, "out": do}]
    gate = linears.get(x.expert(0, "gate_proj"))
    if gate is not None:
        mods.append({"name": x.module, "kind": "experts", "experts": expert_count(arch, config),
                     "top_k": int(getattr(config, x.top_k_key)), "hidden": gate[0], "intermediate": gate[1]})
    return mods


def recipe_modules(recipe, config, arch, is_skipped) -> list[dict]:
    """The vLLM modules a recipe converts, from the model's config alone (shapes of decoder layer 0)."""
    from ..source.arch import layer_prefix

    prefix = layer_prefix(arch, 0)
    linears = {n: s for n, s in config_linears(config, arch).items()
               if not is_skipped(f"{prefix}.{n}", recipe.modules_to_not_convert)}
    return vllm_modules(linears, arch, config)

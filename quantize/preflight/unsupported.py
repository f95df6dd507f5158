"""What the architecture table would need for a model it does not describe: pre-flight's message for an unsupported
architecture, read from the model's config and a meta-device instance rather than guessed."""

from __future__ import annotations

import torch
import torch.nn as nn

from ..source.arch import ARCHITECTURES

EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")  # how configs count experts per layer
FUSED_HINTS = ("qkv", "query_key_value", "gate_up", "w12", "w13")  # linear names that hold several projections


def table_lacks(config, trust_remote_code: bool = False) -> str:
    """What the architecture table (quantize/source/arch.py) would have to describe for this unsupported model, read
    from its config and a meta-device instance -> one line: experts, fused projections, linears no entry names,
    the norms (their kind, w or 1 + w, and which linears each feeds)."""
    from transformers import AutoModelForCausalLM

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    lacks = []
    experts = next((getattr(text, k) for k in EXPERT_KEYS if getattr(text, k, None)), None)
    if experts:
        lacks.append(f"experts ({experts} per layer: per-expert linears, shared experts, a router kept 16-bit)")
    try:
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - any failure to build means we cannot say more than this
        return "; ".join(lacks + [f"transformers cannot build it from config.json ({type(e).__name__})"])
    stacks = [m for m in meta.modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not stacks:
        return "; ".join(lacks + ["a list of decoder layers (none found)"])
    layer = max(stacks, key=len)[0]
    known = {n for a in ARCHITECTURES.values() for n in a.linears}
    linears = [n for n, m in layer.named_modules() if isinstance(m, nn.Linear) and "expert" not in n]
    fused = [n for n in linears if n not in known and any(h in n.rsplit(".", 1)[-1] for h in FUSED_HINTS)]
    other = [n for n in linears if n not in known and n not in fused]
    if fused:
        lacks.append(f"fused projections {fused} (which output slice feeds which linear: ScaleGroup.prev_parts)")
    if other:
        lacks.append(f"linears no entry names {other[:6]}")
    norms = {n: type(m).__name__ for n, m in layer.named_modules() if "norm" in type(m).__name__.lower()}
    kinds = sorted(set(norms.values()))
    lacks.append(f"the norm kind (x̂·w or x̂·(1 + w): norm_offset) of {', '.join(kinds) or 'its norms'} and which "
                 f"norm feeds which linears (ScaleGroup.prev) among {sorted(norms) or 'none'}")
    return "; ".join(lacks)

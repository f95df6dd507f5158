"""Fused experts -> one linear per expert, so the pass calibrates and the export writes what vLLM reads.

transformers 5 keeps a MoE layer's routed experts as two 3-D parameters of one module
(`gate_up_proj` [E, 2I, H], gate rows first; `down_proj` [E, H, I]). `split_experts` replaces that module by
an `ExpertList` of per-expert `nn.Linear`s computing the same function: the module names become vLLM's
per-expert names, each expert's linears see exactly the tokens the router sends to it (hooks on them
capture routed inputs), and the in-memory model computes what the artifact computes once their weights are
replaced by dequantized ones.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .arch import Arch, decoder_layers, get_module


class Expert(nn.Module):
    """One routed expert: down(act(gate(x)) · up(x))."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, act_fn: nn.Module):
        super().__init__()
        inter, hidden = gate.shape  # gate, up: [I, H]; down: [H, I]
        with torch.device(gate.device):
            self.gate_proj = nn.Linear(hidden, inter, bias=False, dtype=gate.dtype)
            self.up_proj = nn.Linear(hidden, inter, bias=False, dtype=gate.dtype)
            self.down_proj = nn.Linear(inter, hidden, bias=False, dtype=gate.dtype)
        self.gate_proj.weight = nn.Parameter(gate, requires_grad=False)
        self.up_proj.weight = nn.Parameter(up, requires_grad=False)
        self.down_proj.weight = nn.Parameter(down, requires_grad=False)
        self.act_fn = act_fn

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """x: [tokens, H] -> down_proj's input [tokens, I]."""
        return self.act_fn(self.gate_proj(x)) * self.up_proj(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.hidden(x))


class ExpertList(nn.ModuleList):
    """The routed experts, called as transformers calls its fused module: (hidden [T, H], top_k_index [T, k],
    top_k_weights [T, k]) -> [T, H], the weighted sum of each token's experts. Each expert runs on its own
    tokens only, in expert order."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for e, expert in enumerate(self):
            token, slot = torch.where(top_k_index == e)  # [n_e] each
            if token.numel() == 0:
                continue
            y = expert(hidden_states[token]) * top_k_weights[token, slot, None]  # [n_e, H]
            out.index_add_(0, token, y.to(out.dtype))
        return out


def routed_tokens(top_k_index: torch.Tensor, e: int) -> torch.Tensor:
    """top_k_index [T, k] -> the tokens routed to expert e [n_e], in token order."""
    return torch.where(top_k_index == e)[0]


def split_experts(model: nn.Module, arch: Arch) -> int:
    """Replace every decoder layer's fused experts module by an ExpertList (same function) -> layers changed.

    A model already split (or a dense one) is left as it is. The fused tensors' storage is reused (views), so
    this costs no memory.
    """
    if arch.experts is None:
        return 0
    changed = 0
    for layer in decoder_layers(model, arch):
        fused = get_module(layer, arch.experts.module)
        if isinstance(fused, ExpertList):
            continue
        gate_up, down = fused.gate_up_proj.data, fused.down_proj.data  # [E, 2I, H], [E, H, I]
        inter = gate_up.shape[1] // 2
        experts = ExpertList(Expert(gate_up[e, :inter], gate_up[e, inter:], down[e], fused.act_fn)
                             for e in range(gate_up.shape[0]))
        parent, _, leaf = arch.experts.module.rpartition(".")
        setattr(get_module(layer, parent), leaf, experts)
        changed += 1
    return changed

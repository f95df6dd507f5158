"""Fused transformers-5 experts split into per-expert linears: same function, vLLM's names."""

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from quantize.source.arch import arch_for, checkpoint_name, UnsupportedArchitecture
from quantize.source.linears import all_linears, expert_linears
from quantize.source.experts import ExpertList, split_experts
from tests.conftest import TINY


def _tiny(kind: str, **extra):
    cfg = getattr(transformers, TINY[kind]["cls"])(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, **{**TINY[kind]["extra"], "head_dim": 16, **extra})
    cfg.architectures = [TINY[kind]["cls"].replace("Config", "ForCausalLM")]
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_split_experts_computes_the_same_logits(kind):
    model = _tiny(kind)
    arch = arch_for(model.config)
    ids = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        before = model(ids).logits
        assert split_experts(model, arch) == 2
        after = model(ids).logits
    assert torch.allclose(before, after, atol=1e-5, rtol=0)
    assert isinstance(model.model.layers[0].mlp.experts, ExpertList)
    names = {n.removesuffix(".weight") for n, _ in model.named_parameters()}
    for local in all_linears(arch, model.config):
        assert f"model.layers.1.{local}" in names
    assert split_experts(model, arch) == 0  # already split


def test_expert_linears_and_checkpoint_names():
    qwen2 = _tiny("qwen2_moe")
    arch = arch_for(qwen2.config)
    lin = expert_linears(arch, qwen2.config)
    assert lin[:3] == ["mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj"]
    assert len(lin) == 3 + 4 * 3 and lin[-1] == "mlp.experts.3.down_proj"
    assert arch.experts.unconverted() == ("mlp.gate", "mlp.shared_expert_gate")
    assert checkpoint_name(arch, "model.layers.0.mlp.experts.1.gate_proj.qweight") == \
        "model.layers.0.mlp.experts.1.gate_proj.qweight"
    mixtral = arch_for(_tiny("mixtral").config)
    # vLLM's Mixtral reads the original checkpoint names
    assert checkpoint_name(mixtral, "model.layers.0.mlp.experts.1.up_proj.qweight") == \
        "model.layers.0.block_sparse_moe.experts.1.w3.qweight"
    assert checkpoint_name(mixtral, "model.layers.0.mlp.gate.weight") == "model.layers.0.block_sparse_moe.gate.weight"
    assert checkpoint_name(mixtral, "model.layers.0.self_attn.q_proj.qweight") == \
        "model.layers.0.self_attn.q_proj.qweight"


def test_mixed_dense_and_sparse_layers_are_refused():
    cfg = _tiny("qwen3_moe").config
    cfg.mlp_only_layers = [0]
    with pytest.raises(UnsupportedArchitecture, match="mlp_only_layers"):
        arch_for(cfg)

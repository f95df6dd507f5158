"""The architecture table's own consistency."""

import pytest
import torch
import torch.nn as nn

from quantize.source.arch import (ARCHITECTURES, GGUF_ARCHITECTURES, active_scale_groups, arch_for,
                           check_gguf_architecture, decoder_layers)


def test_every_gguf_architecture_converts_to_a_supported_one():
    # a GGUF whose architecture passes the header check must not be refused after its conversion
    assert set(GGUF_ARCHITECTURES.values()) <= set(ARCHITECTURES)
    assert check_gguf_architecture("gemma3", "x") == "Gemma3ForCausalLM"


# architecture -> (transformers config class, keys): tiny configs, built on the meta device (shapes only)
TINY = {
    "Gemma2ForCausalLM": ("Gemma2Config", dict(head_dim=32)),
    "Phi3ForCausalLM": ("Phi3Config", dict(pad_token_id=0)),
    "GraniteForCausalLM": ("GraniteConfig", dict(residual_multiplier=0.5)),
    "Olmo2ForCausalLM": ("Olmo2Config", dict(pad_token_id=0)),
}


def _layer(name: str, kv_heads: int = 2):
    import transformers

    cls, keys = TINY[name]
    cfg = getattr(transformers, cls)(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=kv_heads, **keys)
    cfg.architectures = [name]
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    arch = arch_for(cfg)
    return arch, decoder_layers(model, arch)[0]


@pytest.mark.parametrize("name", list(TINY))
def test_entry_names_every_linear_and_feeder(name):
    """The table's linears are exactly the layer's nn.Linear modules; every scale group's prev exists."""
    arch, layer = _layer(name)
    linears = {n for n, m in layer.named_modules() if isinstance(m, nn.Linear)}
    assert linears == set(arch.linears) | set(arch.unquantized)
    for g in arch.scale_groups:
        if g.prev:
            layer.get_submodule(g.prev)


def test_fused_slices_fold_only_where_the_slices_are_equal():
    """Phi-3's qkv_proj -> o_proj folds into the v slice with as many key/value heads as query heads, and is
    dropped under grouped-query attention; gate_up_proj -> down_proj always folds into the up half."""
    arch, mha = _layer("Phi3ForCausalLM", kv_heads=2)
    assert [g.prev for g in active_scale_groups(mha, arch)] == [
        "input_layernorm", "self_attn.qkv_proj", "post_attention_layernorm", "mlp.gate_up_proj"]
    arch, gqa = _layer("Phi3ForCausalLM", kv_heads=1)
    assert "self_attn.qkv_proj" not in [g.prev for g in active_scale_groups(gqa, arch)]


def test_olmo2_scales_only_what_a_linear_feeds():
    """OLMo 2 has no norm before attention or MLP: only v -> o and up -> down fold; q/k/v and gate/up still
    share one captured input each."""
    from quantize.methods.job import feature_names

    arch, layer = _layer("Olmo2ForCausalLM")
    assert [g.prev for g in active_scale_groups(layer, arch)] == ["self_attn.v_proj", "mlp.up_proj"]
    assert feature_names(arch) == ["self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"]


def test_gemma_entries_fold_into_one_plus_w_and_serve_in_bfloat16():
    for name in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        arch = ARCHITECTURES[name]
        assert arch.norm_offset == 1.0 and arch.serve_dtypes == ("bfloat16",)
        assert "post_attention_layernorm" not in {g.prev for g in arch.scale_groups}  # it norms the output
    assert ARCHITECTURES["Gemma2ForCausalLM"].attn_implementation == "eager"  # softcapping is eager-only


def test_gguf_names_of_the_dense_entries():
    assert check_gguf_architecture("gemma2", "x") == "Gemma2ForCausalLM"
    assert check_gguf_architecture("phi3", "x") == "Phi3ForCausalLM"


def test_unquantized_linears_stay_16bit_in_the_plan():
    """A linear the table marks unquantized is never converted and the plan says why."""
    from dataclasses import replace

    import transformers

    from quantize.formats import is_skipped
    from quantize.preflight.checks import plan
    from quantize.recipe import load_recipe

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2)
    cfg.architectures = ["LlamaForCausalLM"]
    arch = replace(arch_for(cfg), unquantized=("mlp.down_proj",))
    p = plan(cfg, arch, load_recipe("smollm2-awq-g64"), is_skipped)
    assert "model.layers.0.mlp.down_proj" not in p.convert and len(p.convert) == 6
    assert "quantize/source/arch.py: unquantized" in p.skipped["model.layers.0.mlp.down_proj"]

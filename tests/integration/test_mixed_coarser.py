"""A mix below the base size's bits on a tiny Llama: GPTQ with every linear first per channel, g64 and g32 where
they lower the output error most; one compressed-tensors artifact with a per-channel config group, within the
budget, decoded by our loader as one grid per row, and served by vLLM's CPU build as we decode it."""

import json

import pytest
import torch
from safetensors.torch import load_file

from eval.artifact import load_dequantized
from pipeline.compare import row, sizes
from quantize import runner
from tests.conftest import tiny_recipe
from tests.integration.test_mixed import assert_vllm_serves_as_we_decode

BUDGET = 4.2  # these shapes store 4.05 bits per weight per channel and 4.314 at g64: some linears must stay per channel


@pytest.fixture(scope="module")
def channel_mix(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mixed-channel")
    recipe = tiny_recipe(tmp, tiny_llama, name="tiny-gptq-mixed-channel", method="gptq", format="compressed-tensors",
                         mixed=dict(base_group=64, budget_bits_per_weight=BUDGET, finer=[32], coarser=[-1]))
    return runner.run(recipe, out_root=tmp / "a")


def test_the_budget_below_g64_keeps_some_linears_per_channel_and_buys_finer_sizes(channel_mix):
    m = json.loads((channel_mix / "manifest.json").read_text())["mixed"]
    assert m["bits_per_weight_at"]["-1"] < m["bits_per_weight"] <= BUDGET < m["bits_per_weight_at"]["64"]
    assert m["bits_per_weight"] == pytest.approx(sizes(channel_mix, 4)["bits_per_weight"], abs=1e-6)
    assert m["linears"]["-1"] > 0 and m["linears"]["64"] + m["linears"]["32"] > 0, m["linears"]
    assert m["error_sum"]["chosen"] < m["error_sum"]["-1"]
    assert row(channel_mix)["group_size"].endswith("+channel")
    qcfg = json.loads((channel_mix / "config.json").read_text())["quantization_config"]
    by_size = {(g["weights"]["strategy"], g["weights"]["group_size"]): set(g["targets"])
               for g in qcfg["config_groups"].values()}
    assert ("channel", None) in by_size
    tensors = load_file(str(channel_mix / "model.safetensors"))
    for layer, per in m["groups"].items():
        for linear, g in per.items():
            name = f"model.layers.{layer}.{linear}"
            key = ("channel", None) if g == -1 else ("group", g)
            assert name in by_size[key]
            out_f, in_f = tensors[f"{name}.weight_shape"].tolist()
            assert tensors[f"{name}.weight_scale"].shape == (out_f, 1 if g == -1 else in_f // g)


def test_our_decoding_gives_each_linear_one_grid_per_group_of_its_size(channel_mix):
    """A per-channel row holds at most 16 distinct values (one scale and zero point); had it been decoded as
    groups, or a grouped linear as per channel, the decoded values would not match the scales' count."""
    m = json.loads((channel_mix / "manifest.json").read_text())["mixed"]
    model = load_dequantized(channel_mix, torch.float32)
    seen = set()
    for layer, per in m["groups"].items():
        for linear, g in per.items():
            w = model.get_submodule(f"model.layers.{layer}.{linear}").weight.data
            groups = w.reshape(w.shape[0], -1, w.shape[1] if g == -1 else g)  # [out, n_group, g]
            assert max(len(torch.unique(x)) for x in groups.reshape(-1, groups.shape[-1])) <= 16
            seen.add(g)
            if g == -1:  # the same row read as g32 groups would give each group its own, smaller range
                assert len(torch.unique(w[0])) > 8
    assert -1 in seen and seen & {64, 32}


@pytest.mark.vllm
def test_vllm_serves_the_channel_mix_as_we_decode_it(channel_mix):
    assert_vllm_serves_as_we_decode(channel_mix)

"""A budgeted mixed group size end to end on a tiny Llama: one artifact holding g64 and g32 linears, within the
budget as compare measures it from the files, q/k/v and gate/up at one size each, loaded by vLLM's CPU build with
logprobs that agree with our own decoding."""

import json

import pytest
import torch
from safetensors.torch import load_file

from eval.agreement import hf_logprobs, prompt_logprob_delta
from eval.artifact import load_dequantized
from eval.vllm_run import run_vllm
from pipeline.compare import row, sizes
from quantize import runner
from quantize.records import Manifest
from tests.conftest import tiny_recipe

BUDGET = 4.42  # g64 stores 4.314 bits per weight on these shapes, g32 4.627: about a third of the weights move


def _mixed(tmp_path, model_dir, name="tiny-mixed", budget=BUDGET):
    return tiny_recipe(tmp_path, model_dir, name=name, format="compressed-tensors",
                       mixed=dict(base_group=64, budget_bits_per_weight=budget, finer=[32]))


@pytest.fixture(scope="module")
def mixed_artifact(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mixed")
    return runner.run(_mixed(tmp, tiny_llama), out_root=tmp / "a")


def test_mixed_artifact_holds_both_sizes_within_the_budget(mixed_artifact):
    m = json.loads((mixed_artifact / "manifest.json").read_text())["mixed"]
    qcfg = json.loads((mixed_artifact / "config.json").read_text())["quantization_config"]
    groups = {g["weights"]["group_size"]: set(g["targets"]) for g in qcfg["config_groups"].values()}
    assert set(groups) == {64, 32} and all(groups.values()), groups
    assert m["bits_per_weight"] <= BUDGET and m["bits_per_weight"] == pytest.approx(
        sizes(mixed_artifact, 4)["bits_per_weight"], abs=1e-6)  # the manifest's figure is what the files store
    assert m["bits_per_weight_at"]["64"] < m["bits_per_weight"]
    assert m["error_sum"]["32"] <= m["error_sum"]["chosen"] < m["error_sum"]["64"]
    assert row(mixed_artifact)["group_size"] == "64+32"  # the comparison names both sizes
    assert Manifest.of(json.loads((mixed_artifact / "manifest.json").read_text())).group_text() == "64+32"  # registry tag
    card = (mixed_artifact / "README.md").read_text()
    assert "## Mixed group sizes" in card and f"{m['bits_per_weight']:.4f} reached" in card
    tensors = load_file(str(mixed_artifact / "model.safetensors"))
    for layer, per in m["groups"].items():
        assert per["self_attn.q_proj"] == per["self_attn.k_proj"] == per["self_attn.v_proj"], per
        assert per["mlp.gate_proj"] == per["mlp.up_proj"], per
        for linear, g in per.items():
            name = f"model.layers.{layer}.{linear}"
            assert name in groups[g]
            out_f, in_f = tensors[f"{name}.weight_shape"].tolist()
            assert tensors[f"{name}.weight_scale"].shape == (out_f, in_f // g)
            assert m["errors"][layer][linear][str(g)] == json.loads(
                (mixed_artifact / "manifest.json").read_text())["output_error"][layer][linear]


def test_budget_at_the_base_size_writes_the_base_recipes_weights(tiny_llama, tmp_path):
    """With no room to spend, every linear stays at g64, bit for bit what the plain g64 recipe writes: the finer
    size's run beside it changes nothing the base size computes."""
    mixed = runner.run(_mixed(tmp_path, tiny_llama, "tiny-mixed-none", budget=4.3142), out_root=tmp_path / "a")
    plain = runner.run(tiny_recipe(tmp_path, tiny_llama, name="tiny-ct-g64", format="compressed-tensors"),
                       out_root=tmp_path / "a")
    m = json.loads((mixed / "manifest.json").read_text())["mixed"]
    assert m["linears"] == {"64": 14, "32": 0}, m["linears"]
    a, b = load_file(str(mixed / "model.safetensors")), load_file(str(plain / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_gptq_mixes_sizes_on_the_base_sizes_chain(tiny_llama, tmp_path):
    """GPTQ carries its own quantized chain: the finer size runs on copies of each layer fed the base size's chain;
    both sizes are written, each linear's scales shaped for its size, within the budget."""
    recipe = tiny_recipe(tmp_path, tiny_llama, name="tiny-gptq-mixed", method="gptq", format="compressed-tensors",
                         mixed=dict(base_group=64, budget_bits_per_weight=4.5, finer=[32]))
    out = runner.run(recipe, out_root=tmp_path / "a")
    m = json.loads((out / "manifest.json").read_text())["mixed"]
    assert m["linears"]["32"] > 0 and m["linears"]["64"] > 0 and m["bits_per_weight"] <= 4.5
    assert m["error_sum"]["chosen"] < m["error_sum"]["64"]
    tensors = load_file(str(out / "model.safetensors"))
    for layer, per in m["groups"].items():
        for linear, g in per.items():
            in_f = tensors[f"model.layers.{layer}.{linear}.weight_shape"][1]
            assert tensors[f"model.layers.{layer}.{linear}.weight_scale"].shape[1] == in_f // g


@pytest.mark.vllm
def test_vllm_serves_the_mixed_artifact_as_we_decode_it(mixed_artifact):
    assert_vllm_serves_as_we_decode(mixed_artifact)


def assert_vllm_serves_as_we_decode(artifact) -> None:
    """vLLM's prompt logprobs on three random prompts match our decoding of the artifact (the CPU test's bound);
    test_mixed_coarser.py holds its per-channel mix to the same."""
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(3, 512, (24,), generator=g).tolist() for _ in range(3)]
    res = run_vllm(artifact, ids, top_k=5, max_tokens=4)
    hf = hf_logprobs(load_dequantized(artifact, torch.float32), ids)
    d = prompt_logprob_delta(res["prompt_logprobs"], hf)
    print(artifact.name, d, "kernels", res.get("linear_kernels"))
    assert d["n"] >= 3 * 23 * 5
    assert d["mean_abs_delta"] < 0.01, d

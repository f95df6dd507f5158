"""`advanced.awq.search_dtype`: which dtype the AWQ scale search's block forwards run in, and what it leaves alone."""

import json

import pytest
import torch

from quantize import runner
from quantize.methods import kernels
from quantize.methods import awq_layer
from quantize.recipe import RecipeError, load_recipe
from tests.conftest import tiny_recipe

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_resolution(monkeypatch):
    """compute never casts; bfloat16 casts unless the run computes in it; auto only on a float32 CPU run with AMX."""
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    assert kernels.awq_search_dtype("compute", CPU, f32) is None
    assert kernels.awq_search_dtype("bfloat16", CPU, f32) == bf16
    assert kernels.awq_search_dtype("bfloat16", CUDA, f16) == bf16
    assert kernels.awq_search_dtype("bfloat16", CUDA, bf16) is None
    monkeypatch.setattr(kernels, "cpu_has_amx", lambda: True)
    assert kernels.awq_search_dtype("auto", CPU, f32) == bf16
    assert [kernels.awq_search_dtype("auto", d, t) for d, t in ((CPU, bf16), (CUDA, f32), (CUDA, f16))] == [None] * 3
    monkeypatch.setattr(kernels, "cpu_has_amx", lambda: False)
    assert kernels.awq_search_dtype("auto", CPU, f32) is None
    with pytest.raises(ValueError, match="search_dtype"):
        kernels.awq_search_dtype("float8", CPU, f32)


def test_recipe_refuses_an_unknown_value(tmp_path, tiny_llama):
    with pytest.raises(RecipeError, match="search_dtype"):
        load_recipe(tiny_recipe(tmp_path, tiny_llama, advanced=dict(awq=dict(search_dtype="float16"))))


def test_block_forwards_run_in_the_asked_dtype_and_the_manifest_says_so(tmp_path, tiny_llama, monkeypatch):
    """bfloat16: every inspected block's output (reference and candidates) is bf16, single-linear groups keep their
    float32 Gram loss, and each group's record names its forwards' dtype; compute: float32 throughout."""
    seen: list[torch.dtype] = []
    real = awq_layer.first_output
    monkeypatch.setattr(awq_layer, "first_output", lambda y: seen.append(real(y).dtype) or real(y))
    stats = {}
    for setting, want in (("bfloat16", torch.bfloat16), ("compute", torch.float32)):
        seen.clear()
        out = runner.run(tiny_recipe(tmp_path, tiny_llama, name=f"s-{setting}",
                                     advanced=dict(awq=dict(search_dtype=setting))), out_root=tmp_path / "a")
        assert seen and set(seen) == {want}, setting
        stats[setting] = json.loads((out / "manifest.json").read_text())["awq_stats"]
        for layer in stats[setting].values():
            blocks = {k: v for k, v in layer.items() if "forward_dtype" in v}
            singles = {k: v for k, v in layer.items() if isinstance(v, dict) and "best_ratio" in v and k not in blocks}
            assert blocks and singles  # the norms feed blocks; v_proj and up_proj feed one linear each
            assert {v["forward_dtype"] for v in blocks.values()} == {str(want).removeprefix("torch.")}
    # the single linears' searches do not depend on the setting: each layer's searches see the unmodified layer and
    # the FP model's activations (awq.propagate: fp), so their losses agree to the last bit in every layer
    for i, layer in stats["compute"].items():
        for k, v in layer.items():
            if isinstance(v, dict) and "best_ratio" in v and "forward_dtype" not in v:
                assert stats["bfloat16"][i][k]["loss"] == v["loss"], (i, k)

"""SignRound on a tiny model end to end: round to nearest at zero steps, a lower layer loss and KL than round to
nearest once tuned, artifacts in the layouts vLLM reads."""

import json

import pytest
import torch
from safetensors import safe_open

from eval.artifact import load_dequantized
from quantize import runner
from quantize.methods import signround_layer
from quantize.methods.primitives import quantize_for_export
from tests.conftest import heldout_ids, kl_divergence as _kl, tiny_recipe

SR = dict(method="signround", signround=dict(iters=40, samples_per_step=4))


@pytest.mark.parametrize("symmetric", [False, True])
def test_untuned_rounding_is_round_to_nearest(symmetric):
    """V = 0 and range factors of 1 store exactly what `primitives.quantize_for_export` stores."""
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(0))
    t = signround_layer._Tuned(w, 4, 32, symmetric, tune_range=True)
    for got, want in zip(t.export(torch.float16), quantize_for_export(w, 4, 32, symmetric=symmetric,
                                                                       scale_dtype=torch.float16)):
        assert torch.equal(got, want)
    assert torch.allclose(t.fake(), _dequant(*quantize_for_export(w, 4, 32, symmetric=symmetric,
                                                                  scale_dtype=torch.float32)), atol=1e-6)


def _dequant(codes, scales, zeros):
    from quantize.methods.primitives import dequantize

    return dequantize(codes, scales, zeros)


def test_visits_cover_every_batch_before_repeating():
    steps = signround_layer._visits(5, 2, 5, seed=3)
    flat = [b for s in steps for b in s]
    assert all(len(s) == 2 for s in steps) and sorted(flat[:5]) == [0, 1, 2, 3, 4] and sorted(flat[5:10]) == [
        0, 1, 2, 3, 4]
    assert steps == signround_layer._visits(5, 2, 5, seed=3) != signround_layer._visits(5, 2, 5, seed=4)


@pytest.fixture(scope="module")
def signround_artifacts(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("signround")
    runs = {"sr": SR, "sr-0": dict(SR, signround=dict(iters=0)), "rtn": dict(method="rtn"),
            "sr-sym-gptq": dict(SR, zero_point=False, format="gptq")}
    return {k: runner.run(tiny_recipe(tmp, tiny_llama, name=k, **v), out_root=tmp / "a") for k, v in runs.items()}


def test_zero_steps_store_round_to_nearest(signround_artifacts):
    with safe_open(str(signround_artifacts["sr-0"] / "model.safetensors"), "pt") as a, \
            safe_open(str(signround_artifacts["rtn"] / "model.safetensors"), "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        assert all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in a.keys())


def test_tuning_lowers_every_layers_loss_and_the_kl(signround_artifacts, tiny_llama):
    from transformers import AutoModelForCausalLM

    manifest = json.loads((signround_artifacts["sr"] / "manifest.json").read_text())
    stats = manifest["signround_stats"]
    assert len(stats) == 2 and all(s["steps"] == 40 and s["loss_best"] < s["loss_start"] for s in stats.values())
    assert manifest["recipe"]["signround"] == {"iters": 40, "lr": None, "samples_per_step": 4, "tune_range": True,
                                               "seed": 0}
    ref = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    ids = heldout_ids(tiny_llama)
    kl_sr = _kl(ref, load_dequantized(signround_artifacts["sr"]), ids)
    kl_rtn = _kl(ref, load_dequantized(signround_artifacts["rtn"]), ids)
    assert kl_sr < kl_rtn, (kl_sr, kl_rtn)


def test_formats_follow_the_grid(signround_artifacts):
    cfg = json.loads((signround_artifacts["sr"] / "config.json").read_text())["quantization_config"]
    assert (cfg["quant_method"], cfg["zero_point"]) == ("awq", True)
    cfg = json.loads((signround_artifacts["sr-sym-gptq"] / "config.json").read_text())["quantization_config"]
    assert (cfg["quant_method"], cfg["sym"], cfg["desc_act"]) == ("gptq", True, False)


def test_mixture_of_experts_tunes_attention_and_rounds_the_experts(tmp_path):
    """Qwen3-MoE: the layer's attention linears are tuned against the FP layer (experts still unquantized in the
    loss), then every expert linear is rounded to nearest, as the method's statistics say."""
    from tests.conftest import build_tiny_model

    model = build_tiny_model(tmp_path / "moe", "qwen3_moe")
    sr = runner.run(tiny_recipe(tmp_path, model, name="sr-moe", **dict(SR, signround=dict(iters=20))),
                    out_root=tmp_path / "a")
    rtn = runner.run(tiny_recipe(tmp_path, model, name="rtn-moe", method="rtn"), out_root=tmp_path / "a")
    stats = json.loads((sr / "manifest.json").read_text())["signround_stats"]
    assert all(s["expert_rounding"] == "nearest" and s["loss_best"] < s["loss_start"] for s in stats.values())
    with safe_open(str(sr / "model.safetensors"), "pt") as a, safe_open(str(rtn / "model.safetensors"), "pt") as b:
        experts = [k for k in a.keys() if ".experts." in k and k.endswith(".qweight")]
        attention = [k for k in a.keys() if ".self_attn." in k and k.endswith(".qweight")]
        assert experts and attention
        assert all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in experts)
        assert not all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in attention)


def test_a_non_finite_step_is_skipped_not_taken(tiny_llama, tmp_path, monkeypatch):
    """An overflowing forward (half precision) gives NaN gradients: that step is skipped and counted, and the
    stored codes stay finite and on the grid."""
    calls = {"n": 0}
    real = signround_layer.functional_call

    def overflow_every_third(module, weights, args, kwargs):
        calls["n"] += 1
        y = real(module, weights, args, kwargs)
        if calls["n"] % 3 == 0:
            y = (y[0] * float("nan"),) + tuple(y[1:]) if isinstance(y, tuple) else y * float("nan")
        return y

    monkeypatch.setattr(signround_layer, "functional_call", overflow_every_third)
    art = runner.run(tiny_recipe(tmp_path, tiny_llama, name="sr-nan", **dict(SR, signround=dict(
        iters=30, samples_per_step=4))), out_root=tmp_path / "a")
    stats = json.loads((art / "manifest.json").read_text())["signround_stats"]
    assert all(s["skipped_steps"] == 10 and s["loss_best"] < s["loss_start"] for s in stats.values()), stats
    with safe_open(str(art / "model.safetensors"), "pt") as f:
        assert all(bool(torch.isfinite(f.get_tensor(k)).all()) for k in f.keys() if k.endswith("scales"))

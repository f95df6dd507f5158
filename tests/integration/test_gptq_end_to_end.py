"""GPTQ on tiny models end to end, in each format; vLLM loads each and matches our decoding."""

import json

import pytest
import torch
from safetensors import safe_open

from eval.agreement import hf_logprobs, prompt_logprob_delta
from eval.artifact import load_dequantized
from eval.vllm_run import run_vllm
from quantize import runner
from tests.conftest import heldout_ids, kl_divergence as _kl, tiny_recipe

GPTQ = dict(method="gptq", zero_point=False, gptq=dict(act_order=True, true_sequential=True, block_size=64))

CASES = {
    "gptq-w4": dict(GPTQ),
    "ct-w4-asym": dict(GPTQ, zero_point=True, format="compressed-tensors"),
    "ct-w8-sym": dict(GPTQ, w_bit=8, format="compressed-tensors", q_group_size=128),
    "gptq-w8-perchannel": dict(GPTQ, w_bit=8, q_group_size=-1),
}


@pytest.fixture(scope="module")
def gptq_artifacts(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gptq")
    return {k: runner.run(tiny_recipe(tmp, tiny_llama, name=k, **v), out_root=tmp / "a") for k, v in CASES.items()}


def test_gptq_layout(gptq_artifacts):
    out = gptq_artifacts["gptq-w4"]
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (cfg["quant_method"], cfg["bits"], cfg["group_size"], cfg["sym"], cfg["desc_act"]) == ("gptq", 4, 64, True,
                                                                                                   False)
    with safe_open(str(out / "model.safetensors"), "pt") as st:
        q = "model.layers.0.mlp.down_proj"
        assert st.get_tensor(f"{q}.qweight").shape == (512 // 8, 256)
        assert st.get_tensor(f"{q}.g_idx").tolist() == [i // 64 for i in range(512)]
    pre = json.loads((out / "preflight.json").read_text())
    assert len(pre["convert"]) == 14 and pre["layers"][0]["cuda_kernel"] == "gptq_marlin"
    stats = json.loads((out / "manifest.json").read_text())["gptq_stats"]
    per_linear = [s for layer in stats.values() for name, s in layer.items() if name != "seconds"]
    assert len(per_linear) == 14 and all(s["kernel"] == "torch" and s["loss"] > 0 for s in per_linear)  # CPU


def test_gptq_beats_rtn_on_tiny(gptq_artifacts, tiny_llama, tmp_path):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    rtn = runner.run(tiny_recipe(tmp_path, tiny_llama, name="rtn-sym", method="rtn", zero_point=False),
                     out_root=tmp_path / "a")
    ids = heldout_ids(tiny_llama)
    kl_gptq = _kl(ref, load_dequantized(gptq_artifacts["gptq-w4"]), ids)
    kl_rtn = _kl(ref, load_dequantized(rtn), ids)
    assert kl_gptq < kl_rtn, (kl_gptq, kl_rtn)


def test_each_linears_output_error_is_recorded_and_8_bits_err_far_less(gptq_artifacts):
    """The relative output error of every linear on its calibration inputs, from GPTQ's Hessian: in the manifest,
    drawn beside it; 8-bit codes leave a small fraction of 4-bit's error (256 levels against 16)."""
    w4, w8 = ({(i, n): e for i, per in json.loads((gptq_artifacts[k] / "manifest.json").read_text())["output_error"]
               .items() for n, e in per.items()} for k in ("gptq-w4", "ct-w8-sym"))
    assert len(w4) == 14 and w4.keys() == w8.keys() and all(0 < e < 0.5 for e in w4.values())
    assert all(w8[k] < 0.2 * w4[k] for k in w4)
    m = json.loads((gptq_artifacts["gptq-w4"] / "manifest.json").read_text())
    assert m["error_plot"] == "output-error.png" and "output-error.png" in m["files"]


def test_w8_much_closer_than_w4(gptq_artifacts, tiny_llama):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    ids = heldout_ids(tiny_llama)
    assert _kl(ref, load_dequantized(gptq_artifacts["ct-w8-sym"]), ids) < 0.1 * _kl(
        ref, load_dequantized(gptq_artifacts["gptq-w4"]), ids)


def test_asymmetric_gptq_format_refused_before_work(tiny_llama, tmp_path):
    from quantize.recipe import RecipeError

    with pytest.raises(RecipeError, match="sym: true"):
        runner.run(tiny_recipe(tmp_path, tiny_llama, name="bad", method="gptq", zero_point=True),
                   out_root=tmp_path / "a")
    assert not (tmp_path / "a").exists()


@pytest.mark.vllm
@pytest.mark.parametrize("case", [c for c, v in CASES.items() if v.get("w_bit", 4) == 4])
def test_vllm_loads_and_matches(case, gptq_artifacts):
    out = gptq_artifacts[case]
    if not CASES[case].get("zero_point"):  # the full-range symmetric grid stores negative scales: vLLM must take them
        with safe_open(str(out / "model.safetensors"), "pt") as st:
            scales = [st.get_tensor(k) for k in st.keys() if k.endswith(".scales")]
        assert scales and any((s < 0).any() for s in scales)
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(3, 512, (24,), generator=g).tolist() for _ in range(3)]
    res = run_vllm(out, ids, top_k=5, max_tokens=2)
    d = prompt_logprob_delta(res["prompt_logprobs"], hf_logprobs(load_dequantized(out), ids))
    print(case, d, res["quantization"])
    assert d["mean_abs_delta"] < 0.01, d


@pytest.mark.vllm
@pytest.mark.vllm_no_4bit
def test_vllm_cpu_build_refuses_8bit_as_preflight_says(gptq_artifacts):
    """8-bit is served by CUDA vLLM (Marlin uint8b128), not by the CPU build: pre-flight says so, vLLM agrees."""
    from eval.vllm_run import VllmError

    out = gptq_artifacts["ct-w8-sym"]
    pre = json.loads((out / "preflight.json").read_text())
    assert all(lc["cpu_kernel"].startswith("none") for lc in pre["layers"])
    with pytest.raises(VllmError, match="uint8b128"):
        run_vllm(out, [[5, 6, 7, 8]], top_k=1, max_tokens=1)


def test_fp_target_reads_the_fp_inputs_row_for_row(gptq_artifacts, tiny_llama, tmp_path):
    """gptq.fp_target: the first layer's q/k/v see the same inputs in the FP model and on the quantized chain,
    so their codes equal plain GPTQ's to the bit; every later stage aims at the FP outputs and moves."""
    aimed = runner.run(tiny_recipe(tmp_path, tiny_llama, name="gptq-w4-fp", **dict(GPTQ, gptq=dict(
        GPTQ["gptq"], fp_target=0.25))), out_root=tmp_path / "a")
    with safe_open(str(aimed / "model.safetensors"), "pt") as a, \
            safe_open(str(gptq_artifacts["gptq-w4"] / "model.safetensors"), "pt") as b:
        same = {k for k in a.keys() if k.endswith(".qweight") and torch.equal(a.get_tensor(k), b.get_tensor(k))}
    first = {f"model.layers.0.self_attn.{p}_proj.qweight" for p in "qkv"}
    assert same == first, sorted(same)


def test_error_plot_drawn_beside_the_weights_is_the_same_file(gptq_artifacts, tiny_llama, tmp_path, monkeypatch):
    """Where the host has the cores, export draws the error plot in a thread while the weights are written: the
    artifact is the one the drawing after the weights gives (same plot bytes, same weights)."""
    from quantize.export import artifact

    threads = []
    draw = artifact.card_plots.error_plot
    monkeypatch.setattr(artifact, "PLOT_THREAD_CORES", 1)
    monkeypatch.setattr(artifact.card_plots, "error_plot",
                        lambda *a: threads.append(__import__("threading").current_thread().name) or draw(*a))
    again = runner.run(tiny_recipe(tmp_path, tiny_llama, name="gptq-w4", **CASES["gptq-w4"]), out_root=tmp_path / "a")
    assert threads and all(t.startswith("plot") for t in threads)
    before = gptq_artifacts["gptq-w4"]
    for f in ("output-error.png", "model.safetensors"):
        assert (again / f).read_bytes() == (before / f).read_bytes(), f
    assert json.loads((again / "manifest.json").read_text())["error_plot"] == "output-error.png"

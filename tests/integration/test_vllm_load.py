"""The artifact loads in a real vLLM (CPU build) in fp16, and its logprobs match transformers running the
weights our own code decodes from the artifact. A deliberately mis-packed artifact must fail the same check."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from eval.agreement import hf_logprobs, prompt_logprob_delta
from eval.artifact import load_dequantized
import json

from eval.vllm_run import run_vllm, run_vllm_many
from quantize import runner
from quantize.formats.awq_gemm import AWQ_ORDER
from quantize.formats.packing import pack_int32, unpack_int32
from tests.conftest import KEPT_16BIT, tiny_recipe
from tests.integration import vllm_load_only

pytestmark = pytest.mark.vllm


def _prompts(n=3, length=24, vocab=512):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


def _delta(artifact):
    ids = _prompts()
    res = run_vllm(artifact, ids, top_k=5, max_tokens=4)
    hf = hf_logprobs(load_dequantized(artifact, torch.float32), ids)
    return prompt_logprob_delta(res["prompt_logprobs"], hf), res


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_vllm_matches_our_decoding(fixture, request, tmp_path):
    model_dir = request.getfixturevalue(fixture)
    out = runner.run(tiny_recipe(tmp_path, model_dir, name=f"{fixture}-awq"), out_root=tmp_path / "a")
    d, res = _delta(out)
    print(fixture, d, "load_s", res["load_s"])
    assert d["n"] >= 3 * 23 * 5
    assert d["mean_abs_delta"] < 0.01, d
    assert all(len(g) == 4 for g in res["generations"])


def test_one_vllm_child_runs_several_directories(tiny_llama, tmp_path):
    """run_vllm_many: one child, its engine in-process, loads each directory in turn; a directory vLLM refuses is
    that directory's error and the next one still loads and agrees with our decoding."""
    out = runner.run(tiny_recipe(tmp_path, tiny_llama, name="tiny-many"), out_root=tmp_path / "a")
    refused = tmp_path / "refused"
    shutil.copytree(out, refused)
    cfg = json.loads((refused / "config.json").read_text())
    cfg["quantization_config"]["bits"] = 3  # vLLM's AWQ takes 4-bit weights only
    (refused / "config.json").write_text(json.dumps(cfg))
    ids = _prompts()
    first, bad, again = run_vllm_many([out, refused, out], ids, top_k=5, max_tokens=2)
    assert "error" in bad and "refused" in bad["error"] and "bit" in bad["error"], bad
    hf = hf_logprobs(load_dequantized(out, torch.float32), ids)
    assert first["kernels"], first  # its log lines name the kernel; the second load's do not (vLLM logs it once)
    for res in (first, again):
        assert "error" not in res, res
        assert sum(res["linear_kernels"].values()) == 8, res["linear_kernels"]  # 2 layers x (qkv, o, gate_up, down)
        assert prompt_logprob_delta(res["prompt_logprobs"], hf)["mean_abs_delta"] < 0.01


def test_wrong_nibble_order_is_caught(tiny_llama, tmp_path):
    """Negative control: repack one layer's qweight with a plain nibble order; the logprob check must fail."""
    out = runner.run(tiny_recipe(tmp_path, tiny_llama, name="tiny-bad"), out_root=tmp_path / "a")
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    for name in [k for k in tensors if k.endswith(".qweight")]:
        codes = unpack_int32(tensors[name], 4, AWQ_ORDER)  # [in, out]
        tensors[name] = pack_int32(codes, 4)  # nibble i <- column 8c + i (wrong)
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    ids = _prompts()
    res = run_vllm(bad, ids, top_k=5, max_tokens=1)
    # our decoder reads the file the same (wrong) way as written -> compare against the *correct* artifact
    hf = hf_logprobs(load_dequantized(out, torch.float32), ids)
    d = prompt_logprob_delta(res["prompt_logprobs"], hf)
    assert d["mean_abs_delta"] > 0.05, d


@pytest.mark.vllm_load_only
@pytest.mark.parametrize("fmt", ["awq", "gptq", "compressed-tensors"])
def test_vllm_loads_a_linear_kept_16bit_as_16bit(fmt, kept_16bit_artifacts):
    """vLLM starts on an artifact whose recipe keeps one linear 16-bit, runs that linear unquantized with the
    file's weights, and every other linear quantized. Loading only: runs on a CPU without vLLM's 4-bit kernel."""
    out = kept_16bit_artifacts[fmt]
    linears = vllm_load_only.load(out)
    kept = linears[KEPT_16BIT]
    assert kept["method"] == "UnquantizedLinearMethod" and kept["params"] == {"weight": "float16"}, kept
    weight = load_file(str(out / "model.safetensors"))[f"{KEPT_16BIT}.weight"]
    expect = vllm_load_only.probe_input(weight.shape[1], torch.float16).double() @ weight.double().T
    got = torch.tensor(kept["output"], dtype=torch.float64)
    assert got.shape == expect.shape and (got - expect).abs().max() <= 1e-2 * expect.abs().max(), (got, expect)
    others = {n: v["method"] for n, v in linears.items() if n != KEPT_16BIT}
    assert len(others) == 7 and "UnquantizedLinearMethod" not in others.values(), others  # qkv, o, gate_up, down

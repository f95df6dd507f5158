"""The serve config's values come from the recipe and the pre-flight plan; bad serve: keys are refused before
any model loads, with what to change."""

import socket

import pytest

from eval.serve import free_port, server_command
from quantize.export import serve_config
from quantize.preflight.checks import LayerCheck, Plan
from quantize.recipe import KV_CACHE_DTYPES, Recipe


def _recipe(**over):
    return Recipe(**{"name": "r", "model": "m", "method": "awq", "q_group_size": 64, **over})


def _plan(kernels, ctx=2048):
    return Plan(layers=[LayerCheck(f"l{i}", 128, 128, k, "cpu_wna16") for i, k in enumerate(kernels)],
                tp_sizes=[1, 2], max_position_embeddings=ctx)


def test_config_from_recipe_and_plan():
    r = _recipe(dtype="bfloat16", serve={"served_model_name": "team/chat", "max_model_len": 1024,
                                         "tensor_parallel_size": 2, "kv_cache_dtype": "fp8"})
    cfg = serve_config.build(r, _plan(["awq_marlin"] * 3))
    assert cfg == {"quantization": "awq_marlin", "served-model-name": "team/chat", "dtype": "bfloat16",
                   "max-model-len": 1024, "tensor-parallel-size": 2, "kv-cache-dtype": "fp8"}


def test_defaults_recipe_name_and_model_context():
    cfg = serve_config.build(_recipe(), _plan(["awq_marlin"], ctx=8192))
    assert cfg["served-model-name"] == "r" and cfg["max-model-len"] == 8192 and "kv-cache-dtype" not in cfg


@pytest.mark.parametrize("fmt,kernels,want", [
    ("awq", ["awq_marlin", "awq_marlin"], "awq_marlin"),
    ("awq", ["awq_marlin", "awq (gemm)"], "awq"),
    ("gptq", ["gptq_marlin"], "gptq_marlin"),
    ("gptq", ["gptq_marlin", "gptq (exllama)"], "gptq"),
    ("compressed-tensors", ["marlin (compressed-tensors wNa16)"], "compressed-tensors"),
])
def test_method_follows_preflight_kernels(fmt, kernels, want):
    assert serve_config.quantization_method(fmt, kernels) == want


def test_cpu_build_gets_the_checkpoint_method():
    assert serve_config.cpu_overrides({"quantization": "awq_marlin"}, "awq") == {"quantization": "awq"}
    assert serve_config.cpu_overrides({"quantization": "compressed-tensors"}, "compressed-tensors") == {}


@pytest.mark.parametrize("serve,key,hint", [
    ({"tensor_parallel_size": 3}, "serve.tensor_parallel_size", "power of two"),
    ({"kv_cache_dtype": "int3"}, "serve.kv_cache_dtype", "fp8_e5m2"),
    ({"concurrency": [8, 8]}, "serve.concurrency", "distinct positive"),
    ({"concurrency": [0]}, "serve.concurrency", "distinct positive"),
    ({"served_model_name": "my model"}, "serve.served_model_name", "letters, digits"),
    ({"max_model_len": 0}, "serve.max_model_len", "greater than 0"),
    ({"port": 8000}, "serve.port", "unknown"),
])
def test_bad_serve_keys_refused(tmp_path, serve, key, hint):
    from quantize.recipe import RecipeError, load_recipe
    from tests.conftest import write_recipe

    path = write_recipe(tmp_path / "bad.yaml", model="m", method="awq", q_group_size=64, serve=serve)
    with pytest.raises(RecipeError) as e:
        load_recipe(path)
    assert key in str(e.value) and hint in str(e.value), str(e.value)


def test_kv_cache_dtypes_are_vllms():
    from typing import get_args

    cache = pytest.importorskip("vllm.config.cache")
    assert set(KV_CACHE_DTYPES) <= set(get_args(cache.CacheDType))


def test_server_command_cli_flags_override_the_config(tmp_path):
    (tmp_path / "config.json").write_text('{"quantization_config": {"quant_method": "awq"}}')
    (tmp_path / serve_config.SERVE_CONFIG).write_text(serve_config.render({"quantization": "awq_marlin",
                                                                          "served-model-name": "x"}))
    cmd = server_command(tmp_path, 1234, extra={"max-model-len": 64})
    assert cmd[cmd.index("--config") + 1] == str(tmp_path / serve_config.SERVE_CONFIG)
    assert cmd[cmd.index("--port") + 1] == "1234" and cmd[cmd.index("--max-model-len") + 1] == "64"
    assert cmd[cmd.index("--quantization") + 1] == "awq"  # this suite runs on the CPU build


def test_free_port_is_not_a_listening_one_and_bindable():
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    try:
        ports = {free_port() for _ in range(5)}
        assert held.getsockname()[1] not in ports
        for p in ports:
            with socket.socket() as s:
                s.bind(("127.0.0.1", p))
    finally:
        held.close()


@pytest.mark.parametrize("keys,refused", [
    (dict(dtype="float16", serve=dict(kv_cache_dtype="fp8", targets=[dict(compute_capability=9.0)])), True),
    (dict(dtype="float16", serve=dict(kv_cache_dtype="fp8_e4m3", targets=[dict(compute_capability=9.0)])), True),
    (dict(dtype="bfloat16", serve=dict(kv_cache_dtype="fp8", targets=[dict(compute_capability=9.0)])), False),
    (dict(dtype="float16", serve=dict(kv_cache_dtype="fp8", targets=[dict(compute_capability=8.0)])), False),
    (dict(dtype="float16", serve=dict(targets=[dict(compute_capability=9.0)])), False),
])
def test_fp8_kv_cache_with_float16_is_refused_for_hopper(keys, refused, monkeypatch):
    """vLLM's FlashAttention 3 on compute capability 9.0 takes an fp8 KV cache only with a bfloat16 model."""
    from quantize.preflight.checks import fp8_kv_problem

    monkeypatch.setattr("torch.cuda.is_available", lambda: False)  # the targets alone decide here
    problem = fp8_kv_problem(Recipe(name="x", model="m", method="awq", **keys))
    assert (problem is not None) == refused
    if refused:
        assert "use dtype: bfloat16" in problem and "compute capability 9.0" in problem

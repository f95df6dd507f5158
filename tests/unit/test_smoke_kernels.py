"""On a CUDA GPU the smoke stage holds the kernels vLLM logged to pre-flight's deployability table for that GPU."""

import json
from types import SimpleNamespace

import pytest
import torch

from eval import serving, smoke
from quantize.export.modelcard import capacity_sentence


@pytest.mark.parametrize("logged,cell,agree", [
    (["MacheteLinearKernel for AutoGPTQLinearMethod"], "Machete", True),
    (["MarlinLinearKernel for AutoAWQMarlinLinearMethod"], "Machete", False),
    (["MacheteLinearKernel for CompressedTensorsWNA16", "MarlinLinearKernel for CompressedTensorsWNA16"],
     "Machete/Marlin", True),
    (["MacheteLinearKernel for CompressedTensorsWNA16"], "Machete/Marlin", False),
    (["ExllamaLinearKernel for AutoGPTQLinearMethod"], "fallback: Exllama", True),
    ([], "Marlin", False),  # nothing logged is no agreement
    (["MarlinLinearKernel for AutoGPTQLinearMethod"], "refused", False),
])
def test_kernel_check(logged, cell, agree):
    assert smoke.kernel_check(logged, cell)["agree"] is agree


def _out(kernels):
    return {"kernels": kernels, "checks": {}, "errors": []}


def test_a_cuda_gpu_checks_its_own_cell(monkeypatch):
    monkeypatch.setattr(smoke, "cuda_build", lambda: True)
    monkeypatch.setattr(smoke.torch.cuda, "get_device_capability", lambda *a: (9, 0))
    table = {"8.0": {"1": "Marlin"}, "9.0": {"1": "Machete", "2": "Marlin"}}
    out = _out(["MarlinLinearKernel for AutoAWQMarlinLinearMethod"])
    smoke._check_kernels(out, table, 1)
    assert out["checks"]["kernels_as_predicted"] is False
    assert out["kernel_check"] == {"capability": "9.0", "tp": 1, "predicted": "Machete", "ran": ["Marlin"],
                                   "agree": False}
    assert "predicted 'Machete'" in out["errors"][0] and "capability 9.0, TP 1" in out["errors"][0]
    out = _out(["MarlinLinearKernel for AutoAWQMarlinLinearMethod"])
    smoke._check_kernels(out, table, 2)
    assert out["checks"]["kernels_as_predicted"] is True and out["errors"] == []


def test_no_check_off_cuda_or_without_a_table(monkeypatch):
    out = _out(["CPUWNA16LinearKernel for AutoAWQMarlinLinearMethod"])
    monkeypatch.setattr(smoke, "cuda_build", lambda: False)
    smoke._check_kernels(out, {"9.0": {"1": "Machete"}}, 1)
    monkeypatch.setattr(smoke, "cuda_build", lambda: True)
    monkeypatch.setattr(smoke.torch.cuda, "get_device_capability", lambda *a: (8, 6))
    smoke._check_kernels(out, None, 1)
    smoke._check_kernels(out, {"9.0": {"1": "Machete"}}, 1)  # no cell for this GPU
    assert "kernel_check" not in out and out["checks"] == {}


def test_the_smoke_server_asks_for_no_more_of_the_gpu_than_is_free(monkeypatch, tmp_path):
    """vLLM refuses to start when less than its share is free; the eval process still holds its context and the
    quantize stage's cached blocks, so the share is the serve config's, lowered to what is free (less a margin)."""
    released = []
    monkeypatch.setattr(serving.torch.cuda, "empty_cache", lambda: released.append(1))
    monkeypatch.setattr(serving.torch.cuda, "mem_get_info", lambda *a: (69 * 2**30, 79 * 2**30))
    monkeypatch.setattr(serving.serve_config, "read", lambda artifact: {"gpu-memory-utilization": 0.92})
    assert serving.gpu_share(tmp_path) == round(69 / 79 - 0.03, 3) and released == [1]
    monkeypatch.setattr(serving.torch.cuda, "mem_get_info", lambda *a: (78 * 2**30, 79 * 2**30))
    assert serving.gpu_share(tmp_path) == 0.92
    monkeypatch.setattr(serving.serve_config, "read", lambda artifact: None)  # another tool's directory: vLLM's 0.9
    assert serving.gpu_share(tmp_path) == 0.9


class _NextIsPlusOne(torch.nn.Module):
    """A stand-in decoder whose top-1 after token t is t + 1 (mod vocab)."""

    def __init__(self, vocab=16):
        super().__init__()
        self.vocab = vocab
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, use_cache=False):
        return SimpleNamespace(logits=torch.nn.functional.one_hot((input_ids + 1) % self.vocab, self.vocab).float())


def _smoked(generations):
    return {"passed": True, "checks": {"loaded": True}, "errors": [],
            "token_ids": {"prompts": [[1, 2], [5]], "generations": generations}}


def test_decode_check_passes_tokens_our_decoding_would_choose():
    out = _smoked([[3, 4, 5], [6, 7]])
    smoke.decode_check(out, _NextIsPlusOne(), 0.75)
    assert out["decode_agreement"] == 1.0 and out["checks"]["decodes_as_ours"] is True and out["passed"] is True


def test_decode_check_fails_tokens_our_decoding_would_not_choose():
    out = _smoked([[3, 9, 9], [6, 9]])  # 2 of 5 as ours would choose
    smoke.decode_check(out, _NextIsPlusOne(), 0.75)
    assert out["decode_agreement"] == 0.4 and out["passed"] is False
    assert "our own decoding of the artifact 0.400 < eval.vllm.min_decode_agreement 0.75" in out["errors"][0]


def test_decode_check_leaves_a_smoke_that_never_generated_alone():
    out = {"passed": False, "checks": {"loaded": False}, "errors": ["vLLM refused"]}
    smoke.decode_check(out, _NextIsPlusOne(), 0.75)
    assert out == {"passed": False, "checks": {"loaded": False}, "errors": ["vLLM refused"]}


def test_capacity_check_sets_the_cards_arithmetic_beside_vllms_tokens(monkeypatch, tmp_path):
    config = {"num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "hidden_size": 3584}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1000)
    monkeypatch.setattr(smoke.torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=10**6))
    monkeypatch.setattr(smoke.torch.cuda, "get_device_name", lambda i: "Some GPU")
    per_token = 2 * 28 * 4 * 128 * 2  # K and V, layers, KV heads, head dim, float16
    c = smoke.capacity_check(tmp_path, {"kv_cache_tokens": 20}, 0.5)
    assert c["kv_bytes_per_token"] == per_token
    assert c["predicted_kv_tokens"] == (500_000 - 1000) // per_token == 8
    assert c["vllm_kv_tokens"] == 20 and c["difference_pct"] == 150.0
    assert smoke.capacity_check(tmp_path, {"kv_cache_tokens": None}, 0.5) is None
    text = capacity_sentence(c)
    assert "gives 8 tokens of KV cache; vLLM allocated 20 (+150.0 %" in text and "Some GPU" in text

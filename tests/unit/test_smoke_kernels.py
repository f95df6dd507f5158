"""On a CUDA GPU the smoke stage holds the kernels vLLM logged to pre-flight's deployability table for that GPU."""

import pytest

from eval import smoke


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
    monkeypatch.setattr(smoke.torch.cuda, "empty_cache", lambda: released.append(1))
    monkeypatch.setattr(smoke.torch.cuda, "mem_get_info", lambda *a: (69 * 2**30, 79 * 2**30))
    monkeypatch.setattr(smoke.serve_config, "read", lambda artifact: {"gpu-memory-utilization": 0.92})
    assert smoke._gpu_share(tmp_path) == round(69 / 79 - 0.03, 3) and released == [1]
    monkeypatch.setattr(smoke.torch.cuda, "mem_get_info", lambda *a: (78 * 2**30, 79 * 2**30))
    assert smoke._gpu_share(tmp_path) == 0.92
    monkeypatch.setattr(smoke.serve_config, "read", lambda artifact: None)  # another tool's directory: vLLM's 0.9
    assert smoke._gpu_share(tmp_path) == 0.9

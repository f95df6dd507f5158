"""The warning at a run's start when another process holds the GPU memory its vLLM will ask for (no GPU here:
the decision and NVML's answers are given as fakes)."""

from __future__ import annotations

import types

import pytest

from eval import gpu_share
from eval.gpu_share import Holder, busy_message, parse_smi, starts_vllm
from quantize.recipe import EvalOptions

GIB = 1 << 30


def test_a_card_another_process_holds_is_named_with_its_pid():
    msg = busy_message(free=6 * GIB, total=80 * GIB, share=0.85,
                       holders=[Holder(4242, 72 * GIB, "python"), Holder(7, 1 * GIB)], own_pid=99)
    assert msg is not None
    assert "only 6.0 of 80.0 GiB free" in msg and "pid 4242 (python) holds 72.0 GiB, pid 7 holds 1.0 GiB" in msg
    assert "85%" in msg


@pytest.mark.parametrize("free", [80 * GIB, 70 * GIB])
def test_a_card_with_vllms_share_free_gets_no_warning(free):
    assert busy_message(free=free, total=80 * GIB, share=0.85, holders=[Holder(4242, 9 * GIB)], own_pid=1) is None


def test_this_process_is_not_named_and_unknown_holders_are_said_so():
    msg = busy_message(free=1 * GIB, total=80 * GIB, share=0.85, holders=[Holder(99, 2 * GIB)], own_pid=99)
    assert "pid 99" not in msg and "not visible from here" in msg


def test_nvidia_smi_rows_of_this_gpu_only():
    out = ("GPU-aaaa, 4242, 73000, /usr/bin/python3\n"
           "GPU-bbbb, 5555, 1000, other\n"
           "GPU-aaaa, 6, [N/A], [N/A]\n")
    assert parse_smi(out, "aaaa") == [Holder(4242, 73000 << 20, "/usr/bin/python3"), Holder(6, None, "[N/A]")]


def test_runs_that_start_vllm():
    e = EvalOptions()
    assert starts_vllm(e)
    assert not starts_vllm(e.model_copy(update={"enabled": False}))
    no_smoke = e.model_copy(update={"vllm": e.vllm.model_copy(update={"enabled": False})})
    assert not starts_vllm(no_smoke)  # no lm-eval tasks either
    assert starts_vllm(no_smoke.model_copy(update={"lm_eval": e.lm_eval.model_copy(update={"tasks": ("t",)})}))


def test_warn_before_eval_asks_the_gpu_vllm_will_use(monkeypatch):
    """The whole path with a fake CUDA device and a fake nvidia-smi: the warning names the holder."""
    fake_cuda = types.SimpleNamespace(is_available=lambda: True, mem_get_info=lambda i: (2 * GIB, 80 * GIB),
                                      get_device_properties=lambda i: types.SimpleNamespace(uuid="aaaa"))
    monkeypatch.setattr("torch.cuda", fake_cuda)
    monkeypatch.setattr(gpu_share, "holders", lambda uuid: parse_smi("GPU-aaaa, 4242, 78000, vllm\n", uuid))
    msg = gpu_share.warn_before_eval(EvalOptions())
    assert msg and "pid 4242 (vllm)" in msg
    assert gpu_share.warn_before_eval(EvalOptions(enabled=False)) is None

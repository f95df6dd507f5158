"""The calibration loop's first step: layer-0 inputs from the embeddings, without touching the model."""

import torch
from transformers import AutoModelForCausalLM

from quantize.source.arch import arch_for
from quantize.capture.forward import first_layer_inputs
from tests.conftest import build_tiny_model


def test_first_layer_inputs_leave_the_model_as_it_was(tmp_path):
    d = build_tiny_model(tmp_path / "m", "llama", layers=2)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    arch = arch_for(model.config)
    emb, rot = model.model.embed_tokens, model.model.rotary_emb
    weight, inv_freq = emb.weight, rot.inv_freq
    ids = torch.randint(0, 512, (3, 16), generator=torch.Generator().manual_seed(0))
    inputs, kwargs = first_layer_inputs(model, arch, ids, torch.device("cpu"), torch.bfloat16, batch_size=2)
    # the computation ran in the compute dtype, on copies; the model keeps its own modules and tensors
    assert [x.shape for x in inputs] == [(2, 16, 256), (1, 16, 256)] and inputs[0].dtype == torch.bfloat16
    assert torch.equal(torch.cat(inputs), weight[ids].to(torch.bfloat16))
    assert model.model.embed_tokens is emb and emb.weight is weight and weight.dtype == torch.float32
    assert model.model.rotary_emb is rot and rot.inv_freq is inv_freq
    # positions come from the float32 frequencies (as the model serves them), handed over in the compute dtype
    assert len(kwargs) == 2 and kwargs[1][0]["position_embeddings"] is kwargs[0][0]["position_embeddings"]
    cos, _ = kwargs[0][0]["position_embeddings"]
    assert cos.dtype == torch.bfloat16
    want, _ = rot(inputs[0], torch.arange(16)[None])
    assert torch.equal(cos, want)


def test_each_layer_gets_the_kwargs_the_stack_hands_it(tmp_path):
    """Gemma 3's sliding-window and global layers get different rotary tables; each layer keeps its own."""
    d = build_tiny_model(tmp_path / "g", "gemma3", layers=2)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    layers = list(model.model.layers)
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    inputs, kwargs = first_layer_inputs(model, arch_for(model.config), ids, torch.device("cpu"), torch.float32, 2)
    assert list(model.model.layers) == layers  # the layers are back in place
    (cos0, _), (cos1, _) = kwargs[0][0]["position_embeddings"], kwargs[1][0]["position_embeddings"]
    want0, _ = model.model.rotary_emb(inputs[0], torch.arange(32)[None], "sliding_attention")
    want1, _ = model.model.rotary_emb(inputs[0], torch.arange(32)[None], "full_attention")
    assert torch.equal(cos0, want0) and torch.equal(cos1, want1) and not torch.equal(cos0, cos1)


def test_cache_released_only_when_much_sits_unused(monkeypatch):
    from types import SimpleNamespace

    from quantize.capture import device

    released = []
    gib = 2**30
    state = {"reserved": 30 * gib, "allocated": 20 * gib}
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: state["reserved"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: state["allocated"])
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=140 * gib))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: released.append(True))
    device.release_cache(torch.device("cuda"))  # 10 GiB unused of 140: kept for the next layer
    assert released == []
    state["reserved"] = 40 * gib  # 20 GiB unused: more than 10 % of the device
    device.release_cache(torch.device("cuda"))
    assert released == [True]


def test_allocator_expandable_on_cuda_unless_the_user_chose(monkeypatch):
    from quantize.capture import device

    calls = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    monkeypatch.delenv(device.ALLOC_ENV, raising=False)
    assert device.configure_allocator(torch.device("cpu")) is None and calls == []
    assert device.configure_allocator(torch.device("cuda")) == "expandable_segments:True"
    assert calls == ["expandable_segments:True"]
    # the user's PYTORCH_CUDA_ALLOC_CONF wins (applied as written, which checks it) and the manifest records it
    monkeypatch.setenv(device.ALLOC_ENV, "expandable_segments:False")
    assert device.configure_allocator(torch.device("cuda")) == "expandable_segments:False"
    assert calls == ["expandable_segments:True", "expandable_segments:False"]
    # an older torch without the accelerator-wide setter: the CUDA one
    monkeypatch.delenv(device.ALLOC_ENV)
    monkeypatch.delattr(torch._C, "_accelerator_setAllocatorSettings")
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", lambda s: calls.append(("cuda", s)))
    device.configure_allocator(torch.device("cuda"))
    assert calls[-1] == ("cuda", "expandable_segments:True")


def test_a_mistyped_allocator_setting_stops_the_run_in_preflight(monkeypatch):
    # torch's own parser (this CPU build has it too) rejects the value; the message names the variable
    import pytest

    from quantize.capture import device
    from quantize.errors import UserError

    monkeypatch.setenv(device.ALLOC_ENV, "expandable_segments:maybe")
    with pytest.raises(UserError, match=r"PYTORCH_CUDA_ALLOC_CONF='expandable_segments:maybe' is not a "
                                        r"setting .*correct it, or unset it"):
        device.configure_allocator(torch.device("cuda"))
    assert device.configure_allocator(torch.device("cpu")) is None  # off CUDA the variable is not ours to check

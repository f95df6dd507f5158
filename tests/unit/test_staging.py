"""A layer's upload through one reused host buffer (`capture.device.Staging`): the device copy holds the source's
values in the pass's dtype, owns its memory, and the buffer is reused from layer to layer. Page-locking needs CUDA;
the packing, the views and the casts are the same without it."""

from __future__ import annotations

import torch
import torch.nn as nn

from quantize.capture.device import Staging, device_copy


class _Layer(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.a = nn.Linear(width, 3 * width, bias=True)
        self.b = nn.Linear(3 * width, width, bias=False)
        self.register_buffer("steps", torch.arange(5, dtype=torch.int64))
        self.register_buffer("freqs", torch.rand(7, dtype=torch.float32))


def _layer(width: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return _Layer(width).to(torch.bfloat16).requires_grad_(False)


def test_staged_copy_holds_the_values_and_owns_its_memory():
    stage = Staging(pin=False)
    src = _layer(24, 0)
    src.b.weight = nn.Parameter(src.b.weight.detach().t().contiguous().t(), requires_grad=False)  # not contiguous
    cpu = torch.device("cpu")
    copy = device_copy(src, cpu, torch.float32, stage)
    direct = device_copy(src, cpu, torch.float32)
    for (n, p), (_, q), (_, r) in zip(src.named_parameters(), copy.named_parameters(), direct.named_parameters()):
        assert q.dtype == torch.float32 and torch.equal(q, r), n
    for (n, b), (_, c) in zip(src.named_buffers(), copy.named_buffers()):
        assert torch.equal(b.float() if b.is_floating_point() else b, c), n
    assert copy.steps.dtype == torch.int64
    with torch.no_grad():  # the copy is the copy's: writing it leaves the source and the buffer's next use alone
        for q in copy.parameters():
            q.fill_(7.0)
    assert not torch.equal(src.a.weight.float(), copy.a.weight)
    # the non-contiguous weight went the direct way; the rest through the buffer
    held = sum(-(-t.numel() * t.element_size() // Staging.ALIGN) * Staging.ALIGN
               for t in [*src.parameters(), *src.buffers()] if t.is_contiguous())
    assert stage.buffer is not None and stage.buffer.numel() == held


def test_same_dtype_copy_does_not_share_the_buffer():
    stage = Staging(pin=False)
    first = device_copy(_layer(16, 1), torch.device("cpu"), torch.bfloat16, stage)
    kept = {n: p.clone() for n, p in first.named_parameters()}
    device_copy(_layer(16, 2), torch.device("cpu"), torch.bfloat16, stage)  # the next layer overwrites the buffer
    for n, p in first.named_parameters():
        assert torch.equal(p, kept[n]), n


def test_buffer_is_reused_and_grows_to_the_largest_layer():
    stage = Staging(pin=False)
    device_copy(_layer(32, 0), torch.device("cpu"), None, stage)
    buf, size = stage.buffer.data_ptr(), stage.buffer.numel()
    device_copy(_layer(32, 1), torch.device("cpu"), None, stage)
    assert stage.buffer.data_ptr() == buf
    device_copy(_layer(64, 2), torch.device("cpu"), None, stage)
    assert stage.buffer.numel() > size
    big = stage.buffer.numel()
    device_copy(_layer(32, 3), torch.device("cpu"), None, stage)
    assert stage.buffer.numel() == big


def test_device_copy_takes_what_went_through_the_buffer():
    class Marked(Staging):  # hands back its staged tensors negated, to show where each copy came from
        def stage(self, module, device):
            return {k: -t for k, t in super().stage(module, device).items()}

    src = _layer(8, 4)
    copy = device_copy(src, torch.device("cpu"), torch.float32, Marked(pin=False))
    for (n, p), (_, q) in zip(src.named_parameters(), copy.named_parameters()):
        assert torch.equal(q, -p.float()), n
    assert torch.equal(copy.freqs, -src.freqs)


def test_reserve_sizes_the_buffer_for_a_layer_ahead_of_its_upload():
    stage = Staging(pin=False)
    layer = _layer(32, 5)
    stage.reserve(layer)
    buf = stage.buffer.data_ptr()
    copy = device_copy(layer, torch.device("cpu"), None, stage)
    assert stage.buffer.data_ptr() == buf  # the upload used the reserved buffer, not a new one
    assert all(torch.equal(p, q) for p, q in zip(layer.parameters(), copy.parameters()))


def test_a_host_that_cannot_lend_the_memory_gets_direct_copies(monkeypatch, caplog):
    stage = Staging(pin=False)
    real_empty = torch.empty

    def refuse(*args, **kwargs):
        if kwargs.get("pin_memory") is not None:
            raise RuntimeError("CUDA error: out of memory")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", refuse)
    src = _layer(16, 6)
    with caplog.at_level("WARNING"):
        copy = device_copy(src, torch.device("cpu"), torch.float32, stage)
        device_copy(src, torch.device("cpu"), torch.float32, stage)
    assert stage.off and stage.buffer is None
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1  # said once, not per layer
    assert "could not page-lock" in caplog.records[0].message
    for (n, p), (_, q) in zip(src.named_parameters(), copy.named_parameters()):
        assert torch.equal(q, p.float()), n

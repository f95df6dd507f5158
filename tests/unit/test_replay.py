"""OutputReplay: a finished linear's output is computed once per batch and handed back only where computing it
again would give the same tensor."""

from __future__ import annotations

import torch
import torch.nn as nn

from quantize.capture.replay import OutputReplay


class _Layer(nn.Module):
    """a -> b: b's input is a's output, as o_proj's is the attention over q/k/v."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x, scale: float = 1.0, stop: bool = False):
        if stop:  # a forward that ends before its linears (GPTQ's first stage stops at q/k/v's input)
            raise StopIteration
        return self.b(torch.relu(self.a(x)) * scale)


def _counting(layer: _Layer) -> dict[str, int]:
    """Calls that compute (the modules' class forward), per linear."""
    counts = {"a": 0, "b": 0}
    for name in counts:
        fc = getattr(layer, name)

        def forward(x, fc=fc, name=name):
            counts[name] += 1
            return nn.functional.linear(x, fc.weight, fc.bias)
        fc.forward = forward
    return counts


def test_a_frozen_linear_computes_once_per_batch_and_gives_the_same_outputs():
    layer = _Layer()
    counts = _counting(layer)
    batches = [torch.randn(2, 3, 8), torch.randn(2, 3, 8)]
    want = [layer(x) for x in batches]
    replay = OutputReplay(layer, budget=1 << 20)
    replay.freeze(["a"])
    for _ in range(3):
        got = [layer(x) for x in batches]
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert counts == {"a": 2 + 2, "b": 2 + 6}  # before the replay: 2 each; with it: a once per batch
    assert (replay.hits, replay.misses) == (4, 2)
    replay.close()
    assert "forward" not in layer.__dict__ and layer.a.forward.__name__ == "forward"  # the counting one again
    layer(batches[0])
    assert counts["a"] == 5


def test_no_replay_for_another_batch_a_cast_weight_or_a_call_outside_the_layer():
    layer = _Layer()
    counts = _counting(layer)
    x = torch.randn(2, 3, 8)
    replay = OutputReplay(layer, budget=1 << 20)
    replay.freeze(["a"])
    layer(x)
    layer(x.clone())  # equal values, another batch: computed
    assert counts["a"] == 2
    layer.a.weight.data = layer.a.weight.data * 2  # another weight for the same batch: computed again
    assert torch.equal(layer(x), layer.b(torch.relu(nn.functional.linear(x, layer.a.weight, layer.a.bias))))
    assert counts["a"] == 3
    try:
        layer(x, stop=True)
    except StopIteration:
        pass
    z = torch.randn(2, 3, 8)
    assert torch.equal(layer.a(z), nn.functional.linear(z, layer.a.weight, layer.a.bias))  # outside the layer
    assert counts["a"] == 4
    layer.to(torch.float64)  # the pass's float32 retry casts the layer and its inputs: computed in the new dtype
    assert layer(x.double()).dtype == torch.float64 and counts["a"] == 5


def test_an_output_written_in_place_is_computed_again():
    layer = _Layer()
    counts = _counting(layer)
    x = torch.randn(2, 3, 8)

    class _InPlace(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            h = self.inner.a(x)
            h.mul_(2)  # writes the linear's output in place
            return self.inner.b(h)

    outer = _InPlace(layer)
    want = outer(x)
    replay = OutputReplay(outer, budget=1 << 20)
    replay.freeze(["inner.a"])
    assert torch.equal(outer(x), want)
    assert torch.equal(outer(x), want)  # the kept output was doubled in place: computed again, not doubled twice
    assert counts["a"] == 3 and replay.hits == 0
    replay.close()


def test_outputs_past_the_budget_are_computed_as_without_a_replay():
    layer = _Layer()
    counts = _counting(layer)
    batches = [torch.randn(2, 3, 8) for _ in range(3)]
    one = batches[0].shape[0] * batches[0].shape[1] * 8 * 4  # a's float32 output for one batch
    replay = OutputReplay(layer, budget=2 * one)
    replay.freeze(["a"])
    for _ in range(2):
        for x in batches:
            layer(x)
    assert counts["a"] == 3 + 1 and replay.used == 2 * one  # the third batch computed both times
    replay.close()
    assert replay.used == 0 and replay.peak == 2 * one  # what the next layer's replay will ask for again

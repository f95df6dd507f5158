"""The smoke's degenerate-output check blames the quantization only where the unquantized model does not loop
on the same prompt itself."""

from __future__ import annotations

import torch

from eval.smoke import _degenerate, greedy, repeats_like_reference


class _Next(torch.nn.Module):
    """A stand-in causal LM: the next token is f(last token)."""

    def __init__(self, f, vocab=16):
        super().__init__()
        self.f, self.vocab, self.w = f, vocab, torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, use_cache=False):
        logits = torch.zeros(*input_ids.shape, self.vocab)
        for j, t in enumerate(input_ids[0].tolist()):
            logits[0, j, self.f(t) % self.vocab] = 1.0
        return type("Out", (), {"logits": logits})()


def test_greedy_follows_the_reference():
    assert greedy(_Next(lambda t: t + 1), [3], 4) == [4, 5, 6, 7]


def test_a_loop_the_unquantized_model_also_makes_is_not_blamed():
    prompts, gens = [[1], [2]], [[5] * 10, [7] * 10]
    flagged = [(i, _degenerate(g, [])) for i, g in enumerate(gens)]
    assert all(why for _, why in flagged)
    looping = _Next(lambda t: 5)  # the unquantized model says "5 5 5 ..." itself
    assert repeats_like_reference(looping, prompts, gens, flagged) == [0, 1]
    counting = _Next(lambda t: t + 1)  # it does not loop: the quantized output's loop is the quantization's
    assert repeats_like_reference(counting, prompts, gens, flagged) == []

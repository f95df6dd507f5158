"""Compare vLLM's logprobs with a transformers model's on the same token ids."""

from __future__ import annotations

import torch


@torch.no_grad()
def hf_logprobs(model, token_ids: list[list[int]]) -> list[torch.Tensor]:
    """Per prompt: log-softmax of next-token logits [seq, vocab] (row p predicts token p + 1)."""
    out = []
    device = next(model.parameters()).device
    for ids in token_ids:
        logits = model(input_ids=torch.tensor([ids], device=device), use_cache=False).logits[0].float()  # [seq, vocab]
        out.append(torch.log_softmax(logits, dim=-1).cpu())
    return out


def prompt_logprob_delta(vllm_prompt_logprobs: list[list[dict | None]], hf: list[torch.Tensor]) -> dict:
    """Mean and max |Δ logprob| over every (position, top-k token) vLLM reported."""
    deltas = []
    for per_pos, lp in zip(vllm_prompt_logprobs, hf):
        for p, d in enumerate(per_pos):
            if d is None:
                continue
            for tok, v in d.items():
                deltas.append(abs(v - lp[p - 1, int(tok)].item()))
    t = torch.tensor(deltas)
    return {"mean_abs_delta": t.mean().item(), "max_abs_delta": t.max().item(), "n": len(deltas)}

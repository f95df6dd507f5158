"""vLLM smoke-load: the artifact loads, generates non-degenerate text, and agrees with the FP16 model.

Checks (each recorded in the report, any failure fails the smoke test):
(a) vLLM loaded it with the quantization method the artifact declares (and logs which kernel it chose);
(b) greedy output is not degenerate (no empty output, no single token repeated over most of it, finite logprobs);
(c) teacher-forced agreement: feeding the prompt plus vLLM's greedy tokens to the FP16 model, its own top-1
    choice equals vLLM's token at least `min_token_agreement` of the time (no divergence cascade).
"""

from __future__ import annotations

import importlib.util
import json
import math
import platform
from collections.abc import Callable
from pathlib import Path

import torch

from .vllm_run import VllmError, run_vllm

PROMPTS = (
    "The capital of France is",
    "Water boils at a temperature of",
    "def fibonacci(n):\n    ",
    "The three primary colors are",
    "In 1969, the first humans to walk on the Moon were",
    "A haiku about autumn:\n",
)

# what vLLM may report for each quant_method (CPU and CUDA builds pick different names)
METHOD_NAMES = {
    "awq": {"awq", "awq_marlin", "auto_awq"},
    "gptq": {"gptq", "gptq_marlin", "auto_gptq"},
    "compressed-tensors": {"compressed-tensors", "compressed_tensors"},
}


def _degenerate(tokens: list[int], logprobs: list[dict]) -> str | None:
    if not tokens:
        return "empty generation"
    top = max(tokens.count(t) for t in set(tokens))
    if len(tokens) >= 8 and top / len(tokens) > 0.75:
        return f"one token repeated {top}/{len(tokens)} times"
    for d in logprobs:
        if any(not math.isfinite(v) for v in d.values()):
            return "non-finite logprob"
    return None


@torch.no_grad()
def teacher_forced_agreement(reference, prompts: list[list[int]], generations: list[list[int]]) -> float:
    """Fraction of generated positions where the reference model's argmax equals the generated token."""
    hits = total = 0
    device = next(reference.parameters()).device
    for p, g in zip(prompts, generations):
        if not g:
            continue
        ids = torch.tensor([p + g], device=device)
        logits = reference(input_ids=ids, use_cache=False).logits[0]  # [len, vocab]
        pred = logits[len(p) - 1 : len(p) - 1 + len(g)].argmax(-1)  # predicts each generated token
        hits += int((pred == torch.tensor(g, device=device)).sum())
        total += len(g)
    return hits / max(total, 1)


def vllm_unavailable() -> str | None:
    """Why vLLM cannot serve a 4-bit artifact here (the smoke stage is then skipped with this reason), or None.

    vLLM's CPU build picks its kernel library by the CPU's instruction set: only the AVX-512 libraries hold the
    W4A16 GEMM (cpu_gemm_wna16) that AWQ, GPTQ and compressed-tensors weights need, so on an AVX2-only x86 CPU
    every 4-bit load fails inside vLLM's workers. Told here, before a 40 s start that can only fail.
    """
    if importlib.util.find_spec("vllm") is None:
        return "vllm not importable"
    if not torch.cuda.is_available() and platform.machine().lower() in ("x86_64", "amd64") \
            and not torch.cpu._is_avx512_supported():
        return ("vLLM's CPU build runs 4-bit weights only on AVX-512 CPUs (its AVX2 kernels lack cpu_gemm_wna16) "
                "and this CPU has AVX2 only")
    return None


def smoke(artifact: Path, reference: Callable[[], object], tokenizer, dtype: str = "float16", max_tokens: int = 32,
          min_agreement: float = 0.6, timeout: float = 600) -> dict:
    """-> {passed, checks, errors, load_s, tokens_per_s, method, kernels, device, samples}; never raises on a
    vLLM failure.

    vLLM runs first, in a child process, on a device this process holds nothing on; `reference()` (the
    unquantized model, for the agreement check) is called only once vLLM has exited.
    dtype: what vLLM computes in, the artifact's 16-bit dtype (a bfloat16-only model refuses float16).
    """
    qcfg = json.loads((Path(artifact) / "config.json").read_text()).get("quantization_config", {})
    expected = qcfg.get("quant_method")
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    out: dict = {"passed": False, "expected_method": expected, "dtype": dtype, "errors": [], "checks": {}}
    try:
        res = run_vllm(Path(artifact), prompts, top_k=1, max_tokens=max_tokens, timeout=timeout, dtype=dtype)
    except VllmError as e:
        out["errors"].append(str(e))
        out["checks"]["loaded"] = False
        return out
    out["checks"]["loaded"] = True
    method = res.get("quantization")
    out.update(method=method, kernels=res.get("kernels", []), device=res.get("device"),
               load_s=round(res["load_s"], 2),
               tokens_per_s=round(res["generated_tokens"] / max(res["generate_s"], 1e-9), 2))
    ok_method = method in METHOD_NAMES.get(expected, {expected})
    out["checks"]["method"] = ok_method
    if not ok_method:
        out["errors"].append(f"vLLM loaded quantization {method!r}, the artifact declares {expected!r}")
    bad = [(i, why) for i, (g, lp) in enumerate(zip(res["generations"], res["gen_logprobs"]))
           if (why := _degenerate(g, lp))]
    out["checks"]["not_degenerate"] = not bad
    for i, why in bad:
        out["errors"].append(f"prompt {i} ({PROMPTS[i]!r}): degenerate output: {why}")
    agreement = teacher_forced_agreement(reference(), prompts, res["generations"])
    out["token_agreement"] = round(agreement, 4)
    out["checks"]["agreement"] = agreement >= min_agreement
    if agreement < min_agreement:
        out["errors"].append(f"teacher-forced top-1 agreement with the FP16 model {agreement:.3f} < "
                             f"eval.vllm.min_token_agreement {min_agreement}")
    out["samples"] = [{"prompt": p, "completion": tokenizer.decode(g)} for p, g in zip(PROMPTS, res["generations"])]
    out["passed"] = all(out["checks"].values())
    return out

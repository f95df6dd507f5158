"""vLLM smoke-load through the OpenAI-compatible server: the artifact serves, generates non-degenerate text,
and agrees with the FP16 model.

Checks (each recorded in the report, any failure fails the smoke test):
(s) the server starts on the artifact's vllm-serve.yaml; /v1/models lists the served name; a question answers
    with non-empty content, on the chat endpoint when the tokenizer has a chat template and on the completions
    endpoint when it has none (a base model: vLLM's chat endpoint refuses it with HTTP 400); a wrong model name
    gets vLLM's 404 and our message names the right one;
(a) vLLM loaded it with the quantization method the artifact declares (and logs which kernel it chose); on a
    CUDA GPU the kernels it logged are those pre-flight's deployability table predicted for that GPU;
(b) greedy output is not degenerate (no empty output, no single token repeated over most of it, finite logprobs);
(c) teacher-forced agreement: feeding the prompt plus vLLM's greedy tokens to the FP16 model, its own top-1
    choice equals vLLM's token at least `min_token_agreement` of the time (no divergence cascade; a quality gate,
    off where the recipe sets it null);
(d) the same against our own decoding of the artifact, at least `min_decode_agreement` of the time: vLLM's
    kernels compute what the files say (`decode_check`, run by the report once it has loaded the artifact).
On a CUDA GPU the KV cache vLLM allocated is also set beside the capacity arithmetic of the model card
(`capacity_check`: recorded, not a check).
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

import httpx

from quantize import formats
from quantize.export import capacity, serve_config
from quantize.preflight import deploy
from quantize.preflight.deploy import vllm_version

from .serve import INT4_MISSING, Server, ServeError, ask, int4_kernel_missing, post, served_models
from .serving import gpu_share, log_figures
from .vllm_run import VllmError, cuda_build, kernels_from_log, root_cause

PROMPTS = (
    "The capital of France is",
    "Water boils at a temperature of",
    "def fibonacci(n):\n    ",
    "The three primary colors are",
    "In 1969, the first humans to walk on the Moon were",
    "A haiku about autumn:\n",
)

CHAT_PROMPT = "What is the capital of France? Answer in one sentence."
TEXT_PROMPT = "The capital of France is"  # the completions endpoint's question, for a model with no chat template

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
def greedy(reference, prompt: list[int], n: int) -> list[int]:
    """The reference model's own greedy continuation of `prompt`, n tokens (one full forward a token: n is the
    smoke's few dozen)."""
    device = next(reference.parameters()).device
    ids = list(prompt)
    for _ in range(n):
        logits = reference(input_ids=torch.tensor([ids], device=device), use_cache=False).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def repeats_like_reference(reference, prompts: list[list[int]], generations: list[list[int]],
                           flagged: list[tuple[int, str]]) -> list[int]:
    """Of the prompts whose vLLM output looks degenerate, those where the unquantized model's own greedy output
    does too (a small base model that loops on "Paris Paris ..."): that is the model, not the quantization, and
    the agreement check still compares the two."""
    return [i for i, _ in flagged if _degenerate(greedy(reference, prompts[i], len(generations[i])), [])]


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
    """Why vLLM cannot serve a 4-bit artifact here (the smoke stage is then skipped with this reason), or None:
    not installed, or a CPU build whose kernel library for this processor lacks the 4-bit GEMM (AVX2-only
    x86: see `serve.int4_kernel_missing`). Told before a 40 s start that can only fail."""
    if importlib.util.find_spec("vllm") is None:
        return "vllm not importable"
    return int4_kernel_missing()


def smoke(artifact: Path, reference: Callable[[], object], tokenizer, dtype: str = "float16", max_tokens: int = 32,
          min_agreement: float | None = 0.6, timeout: float = 600, predicted: dict | None = None) -> dict:
    """-> {passed, checks, errors, served_name, endpoint, load_s, tokens_per_s, method, kernels, samples, answer};
    never raises on a vLLM failure.

    Goes through what users hit: vLLM's OpenAI-compatible server on the artifact's vllm-serve.yaml, in a child
    process on a device this process holds nothing on. `/v1/models` must list the served name, a question must
    answer (on chat or completions: `serve_config.endpoint`), a wrong model name must get the 404 whose message
    names the right one, and greedy completions of the prompts' token ids feed the checks above. `reference()` (the unquantized model, for the agreement
    check) is called only once the server has exited.
    dtype: what vLLM computes in, the artifact's 16-bit dtype (a bfloat16-only model refuses float16); it equals
    the serve config's for our artifacts. A directory without a serve config (another tool's) is served under
    its directory's name.
    predicted: pre-flight's deployability table as the manifest keeps it ({capability: {tp: kernels}}), checked
    against the kernels vLLM logged where it runs on a CUDA GPU.
    """
    artifact = Path(artifact)
    qcfg = json.loads((artifact / "config.json").read_text()).get("quantization_config", {})
    expected = qcfg.get("quant_method")
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    path = serve_config.endpoint(artifact)
    out: dict = {"passed": False, "expected_method": expected, "dtype": dtype, "errors": [], "checks": {},
                 "endpoint": path, "endpoint_why": serve_config.why_endpoint(path), "vllm_version": vllm_version()}
    extra = {"dtype": dtype} if serve_config.read(artifact) else {"served-model-name": artifact.name,
                                                                   "dtype": dtype, "max-model-len": 512}
    if cuda_build():
        extra["gpu-memory-utilization"] = out["gpu_memory_utilization"] = gpu_share(artifact)
    with tempfile.TemporaryDirectory(prefix="smoke-") as work:
        log = Path(work) / "server.log"
        try:
            with Server(artifact, extra, log=log, timeout=timeout, eager=True) as srv:  # start-up over speed
                out["checks"]["loaded"] = True
                out.update(served_name=srv.name, load_s=srv.load_s)
                res = _ask(srv, prompts, max_tokens, out)
        except VllmError as e:
            out["errors"].append(str(e))
            out["checks"]["loaded"] = False
            return out
        text = log.read_text(errors="replace")
    out.update(method=_method_from_log(text), kernels=kernels_from_log(text), memory=log_figures(text))
    if cuda_build():
        out["capacity_check"] = capacity_check(artifact, out["memory"], out["gpu_memory_utilization"])
    fmt = formats.by_quant_method(expected)
    ok_method = out["method"] in (fmt.reported_as if fmt else {expected})
    out["checks"]["method"] = ok_method
    _check_kernels(out, predicted, (serve_config.read(artifact) or {}).get("tensor-parallel-size", 1))
    if not ok_method:
        out["errors"].append(f"vLLM loaded quantization {out['method']!r}, the artifact declares {expected!r}")
    if res is None:  # a request failed: its reason is in errors, with the server's own lines
        out["errors"].append(root_cause(text))
        if "cpu_gemm_wna16" in text:
            out["errors"].append(INT4_MISSING)
        return out
    out["tokens_per_s"] = round(sum(map(len, res["generations"])) / max(res["generate_s"], 1e-9), 2)
    bad = [(i, why) for i, (g, lp) in enumerate(zip(res["generations"], res["gen_logprobs"]))
           if (why := _degenerate(g, lp))]
    ref = reference()
    if bad:
        as_fp16 = repeats_like_reference(ref, prompts, res["generations"], bad)
        out["degenerate_as_unquantized"] = [PROMPTS[i] for i in as_fp16]
        bad = [(i, why) for i, why in bad if i not in as_fp16]
    out["checks"]["not_degenerate"] = not bad
    for i, why in bad:
        out["errors"].append(f"prompt {i} ({PROMPTS[i]!r}): degenerate output: {why}")
    out["token_ids"] = {"prompts": prompts, "generations": res["generations"]}  # for decode_check, and to replay
    agreement = teacher_forced_agreement(ref, prompts, res["generations"])
    out["token_agreement"] = round(agreement, 4)
    if min_agreement is not None:
        out["checks"]["agreement"] = agreement >= min_agreement
        if agreement < min_agreement:
            out["errors"].append(f"teacher-forced top-1 agreement with the FP16 model {agreement:.3f} < "
                                 f"eval.vllm.min_token_agreement {min_agreement}")
    out["samples"] = [{"prompt": p, "completion": tokenizer.decode(g)} for p, g in zip(PROMPTS, res["generations"])]
    out["passed"] = all(out["checks"].values())
    return out


def decode_check(out: dict, decoded, min_agreement: float) -> None:
    """vLLM's greedy tokens against our own decoding of the artifact (`decoded`, the model the report scores):
    teacher-forced top-1 agreement into out["decode_agreement"] and out["checks"]["decodes_as_ours"], `passed`
    updated. Independent of how good the quantization is: a kernel that reads the layout otherwise than we wrote
    it fails here, on real and random weights alike."""
    ids = out.get("token_ids")
    if not ids:  # the smoke stopped before generating: its errors say why
        return
    agreement = teacher_forced_agreement(decoded, ids["prompts"], ids["generations"])
    out["decode_agreement"] = round(agreement, 4)
    out["checks"]["decodes_as_ours"] = agreement >= min_agreement
    if agreement < min_agreement:
        out["errors"].append(f"teacher-forced top-1 agreement with our own decoding of the artifact {agreement:.3f} "
                             f"< eval.vllm.min_decode_agreement {min_agreement}: vLLM's kernels do not compute what "
                             "the files hold")
    out["passed"] = all(out["checks"].values())


def capacity_check(artifact: Path, memory: dict, utilization: float) -> dict | None:
    """The model card's capacity arithmetic (quantize/export/capacity.py) for the share of this GPU the smoke gave
    vLLM, beside the KV cache vLLM allocated: (utilization x GPU bytes - weight bytes) / KV bytes per token."""
    if not memory.get("kv_cache_tokens"):
        return None
    config = json.loads((artifact / "config.json").read_text())
    kv_dtype = (serve_config.read(artifact) or {}).get("kv-cache-dtype")
    per_token = capacity.kv_bytes_per_token(config, 1 if str(kv_dtype).startswith("fp8") else 2)
    weights = sum(f.stat().st_size for f in artifact.glob("*.safetensors"))
    total = torch.cuda.get_device_properties(0).total_memory
    predicted = int((utilization * total - weights) // per_token)
    vllm_tokens = memory["kv_cache_tokens"]
    return {"gpu": torch.cuda.get_device_name(0), "gpu_total_bytes": total, "gpu_memory_utilization": utilization,
            "weight_bytes": weights, "kv_bytes_per_token": per_token, "predicted_kv_tokens": predicted,
            "vllm_kv_tokens": vllm_tokens, "difference_pct": round(100 * (vllm_tokens - predicted) / predicted, 2)}


def _check_kernels(out: dict, predicted: dict | None, tp: int) -> None:
    """On a CUDA GPU: the kernels vLLM logged against the table's cell for this GPU and tensor-parallel size, into
    out["kernel_check"] and out["checks"]["kernels_as_predicted"] (a disagreement fails the smoke test)."""
    cell = None
    if cuda_build() and predicted:
        capability = "{}.{}".format(*torch.cuda.get_device_capability())
        cell = predicted.get(capability, {}).get(str(tp))
    if cell is None:
        return
    check = kernel_check(out.get("kernels") or [], cell)
    out["kernel_check"] = {"capability": capability, "tp": tp, "predicted": cell, **check}
    out["checks"]["kernels_as_predicted"] = check["agree"]
    if not check["agree"]:
        out["errors"].append(f"vLLM ran {', '.join(check['ran']) or 'no logged kernel'} on this GPU (compute "
                             f"capability {capability}, TP {tp}); pre-flight's deployability table predicted {cell!r}")


def kernel_check(logged: list[str], cell: str) -> dict:
    """vLLM's 'Using <Kernel> for <method>' lines against one cell of the deployability table ('Machete',
    'Machete/Marlin', 'fallback: AWQ GEMM', 'refused') -> {ran: short kernel names, agree}."""
    ran = sorted({deploy.short(line.split(" for ")[0]) for line in logged})
    expected = set(cell.removeprefix("fallback: ").split("/")) if cell != "refused" else set()
    return {"ran": ran, "agree": bool(ran) and set(ran) == expected}


def _ask(srv: Server, prompts: list[list[int]], max_tokens: int, out: dict) -> dict | None:
    """The server-side checks (recorded into out["checks"]) and greedy completions of `prompts`
    -> {generations, gen_logprobs, generate_s}; None once a request fails (the reason in out["errors"])."""
    try:
        names = served_models(srv.url)
        out["checks"]["models_lists_served_name"] = srv.name in names
        if srv.name not in names:
            out["errors"].append(f"/v1/models lists {names}, not the served name {srv.name!r}")
        path = out["endpoint"]
        reply = ask(srv.url, srv.name, path, CHAT_PROMPT, TEXT_PROMPT, max_tokens)
        out["answer"] = {"endpoint": path, "prompt": CHAT_PROMPT if path == serve_config.CHAT else TEXT_PROMPT,
                         "content": reply}
        out["checks"]["answers"] = bool(reply)
        if not reply:
            out["errors"].append(f"the answer on {path} is empty")
        out["checks"]["wrong_name_404"] = _wrong_name_refused(srv, out)
        t0 = time.perf_counter()
        ans = post(srv.url, "/v1/completions", {"model": srv.name, "prompt": prompts, "max_tokens": max_tokens,
                                                "temperature": 0, "logprobs": 1, "return_token_ids": True})
        generate_s = time.perf_counter() - t0
    except (ServeError, httpx.HTTPError) as e:
        out["errors"].append(f"{type(e).__name__}: {e}")
        out["checks"]["requests"] = False
        return None
    choices = sorted(ans["choices"], key=lambda c: c["index"])
    return {"generations": [list(c.get("token_ids") or []) for c in choices],
            "gen_logprobs": [[{"chosen": float("nan") if lp is None else lp} for lp in (c.get("logprobs") or {}).get("token_logprobs") or []]
                             for c in choices],
            "generate_s": generate_s}


def _wrong_name_refused(srv: Server, out: dict) -> bool:
    """A request for a model the server does not serve gets vLLM's 404, and our message names the right one."""
    wrong = f"{srv.name}-not-served"
    try:
        ask(srv.url, wrong, out["endpoint"], CHAT_PROMPT, TEXT_PROMPT, 1)
    except ServeError as e:
        ok = "404" in str(e) and repr(srv.name) in str(e)
        out["wrong_name"] = str(e)
        if not ok:
            out["errors"].append(f"a request for {wrong!r} was refused without naming {srv.name!r}: {e}")
        return ok
    out["errors"].append(f"the server answered a request for model {wrong!r}, which it does not serve")
    return False


def _method_from_log(text: str) -> str | None:
    """The quantization vLLM's engine runs with, from its 'Initializing ... with config: ..., quantization=X' line."""
    found = re.findall(r"quantization=([\w-]+)", text)
    return found[-1] if found and found[-1] != "None" else None  # None: an unquantized model

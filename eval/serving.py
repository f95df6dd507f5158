"""One artifact's serving figures at one concurrency, as `make compare` puts them beside its quality: vLLM's server
on the artifact (its vllm-serve.yaml), vLLM's own serving benchmark run once against it, and the memory figures
vLLM logs while it starts.

    measure(artifact, concurrency, work) -> {output_throughput, p50_ttft_ms, p95_ttft_ms, weights_gib, kv_cache_gib,
                                           kv_cache_tokens, load_s, ..., error: None | why}
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from quantize.export import serve_config

from .bench_serve import INPUT_LEN, OUTPUT_LEN, run_side
from .serve import INT4_MISSING
from .vllm_run import cuda_build

MIN_PROMPTS = 32  # fewer requests make a p95 of little worth
BENCH_FIGURES = ("output_throughput", "request_throughput", "p50_ttft_ms", "p95_ttft_ms", "completed", "failed",
                 "duration")


def num_prompts(concurrency: int) -> int:
    """Requests of one measurement: four rounds of the concurrency, at least MIN_PROMPTS."""
    return max(4 * concurrency, MIN_PROMPTS)


def _last(pattern: str, text: str) -> str | None:
    """The last match of `pattern`'s first group (a server restarted on another port logs into the same file: the
    last start is the one that served)."""
    found = re.findall(pattern, text)
    return found[-1] if found else None


def log_figures(text: str) -> dict:
    """vLLM's start-up log -> {weights_gib, kv_cache_gib, kv_cache_tokens}, None each where no line says it.

    CUDA build: "Model loading took X GiB memory", "Available KV cache memory: X GiB", "GPU KV cache size: N tokens".
    CPU build (0.32): no line gives the weights' memory; "Explicitly set (X/Y) GiB for KV cache" (VLLM_CPU_KVCACHE_SPACE)
    or "Auto set (X/Y) GiB for KV cache", and "CPU KV cache size: N tokens".
    """
    w = _last(r"Model loading took ([\d.]+) GiB", text)
    kv = _last(r"Available KV cache memory: ([\d.]+) GiB", text) or _last(
        r"(?:Explicitly|Auto) set \(([\d.]+)/[\d.]+\) GiB for KV cache", text)
    tok = _last(r"(?:GPU|CPU) KV cache size: ([\d,]+) tokens", text)
    return {"weights_gib": float(w) if w else None, "kv_cache_gib": float(kv) if kv else None,
            "kv_cache_tokens": int(tok.replace(",", "")) if tok else None}


def measure(artifact: Path, concurrency: int, work: Path, timeout: float = 900) -> dict:
    """vLLM's server on `artifact` with its vllm-serve.yaml, vLLM's serving benchmark once at `concurrency` (random
    prompts of INPUT_LEN tokens, OUTPUT_LEN output tokens each, EOS ignored, num_prompts(concurrency) requests),
    then the server stopped -> the figures; a server or benchmark that fails gives `error` (the root cause in its
    output, and why where the 4-bit kernel is missing) and never raises. work: where logs and results go."""
    artifact = Path(artifact)
    n = num_prompts(concurrency)
    label = artifact.name
    extra = {"gpu-memory-utilization": gpu_share(artifact)} if cuda_build() else {}
    side = run_side(artifact, extra, [concurrency], n, INPUT_LEN, OUTPUT_LEN, Path(work), label, timeout)
    log = Path(work) / f"{label}-server.log"
    text = log.read_text(errors="replace") if log.is_file() else ""
    fig = side["levels"].get(concurrency) or {}
    error = side.get("error") or fig.get("error")
    if error and "cpu_gemm_wna16" in text and INT4_MISSING not in error:
        error = f"{error}\n{INT4_MISSING}"
    return {"concurrency": concurrency, "num_prompts": n, "input_len": INPUT_LEN, "output_len": OUTPUT_LEN,
            "served_name": side.get("served_name"), "load_s": side.get("load_s"),
            "gpu_memory_utilization": extra.get("gpu-memory-utilization"),
            **{k: fig.get(k) for k in BENCH_FIGURES}, **log_figures(text), "error": error}


def gpu_share(artifact: Path) -> float:
    """vLLM's gpu_memory_utilization for a server started by this process: the serve config's (vLLM's 0.9 without
    one), lowered to what is free now. vLLM refuses to start when less than that share of the card is free, and
    this process still holds its CUDA context and the quantize stage's cached blocks (released here first)."""
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    wanted = float((serve_config.read(artifact) or {}).get("gpu-memory-utilization", 0.9))
    return round(min(wanted, free / total - 0.03), 3)

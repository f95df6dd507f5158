"""First-use costs of the CUDA path, paid on a background thread while the run tokenizes, loads and captures.

Without it the first decoder layer of a GPU run took 1.5 s with a warm Triton cache and 3.2-4.5 s on a fresh
machine, against 0.5 s for the others (H200, 7B shape): library and kernel loading (cuBLAS, cuSOLVER,
attention), importing triton and, on a fresh machine, compiling the GPTQ sweep kernel.
`start` runs small instances of those calls on a daemon thread as soon as pre-flight has passed; GPTQ `wait`s
for it before its first factorisation (torch loads its CUDA linear-algebra library lazily and not
thread-safely, and the Triton kernel must not be compiled twice at once), and the run waits for it before
returning. A failure here only logs: the run then pays the cost itself. On a fresh machine the Triton compile is
done by a child process the command line starts before it imports torch (`precompile`); the thread waits for
that child before its own GPTQ calls, which then load the kernel from Triton's cache.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import torch
import torch.nn.functional as F

from . import precompile

log = logging.getLogger(__name__)

_thread: threading.Thread | None = None
# What the last warm-up did: when it started and ended (time.time()), the seconds of each part, and how long the
# run's thread waited for it. Empty when none ran.
outcome: dict = {}


def start(device: torch.device, dtype: torch.dtype, gptq_specs: list, head_dim: int | None) -> None:
    """Begin warming `device` (CUDA only) for a pass in `dtype` with these GPTQ specs (`gptq.GptqSpec`)."""
    global _thread
    if device.type != "cuda" or _thread is not None:
        return
    outcome.clear()
    outcome.update(started_at=time.time(), parts_s={}, waited_s=0.0)
    _thread = threading.Thread(target=_warm, args=(device, dtype, gptq_specs, head_dim), name="cuda-warmup",
                               daemon=True)
    _thread.start()


def wait() -> None:
    """Block until the warm-up (if any) has finished; returns at once on the warm-up thread itself."""
    global _thread
    t = _thread
    if t is not None and t is not threading.current_thread():
        t0 = time.perf_counter()
        t.join()
        _thread = None
        if outcome:  # a warm-up `start`ed
            outcome["waited_s"] = round(outcome.get("waited_s", 0.0) + time.perf_counter() - t0, 4)


def head_dim(config) -> int | None:
    c = config.get_text_config()
    heads = getattr(c, "num_attention_heads", None)
    return getattr(c, "head_dim", None) or (c.hidden_size // heads if heads else None)


def sweeps(device: torch.device, gptq_specs: list, generator: torch.Generator | None = None) -> None:
    """One small GPTQ solve per spec on `device`: factorisation and sweep (the Triton compile, on a fresh
    machine). Also what the pre-compile child (`precompile`) runs, so that its compile is this one's."""
    from .gptq import gptq_quantize

    g = generator or torch.Generator(device).manual_seed(0)
    for spec in gptq_specs:
        # sizes with the real ones' divisibility by 16, which Triton specialises its kernel on
        cols = 2 * max(128, spec.block_size, spec.group)
        w = torch.randn(32, cols, device=device, generator=g)
        h = torch.randn(2 * cols, cols, device=device, generator=g)
        gptq_quantize(w, h.t() @ h, spec)


def _warm(device: torch.device, dtype: torch.dtype, gptq_specs: list, head_dim: int | None) -> None:
    t0 = time.perf_counter()
    parts = outcome.setdefault("parts_s", {})

    def part(name: str, t: float) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        now = time.perf_counter()
        parts[name] = round(now - t, 4)
        return now

    try:
        with torch.no_grad(), (torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()):
            t = time.perf_counter()
            g = torch.Generator(device).manual_seed(0)
            x = torch.randn(256, 256, device=device, dtype=dtype, generator=g)
            t = part("context", t)
            F.silu(F.linear(x, x)).float().pow(2).mean(-1).rsqrt()  # a layer's GEMM and elementwise kernels
            if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
                torch.mm(x.t(), x, out_dtype=torch.float32)  # the Hessian GEMM
            t = part("gemm", t)
            if head_dim:
                q = torch.randn(1, 2, 64, head_dim, device=device, dtype=dtype, generator=g)
                F.scaled_dot_product_attention(q, q, q, is_causal=True)
                t = part("attention", t)
            precompile.wait()  # a child compiling the Triton sweep (started by the CLI): load, not compile, it
            t = part("precompile_wait", t)
            sweeps(device, gptq_specs, g)
            part("gptq", t)
        log.debug("CUDA warm-up done in %.2f s", time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001 - a warm-up failure costs only the time it would have saved
        log.warning("CUDA warm-up failed (the run continues and pays the first-use costs itself): %s", e)
    outcome.update(done_at=time.time(), seconds=round(time.perf_counter() - t0, 4))

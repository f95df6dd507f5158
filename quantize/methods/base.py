"""The `Method` every quantization algorithm subclasses: its facts and its per-layer jobs (see methods/__init__.py)."""

from __future__ import annotations

from typing import Any, ClassVar

from ..records import stats_key

PROPAGATIONS = ("fp", "quantized", "none")
# the key of a layer's statistics under which a method reports each linear's relative output error on its
# calibration inputs (`quantize/methods/output_error.py`); the job files these apart, the manifest keeps them as
# `output_error`, the report and model card show the worst
ERRORS = "output_error"  # what a method's layer inputs are (see `Method.propagation`)


class Method:
    """The facts and the per-layer job of one quantization algorithm (subclass it, then `register` one instance)."""

    name: ClassVar[str]  # the recipe's `method:`
    title: ClassVar[str] = ""  # how the model card names it
    options: ClassVar[type | None] = None  # pydantic model of the recipe section `<name>:`; None = no options
    calibrates: ClassVar[bool] = True  # needs calibration text and layer inputs
    default_format: ClassVar[str] = "awq"  # the format `format: auto` writes
    colour: ClassVar[str] = "tab:gray"  # its points in comparison plots
    # its layer jobs report each converted linear's relative output error under ERRORS (what `mixed:` ranks by)
    measures_output_error: ClassVar[bool] = False
    # one of the candidates `method: auto` tries when the recipe lists none (`auto.candidates`)
    auto_default: ClassVar[bool] = True

    def propagation(self, recipe) -> str:
        """What this recipe's layer inputs are: "fp" (the FP model's, shared by every such job in a comparison),
        "quantized" (its own chain of quantized layers) or "none" (no calibration inputs)."""
        return "fp" if self.calibrates else "none"

    def wants_features(self, recipe) -> bool:
        """Whether the capture loop must record the input of every linear (one per shared input) for it."""
        return False

    def wants_fp_features(self, recipe) -> bool:
        """Whether a method with its own chain of quantized layers also needs the inputs its linears see in the
        unquantized model (`capture.LayerData.fp_features`), e.g. to aim at the FP model's outputs."""
        return False

    def wants_fp_outputs(self, recipe) -> bool:
        """Whether a method with its own chain of quantized layers also needs what each decoder layer outputs in
        the unquantized model (`capture.LayerData.fp_outputs`), e.g. as the target of a tuning loss."""
        return False

    def group_sizes(self, recipe) -> dict[str, int]:
        """Group sizes besides q_group_size that this recipe quantizes with somewhere (recipe key -> size): each
        must divide the in_features of every converted linear, as q_group_size must (pre-flight checks both)."""
        return {}

    def at_group_size(self, recipe, group: int):
        """This recipe quantizing at another group size, for `mixed:` (one candidate per size in one pass): every
        tensor outside the converted linears must come out the same at every size, so that a linear quantized at
        one size can stand in for the same linear at another. Here only q_group_size changes."""
        return recipe.model_copy(update={"q_group_size": group, "mixed": None})

    def problem(self, recipe) -> str | None:
        """Why this recipe's settings do not work with this method, saying what to change; None when they do."""
        return None

    def triton_kernels(self, recipe) -> list[dict]:
        """The Triton kernels this recipe's layer jobs launch on CUDA, in the order a layer first launches them:
        each {module: a `quantize.methods` module with a `warm(launch, rows, cols, dtype, device)`, group: the
        recipe's group size, and the settings that module's `warm` reads}. A side process compiles them while the
        run starts (`methods.warmup`); [] = none."""
        return []

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

    @property
    def stats_key(self) -> str:
        """The manifest key holding this method's per-layer statistics."""
        return stats_key(self.name)

    def section(self, recipe) -> Any:
        """This recipe's options for the method (an `options` instance), or None when it has none."""
        return recipe.method_options(self.name) if self.options is not None else None

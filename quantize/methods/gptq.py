"""GPTQ (Frantar et al. 2022): each linear's columns quantized in turn, the error fed back through the inverse
Hessian of its calibration inputs, every layer on the outputs of the already quantized ones.

The method's facts and recipe section (`gptq:`); its per-layer job is `gptq_layer.py`, its maths
`quantize/methods/gptq_sweep.py`.
"""

from __future__ import annotations

from pydantic import Field

from .base import Method
from .options import Strict


class GptqOptions(Strict):
    """GPTQ settings (defaults follow the GPTQ paper / AutoGPTQ)."""

    damp_percent: float = Field(0.01, gt=0, lt=1)  # raised x10 automatically (with a warning) if H is not PD
    act_order: bool = True  # static: columns by descending diag(H), groups kept contiguous
    true_sequential: bool = True  # q/k/v, then o, then gate/up, then down, each on quantized predecessors
    block_size: int = Field(128, gt=0)  # lazy-batch width of the column sweep
    # how far each sweep aims at the unquantized model's outputs rather than at this linear's own outputs on the
    # quantized chain (GPTAQ's asymmetric calibration, Li et al. 2025): before the sweep the weights move this
    # fraction of the way to W·ΔXᵀX̃·(X̃ᵀX̃ + λI)⁻¹ + W, the least-squares fit of the FP outputs W·X on the quantized
    # inputs X̃, so the sweep also undoes the error the quantized layers before it let in. 0 = plain GPTQ.
    # Costs one FP forward of each layer and one more product of the inputs' size per Hessian. Dense linears only:
    # a mixture-of-experts block's experts are swept as plain GPTQ.
    fp_target: float = Field(0.0, ge=0, le=1)


def sweep_kernel(recipe, grid: bool) -> list[dict]:
    """The Triton column sweep's launch settings for this recipe (`Method.triton_kernels`; `gptq_layer.sweep_launch`);
    grid: static groups on a given grid (AWQ's GPTQ rounding), else the `gptq:` section's act_order."""
    if recipe.advanced.gptq.kernel == "torch":
        return []
    from .gptq_layer import sweep_launch

    return [sweep_launch(recipe, grid)]


def block_problem(recipe) -> str | None:
    """The sweep's block and the quantization group must nest (GPTQ proper, and AWQ's GPTQ rounding)."""
    b, g = recipe.gptq.block_size, recipe.q_group_size
    if g != -1 and b % g and g % b:
        return f"gptq.block_size {b} and q_group_size {g}: one must divide the other"
    return None


class Gptq(Method):
    name = "gptq"
    title = "GPTQ"
    options = GptqOptions
    default_format = "gptq"
    colour = "tab:orange"
    measures_output_error = True

    def propagation(self, recipe) -> str:
        return "quantized"

    def problem(self, recipe) -> str | None:
        return block_problem(recipe)

    def wants_fp_features(self, recipe) -> bool:
        return recipe.gptq.fp_target > 0

    def static_act_order(self, recipe) -> bool:
        return recipe.gptq.act_order

    def triton_kernels(self, recipe) -> list[dict]:
        return sweep_kernel(recipe, grid=False)

    def layer(self, data, job) -> dict:
        from . import gptq_layer

        return gptq_layer.gptq_layer(data, job.arch, job.recipe, job.convert, job.scale_dtype, job.results,
                                     job.runlog, job.dist)

    def experts(self, data, job) -> dict:
        from . import gptq_layer

        return gptq_layer.gptq_moe(data, job.arch, job.recipe, job.convert, job.scale_dtype, job.results)


GPTQ = Gptq()

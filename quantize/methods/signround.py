"""SignRound (Cheng et al. 2023, the algorithm of Intel's AutoRound): each decoder layer's rounding and clipping
tuned by signed gradient descent against what the unquantized layer outputs.

Per converted linear it learns a rounding offset V in [-0.5, 0.5] for every weight and a factor in [0, 1] on each
group's min and max; the weight the layer computes with is s·(clamp(round(W/s + V) + z) − z), rounded with a
straight-through gradient. The loss is the mean squared error between the layer run on its quantized chain's
inputs and the unquantized layer's outputs on the FP inputs (so each layer also undoes what the layers before it
let in). Start: round to nearest (V = 0, factors 1); the lowest loss seen is kept, so a layer never ends worse
than its start on the batches it was tuned on. The method's facts and recipe section (`signround:`); its per-layer
job is `signround_layer.py`.
"""

from __future__ import annotations

from pydantic import Field

from .base import Method
from .options import Strict


class SignRoundOptions(Strict):
    """SignRound settings (defaults: AutoRound's own for w4, `auto_round` 0.16 `default` recipe)."""

    iters: int = Field(200, ge=0)  # signed-gradient steps per decoder layer; 0 = round to nearest
    lr: float | None = Field(None, gt=0)  # step size; None = 1 / iters (AutoRound's), decayed linearly to 0
    samples_per_step: int = Field(8, gt=0)  # calibration samples whose losses make one step (whole batches)
    tune_range: bool = True  # also learn each group's min/max factors (AutoRound's minmax tuning)
    seed: int = 0  # the order the calibration batches are visited in


class SignRound(Method):
    name = "signround"
    title = "SignRound"
    options = SignRoundOptions
    default_format = "awq"
    colour = "tab:purple"
    # its tuning steps per layer make it a GPU host's method (README): `method: auto` tries it only where the
    # recipe lists it in auto.candidates
    auto_default = False

    def propagation(self, recipe) -> str:
        return "quantized"

    def wants_fp_outputs(self, recipe) -> bool:
        return True

    def layer(self, data, job) -> dict:
        from . import signround_layer

        return signround_layer.signround_layer(data, job)

    def experts(self, data, job) -> dict:
        from . import signround_layer

        return signround_layer.signround_experts(data, job)


SIGNROUND = SignRound()

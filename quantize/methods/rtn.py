"""Round to nearest: every group's scale and zero from its own min and max, no calibration.

The smallest complete method, and the worked example of docs/METHODS.md: it declares no options and no
calibration, so the capture loop hands it no inputs ("none"), and its jobs round each converted linear of the
decoder layer, then of its experts, on the linear's own min/max grid.
"""

from __future__ import annotations

from .base import Method


class Rtn(Method):
    name = "rtn"
    title = "round to nearest"
    calibrates = False
    default_format = "awq"

    def layer(self, data, job) -> dict:
        from .layer import local_linears, qspec, round_to_nearest

        names = local_linears(job.arch, data.index, job.convert)
        round_to_nearest(data.layer, names, qspec(job.recipe), job.scale_dtype, job.prefix(data.index), job.results)
        return {}

    def experts(self, data, job) -> dict:
        from .layer import moe_linears, qspec, round_to_nearest

        names = moe_linears(data.layer, job.arch, data.index, job.convert)
        round_to_nearest(data.layer, names, qspec(job.recipe), job.scale_dtype, job.prefix(data.index), job.results)
        return {}


RTN = Rtn()

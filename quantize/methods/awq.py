"""AWQ (Lin et al. 2023): activation-aware scales folded into the preceding op, clip search, then rounding.

The method's facts and recipe section (`awq:`); its per-layer job is `awq_layer.py`, its maths `quantize/methods/awq_search.py`.
AWQ's GPTQ rounding (`awq.rounding: gptq`) is an option of this method: it reads the `gptq:` section's settings.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Method
from .gptq import block_problem, sweep_kernel
from .options import Strict


class AwqOptions(Strict):
    """AWQ search settings (grid, clip and propagation defaults follow AutoAWQ 0.2.9).

    search_tokens is justified in docs/BENCHMARKS.md; `search_tokens: null` (with advanced.awq.coarse_step 1,
    its default) is AutoAWQ's exhaustive search over every calibration token.
    """

    n_grid: int = Field(20, gt=1)  # ratios α = i / n_grid, i = 0 .. n_grid - 1
    duo_scaling: bool = True
    apply_clip: bool = True
    clip_grid: int = Field(20, gt=1)
    max_shrink: float = Field(0.5, gt=0, lt=1)
    propagate: Literal["fp", "quantized"] = "fp"  # which layer output feeds the next layer's calibration
    # grid loss measured on a seeded random subset of whole calibration batches holding at least this many
    # tokens (null = every token); mean|X| always uses every token
    search_tokens: int | None = Field(16384, gt=0)
    # screening, for a search through a whole block (attention, MLP): every ratio's loss on the first half of
    # those tokens, then only α = 0 and the screen_keep ratios least there on the rest; null = every ratio on
    # every token. The pick is the exhaustive search's wherever that is among those kept: with 7 (of 20) it was
    # in every block search of every shipped AWQ recipe (their weights are the exhaustive search's; with 6, one
    # did not), for fewer block forwards (docs/BENCHMARKS.md, "AWQ's block searches screened on half their tokens")
    screen_keep: int | None = Field(7, gt=0)
    # the group size the scale search fake-quantizes its candidates with (null: q_group_size). Recipes that set
    # the same value and differ only in q_group_size (or in settings the search does not read: the clip,
    # rounding, format) run one scale search between them in a comparison (`make compare`); each variant's
    # weights are still those of its run alone. Not a default: another group size's search can help or hurt
    # perplexity, by model and group size (docs/BENCHMARKS.md, "Three AWQ group sizes on one scale search")
    search_group_size: Literal[32, 64, 128] | None = None
    # clip candidates: "symmetric" = AutoAWQ's ±max|w| shrink; "per_side" adds shrinking max and min on their
    # own (zero-point grids; a symmetric grid depends on max|w| alone, so there both are the same search).
    # per_side + refit_iters 2: lower perplexity for a longer clip search, a small share of the AWQ stage
    # (docs/BENCHMARKS.md, "Quality: AWQ on SmolLM2-135M and Gemma 3 270M")
    clip_search: Literal["symmetric", "per_side"] = "per_side"
    # least-squares refits of each group's scale to its codes on the group output error (0 = off; a group
    # keeps a refit scale only where it lowers that error)
    refit_iters: int = Field(2, ge=0)
    # how codes are chosen on the clip grid: round to nearest, or GPTQ's error feedback through the scaled
    # inputs' Hessian (settings from the `gptq:` section; static groups, so the format is unchanged). Not the
    # default: better on SmolLM2 (23.61 vs 23.92), worse on Gemma 3 270M (30.65 vs 29.97), and it adds a Hessian
    # and a GPTQ sweep per linear to every layer (timed by bench/gpu_bench.py --only ours-awq,ours-awq-gptq)
    rounding: Literal["rtn", "gptq"] = "rtn"

    def search_group(self, q_group_size: int) -> int:
        """The group size the scale search quantizes its candidates with, for a recipe of q_group_size."""
        return q_group_size if self.search_group_size is None else self.search_group_size


class Awq(Method):
    name = "awq"
    title = "AWQ"
    options = AwqOptions
    default_format = "awq"
    colour = "tab:blue"
    measures_output_error = True

    def propagation(self, recipe) -> str:
        return recipe.awq.propagate

    def wants_features(self, recipe) -> bool:
        return True

    def group_sizes(self, recipe) -> dict[str, int]:
        g = recipe.awq.search_group_size
        return {} if g is None or g == recipe.q_group_size else {"awq.search_group_size": g}

    def at_group_size(self, recipe, group: int):
        # the scale search at the base size's search group for every size: the scales folded into the norms and
        # the previous linears are then one set, and the sizes differ only in clip and rounding
        awq = recipe.awq.model_copy(update={"search_group_size": recipe.awq.search_group(recipe.q_group_size)})
        return super().at_group_size(recipe, group).model_copy(update={"awq": awq})

    def problem(self, recipe) -> str | None:
        if recipe.q_group_size == -1:  # the scale, clip and refit searches all work on groups of a fixed size
            return ("method awq takes q_group_size 32, 64 or 128, not -1 (per channel); for per-channel codes use "
                    "method gptq or rtn")
        if recipe.awq.rounding == "gptq":
            return block_problem(recipe)
        return None

    def triton_kernels(self, recipe) -> list[dict]:
        o, fast = recipe.awq, recipe.advanced.awq
        q = {"group": recipe.q_group_size, "w_bit": recipe.w_bit, "symmetric": recipe.symmetric}
        out = []
        if fast.search_kernel != "torch":  # block groups' candidates, then single linears' ΔW
            sq = {**q, "group": recipe.awq.search_group(recipe.q_group_size)}
            out += [{"module": "awq_fq_triton", **sq, "delta": False}, {"module": "awq_fq_triton", **sq, "delta": True}]
        if o.apply_clip and fast.clip_kernel != "torch":
            out.append({"module": "awq_clip_triton", **q, "n_grid": o.clip_grid, "max_shrink": o.max_shrink,
                        "per_side": o.clip_search == "per_side"})
        return out + (sweep_kernel(recipe, grid=True) if o.rounding == "gptq" else [])

    def layer(self, data, job) -> dict:
        from . import awq_layer

        return awq_layer.awq_layer(data, job.arch, job.recipe, job.convert, job.scale_dtype, job.results, job.runlog,
                                   job.dist)

    def experts(self, data, job) -> dict:
        from . import awq_layer

        return awq_layer.awq_moe(data, job.arch, job.recipe, job.convert, job.scale_dtype, job.results)


AWQ = Awq()

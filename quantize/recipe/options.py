"""The recipe's sections (calibration, eval, serve, MoE, advanced) as strict schema classes, and the constants
they check against."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from ..errors import UserError
from ..methods.options import Strict

GROUP_SIZES = (-1, 32, 64, 128)  # -1 = per output channel (formats/ says which take it)
AUTO = "auto"  # the `method:` that picks one of the registered methods per model (`AutoOptions`)


class RecipeError(UserError, ValueError):
    """A recipe a user wrote is wrong; the message says what to change."""


class Calibration(Strict):
    """Which text calibrates the activations, and how much of it."""

    dataset: str = "groups-merged"  # groups-merged | wikitext2 (bundled) | pileval | a hub id (hub only) | a local file
    n_samples: int = Field(128, gt=0)
    seq_len: int = Field(512, gt=0)
    seed: int = 0
    split: str | None = None  # hub datasets only; default per dataset
    text_column: str = "text"
    subset: str | None = None  # hub dataset configuration name (e.g. wikitext-2-raw-v1)


MIN_EXPERT_TOKENS = 128  # one GPTQ block / AWQ group of columns sees at least this many samples


class MoeOptions(Strict):
    """Mixture-of-experts calibration (models with experts only; see docs/MOE.md).

    Each routed expert is calibrated on the tokens the router sends to it. An expert that receives fewer than
    min_expert_tokens of the calibration tokens is calibrated on every calibration token instead (its Hessian and
    activation statistics would be too thin: with none, GPTQ would write all-zero weights); the manifest lists
    every expert's routed token count and which experts took this rule.
    """

    min_expert_tokens: int = Field(MIN_EXPERT_TOKENS, ge=0)


class MixedOptions(Strict):
    """A budgeted mixed group size (docs/METHODS.md, "Mixed group sizes under a budget"): every converted linear is
    quantized at base_group and at each finer and coarser size in one pass; then, from every linear at the
    coarsest size (base_group where no coarser one is listed), the linears whose relative output error a finer
    size lowers most per extra stored bit move to it, while the quantized linears' bits per weight (what
    comparisons call "bits / weight") stay within the budget. Linears vLLM fuses (q/k/v, gate/up) move together.
    Written as compressed-tensors, one config group per size."""

    base_group: Literal[32, 64, 128]  # must equal q_group_size
    budget_bits_per_weight: float = Field(gt=0)
    finer: tuple[Literal[32, 64], ...] = Field(min_length=1)  # each below base_group
    # each above base_group (-1 = one group per output channel): sizes a linear may fall back to where the budget
    # is below what base_group stores everywhere, so that the budget goes where a finer size pays most
    coarser: tuple[Literal[-1, 64, 128], ...] = ()

    @field_validator("finer", "coarser")
    @classmethod
    def _distinct(cls, v: tuple[int, ...], info) -> tuple[int, ...]:
        if len(set(v)) != len(v):
            raise ValueError(f"mixed.{info.field_name} {list(v)} lists a size twice")
        return tuple(sorted(v, key=coarseness, reverse=True))

    @property
    def sizes(self) -> tuple[int, ...]:
        """Every group size a linear may get: base first, then finer ones coarsest first, then coarser ones."""
        return (self.base_group, *self.finer, *self.coarser)

    @property
    def ladder(self) -> tuple[int, ...]:
        """Every group size a linear may get, coarsest (where each linear starts) to finest."""
        return tuple(sorted(self.sizes, key=coarseness, reverse=True))


def coarseness(group: int) -> float:
    """Columns per group, for ordering sizes: -1 (one group per output channel) is coarser than any size."""
    return float("inf") if group == -1 else group


class AutoOptions(Strict):
    """`method: auto` (docs/METHODS.md, "Choosing the method by held-out KL"): every candidate method is quantized in
    one shared pass on the recipe's calibration samples, then each is scored by the mean KL divergence of its
    next-token distributions from the unquantized model's on `holdout_samples` further samples of the same
    calibration text (drawn after the ones the methods fit on, never the evaluation text); the lowest wins."""

    candidates: tuple[str, ...] | None = None  # None = every shipped method that is a default candidate and fits
    holdout_samples: int = Field(16, gt=0)  # seq_len-token blocks after the n_samples the methods fit on

    @field_validator("candidates")
    @classmethod
    def _distinct(cls, v: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if v is not None and not v:
            raise ValueError("auto.candidates is empty; list at least one method, or leave the key out for the "
                             "defaults")
        if v is not None and len(set(v)) != len(v):
            raise ValueError(f"auto.candidates {list(v)} lists a method twice")
        return v


class AdvancedAwq(Strict):
    """AWQ search-speed experiments."""

    # 1 = every grid point; k > 1 = every k-th, then refine by halving steps (k=4 missed the grid minimum of
    # attention groups, whose loss is not unimodal in α: +0.07 ppl on SmolLM2, see docs/BENCHMARKS.md)
    coarse_step: int = Field(1, gt=0)
    grid_batch: int = Field(4, gt=0)  # candidates per matmul in single-linear groups (memory knob, exact)
    clip_kernel: Literal["auto", "torch", "triton"] = "auto"  # clip search; auto = triton on CUDA when it imports
    # the scale search's fake-quantization of each candidate; auto = triton on CUDA when it imports (the same
    # values as torch's, in one pass over the weights instead of a dozen)
    search_kernel: Literal["auto", "torch", "triton"] = "auto"
    # the dtype of the scale search's block forwards (torch.autocast): auto = bfloat16 where the compute dtype is
    # float32 on a CPU with AMX tiles (its bf16 matmuls run ~6x faster than float32; quality in
    # docs/BENCHMARKS.md), else the compute dtype; compute = always the compute dtype
    search_dtype: Literal["auto", "compute", "bfloat16"] = "auto"


class AdvancedGptq(Strict):
    """GPTQ sweep-speed experiments."""

    kernel: Literal["auto", "torch", "triton"] = "auto"  # column sweep; auto = triton on CUDA when it imports
    # the sweep's cross-block update: float32, or tf32 operands (10-bit mantissa; tensor cores on CUDA, emulated
    # elsewhere). An approximation: its quality and speed are measured in docs/BENCHMARKS.md
    update: Literal["float32", "tf32"] = "float32"


class Advanced(Strict):
    """Speed experiments, not quality settings: the defaults are the plain algorithm (module docstring), except
    `awq.search_dtype: auto`, which on a float32 CPU run with AMX ranks AWQ's candidates in bfloat16."""

    awq: AdvancedAwq = AdvancedAwq()
    gptq: AdvancedGptq = AdvancedGptq()


class PerplexityOptions(Strict):
    """Perplexity protocol (defaults = the GPTQ/AWQ papers': WikiText-2 test, 2048-token windows)."""

    dataset: str = "wikitext2"  # wikitext2 | a local .txt path
    seq_len: int = Field(2048, gt=1)
    max_windows: int | None = Field(None, gt=0)  # None = every full window


class VllmSmokeOptions(Strict):
    enabled: bool = True
    timeout_s: int = Field(600, gt=0)
    max_tokens: int = Field(32, gt=0)
    # teacher-forced top-1 agreement of vLLM's greedy tokens with the FP16 model (a quality gate: null turns it off,
    # as for random-init weights, whose near-chaotic outputs no 4-bit copy follows)
    min_token_agreement: float | None = Field(0.6, ge=0, le=1)
    # ... and with our own decoding of the artifact (a correctness check: vLLM's kernels read what we wrote)
    min_decode_agreement: float = Field(0.75, ge=0, le=1)


class LmEvalOptions(Strict):
    """lm-evaluation-harness tasks, scored on both models in the eval stage (eval/lmeval.py). Shipped tasks
    (eval/tasks/: hellaswag_local, wikitext_continuation) need no network; any other lm-eval task needs its data."""

    tasks: tuple[str, ...] = ()
    limit: int | None = Field(None, gt=0)  # the first documents of each task (None = all)
    # a fixed subset of each task's documents, spread evenly over it (document i * n // subset for i < subset), the
    # same for every model, so their per-document outcomes pair up; None = every document
    subset: int | None = Field(None, gt=0)
    vllm: bool = True  # also score the artifact through lm-eval's vLLM backend where vLLM can serve it
    timeout_s: int = Field(1800, gt=0)  # the vLLM backend's child process

    @model_validator(mode="after")
    def _one_selection(self) -> LmEvalOptions:
        if self.limit is not None and self.subset is not None:
            raise ValueError(f"eval.lm_eval has both limit ({self.limit}) and subset ({self.subset}); keep one: "
                             f"subset (documents spread over the whole task) or limit (its first documents)")
        return self


# Default distribution gates: a healthy 4-bit artifact passes them, one damaged linear fails them
# (docs/BENCHMARKS.md: SmolLM2-135M, measured figures)
MAX_KL = 0.5
MIN_TOP1 = 0.6


class EvalOptions(Strict):
    """What `make eval` measures, and the gates that fail it."""

    enabled: bool = True  # make quantize runs eval unless false
    perplexity: PerplexityOptions = PerplexityOptions()
    max_ppl_delta: float | None = Field(None, ge=0)  # quantized ppl - FP16 ppl
    max_ppl_delta_pct: float | None = Field(None, ge=0)  # 100 * delta / FP16 ppl
    # per-token KL(reference || quantized) on the perplexity windows, mean in nats (eval/distribution.py)
    max_kl: float | None = Field(MAX_KL, ge=0)
    min_top1: float | None = Field(MIN_TOP1, ge=0, le=1)  # share of tokens whose most likely next token agrees
    vllm: VllmSmokeOptions = VllmSmokeOptions()
    lm_eval: LmEvalOptions = LmEvalOptions()


# vLLM 0.32's --kv-cache-dtype choices for dense models (config/cache.py CacheDType); "auto" = the model dtype
KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc")
SERVED_NAME = r"^[A-Za-z0-9][A-Za-z0-9._/:-]*$"


# GPU generations vLLM serves 4-bit weights on (compute capability), as pre-flight's deployability table lists them
SERVE_CAPABILITIES = ("7.5", "8.0", "8.6", "8.9", "9.0", "10.0", "12.0")


class ServeTarget(Strict):
    """A GPU generation and tensor-parallel size the artifact must be served at on a Marlin-class kernel."""

    compute_capability: float  # 9.0 = Hopper (H100/H200); pre-flight refuses a target vLLM would serve slower
    tensor_parallel_size: int = Field(1, gt=0)

    @field_validator("compute_capability")
    @classmethod
    def _cc(cls, v: float) -> float:
        if f"{v:.1f}" not in SERVE_CAPABILITIES:
            raise ValueError(f"serve.targets compute_capability {v} is not one vLLM lists; use one of "
                             f"{', '.join(SERVE_CAPABILITIES)}")
        return v

    @field_validator("tensor_parallel_size")
    @classmethod
    def _tp(cls, v: int) -> int:
        if v not in (1, 2, 4, 8):
            raise ValueError(f"serve.targets tensor_parallel_size {v} must be 1, 2, 4 or 8")
        return v

    @property
    def capability(self) -> str:
        return f"{self.compute_capability:.1f}"


class ServeOptions(Strict):
    """How the artifact is served (written to its vllm-serve.yaml) and benchmarked (`make bench-serve`).

    Shapes are checked against the model in pre-flight: tensor_parallel_size must be one of the sizes every
    layer divides into, max_model_len at most the model's max_position_embeddings.
    """

    served_model_name: str | None = None  # None = the recipe name
    max_model_len: int | None = Field(None, gt=0)  # None = the model's max_position_embeddings
    tensor_parallel_size: int = Field(1, gt=0)
    kv_cache_dtype: str | None = None  # None = vLLM's default (the model dtype)
    concurrency: tuple[int, ...] = (1, 8, 32)  # make bench-serve's levels (requests in flight)
    # GPUs the artifact must serve on with a Marlin-class kernel (pre-flight refuses otherwise); () = print the
    # deployability table and warn
    targets: tuple[ServeTarget, ...] = ()

    @field_validator("served_model_name")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        if v is not None and not re.match(SERVED_NAME, v):
            raise ValueError(f"serve.served_model_name {v!r} must start with a letter or digit and hold only "
                             f"letters, digits and . _ / : - (clients send it as the request's `model`)")
        return v

    @field_validator("kv_cache_dtype")
    @classmethod
    def _kv(cls, v: str | None) -> str | None:
        if v is not None and v not in KV_CACHE_DTYPES:
            raise ValueError(f"serve.kv_cache_dtype {v!r} is not a vLLM KV-cache dtype; use one of "
                             f"{list(KV_CACHE_DTYPES)} or leave it out")
        return v

    @field_validator("tensor_parallel_size")
    @classmethod
    def _tp(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"serve.tensor_parallel_size {v} must be a power of two (1, 2, 4, 8)")
        return v

    @field_validator("concurrency")
    @classmethod
    def _levels(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if not v or any(c <= 0 for c in v) or len(set(v)) != len(v):
            raise ValueError(f"serve.concurrency {list(v)} must list distinct positive request counts, "
                             f"e.g. [1, 8, 32]")
        return tuple(sorted(v))

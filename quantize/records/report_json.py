"""report.json, written by eval: perplexity, distribution, lm-eval and the vLLM smoke, and the gates on them."""

from __future__ import annotations

from typing import Any, ClassVar

from .base import Num, Record
from .manifest_json import AutoChoice


class PplSide(Record):
    ppl: float
    tokens: int | None = None
    seconds: Num | None = None


class Protocol(Record):
    """The perplexity protocol as recorded (`eval.perplexity.protocol_record`)."""

    dataset: str
    seq_len: int
    max_windows: int | None = None
    join: str | None = None
    add_bos: bool | None = None
    stride: str | None = None
    tail: str | None = None
    source: str
    text_sha256: str
    windows: int
    tokens_scored: int


class Perplexity(Record):
    protocol: Protocol
    fp16: PplSide
    quantized: PplSide
    delta: float
    delta_pct: float


class WorstWindow(Record):
    window: int
    kl_mean: float
    top1: float


class Distribution(Record):
    """KL(reference || quantized) over the reference's top-k and top-1 agreement (`eval.distribution`)."""

    k: int
    tokens: int
    kl_mean: float
    kl_median: float | None = None
    kl_p99: float
    kl_max: float | None = None
    top1: float
    tail_mass_mean: float | None = None
    kl_gap_bound_mean: float | None = None
    worst_windows: list[WorstWindow] = []


class Gates(Record):
    max_ppl_delta: Num | None = None
    max_ppl_delta_pct: Num | None = None
    max_kl: Num | None = None
    min_top1: Num | None = None
    failures: list[str] = []
    passed: bool


class ErrorRow(Record):
    layer: int
    linear: str
    error: float


class ScoredOn(Record):
    device: str
    dtype: str
    windows_per_forward: int | None = None
    reference_cache: dict[str, Any] = {}
    host_rss_peak_bytes: int | None = None
    host_rss_peak_scope: str | None = None
    device_peak_bytes: int | None = None


class Smoke(Record):
    """The vLLM smoke-load (`eval.smoke`): `skipped` with its reason, or the checks that ran."""

    OPEN: ClassVar[bool] = True  # the server side records what it met (answers, refusals) as it goes
    skipped: str | None = None
    passed: bool | None = None
    expected_method: str | None = None
    dtype: str | None = None
    errors: list[str] = []
    checks: dict[str, bool] = {}
    endpoint: str | None = None
    endpoint_why: str | None = None
    served_name: str | None = None
    load_s: Num | None = None
    method: str | None = None
    kernels: list[str] | None = None
    tokens_per_s: Num | None = None
    token_agreement: Num | None = None
    decode_agreement: Num | None = None  # against our own decoding of the artifact (absent in older reports)
    token_ids: dict[str, list[list[int]]] | None = None  # the prompts' ids and vLLM's greedy tokens
    memory: dict[str, Num | None] | None = None  # what vLLM logged: weights_gib, kv_cache_gib, kv_cache_tokens
    capacity_check: dict[str, Any] | None = None  # on a CUDA GPU: the card's arithmetic beside vLLM's KV tokens
    gpu_memory_utilization: Num | None = None
    kernel_check: dict[str, Any] | None = None
    samples: list[dict[str, str]] = []
    answer: dict[str, Any] | None = None
    wrong_name: str | None = None
    vllm_version: str | None = None  # the vLLM the smoke ran under (absent in reports written before it was kept)


class LmScores(Record):
    """One side's lm-eval scores (task -> metric -> value), or why that side has none."""

    scores: dict[str, dict[str, Num]] = {}
    # per document, in doc_id order: {task: {"doc_id": [...], metric: [...]}} (absent in older reports)
    outcomes: dict[str, dict[str, list[Num]]] = {}
    seconds: Num | None = None
    cached: bool | None = None  # the reference's scores came from the reference cache
    error: str | None = None
    exit_code: int | None = None
    exit: str | None = None  # the vLLM child's abort after it wrote its scores (they stand)
    skipped: str | None = None


class Paired(Record):
    """The quantized model's score minus the reference's over the same documents, with the paired stderr
    (`eval.lmeval.paired_difference`)."""

    delta: float
    stderr: float
    n: int
    distinguishable: bool  # |delta| > 1.96 stderr


class LmEval(Record):
    """lm-eval's record (`eval.lmeval`): `skipped` with its reason, or both models' scores and their difference."""

    skipped: str | None = None
    tasks: list[str] | None = None
    limit: int | None = None
    subset: int | None = None
    not_run: dict[str, str] = {}
    load_s: Num | None = None
    reference: LmScores | None = None
    quantized: LmScores | None = None
    difference: dict[str, dict[str, Num | None]] = {}
    paired: dict[str, dict[str, Paired]] = {}  # task -> metric (absent in older reports)
    vllm: LmScores | None = None


class Report(Record):
    """report.json: the eval of one artifact (`eval.report.evaluate`)."""

    artifact: str | None = None
    manifest_verified: bool | None = None
    files_scored: str | None = None  # `manifest.files_fingerprint` of the files this eval scored
    base_model: str | None = None
    reference_dtype: str | None = None
    scored_on: ScoredOn | None = None
    date: str
    machine: str
    perplexity: Perplexity | None = None
    distribution: Distribution | None = None
    gates: Gates | None = None
    output_error_worst: list[ErrorRow] | None = None
    auto: AutoChoice | None = None  # `method: auto`'s choice, from the manifest (its candidates' held-out KLs)
    vllm_smoke: Smoke
    lm_eval: LmEval | None = None
    quantize_timings_s: dict[str, Num] | None = None
    eval_timings_s: dict[str, Num] | None = None
    passed: bool

    @property
    def failures(self) -> list[str]:
        """Why the eval failed: the gates' failures, then the smoke test's errors."""
        return (self.gates.failures if self.gates else []) + self.vllm_smoke.errors

"""The records an artifact carries across package lines, as schema classes: the manifest (manifest.json, written
by quantize) and the eval report (report.json, written by eval), read by the model card, the registry, compare
and the eval through attributes rather than string keys.

The JSON is the shape the artifacts on disk and in registries hold, key for key and in the same order, so they
read and verify as they are; `to_json()` of a record read from a file is that file's object again
(tests/golden/records pins it). No schema version field: a change of shape adds one, with a reader for the shape
before it.

Unknown keys: every record keeps them (`extra="allow"`) and writes them back where they stood. An artifact
written by an older or a newer version must still read, verify and register here: refusing a key this version
does not know would lock users out of their own artifacts, and dropping it would change the bytes a registry
version's manifest_sha256 pins. What we write ourselves is held strict instead: `undeclared()` names any key no
class declares, and the writers refuse to write one (a typo in a writer fails its first test, not a user's run).
Absent keys stay absent: a field the writer did not set is not written as null (`exclude_unset`).
"""

from __future__ import annotations

from typing import Any, ClassVar, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_serializer, model_validator

Num = Union[int, float]  # kept as written: an int re-serialised as a float would change the file's bytes


def stats_key(method: str) -> str:
    """The manifest key holding method `method`'s per-layer statistics (readable without the method registered)."""
    return f"{method}_stats"


class Record(BaseModel):
    """A JSON object of an artifact as attributes, written back with its keys in the order they were given."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    OPEN: ClassVar[bool] = False  # its undeclared keys are content (a recipe's settings), not a writer's typo
    WHAT: ClassVar[str] = ""  # what an error calls the file it came from (default: the class name)
    _keys: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="wrap")
    @classmethod
    def _remember_order(cls, data: Any, handler):
        rec = handler(data)
        if isinstance(data, dict):
            rec._keys = list(data)
        return rec

    @model_serializer(mode="wrap")
    def _in_given_order(self, handler) -> dict:
        out = handler(self)
        first = {k: out[k] for k in self._keys if k in out}
        return {**first, **{k: v for k, v in out.items() if k not in first}}  # keys set later go last

    @classmethod
    def of(cls, data):
        """A record from itself or from its JSON object (the dicts tests and older callers hand in)."""
        return data if isinstance(data, cls) else cls.model_validate(data)

    def to_json(self) -> dict:
        """The JSON object: the keys given, in their order, unknown ones included, unset ones left out."""
        return self.model_dump(mode="python", by_alias=True, exclude_unset=True)

    def written(self):
        """This record, checked before it is written: a key no record class declares is a writer's mistake."""
        stray = self.undeclared()
        if stray:
            raise TypeError(f"{type(self).__name__} written with keys no record declares: {stray}; declare them "
                            f"in quantize/records.py")
        return self

    def undeclared(self, where: str = "") -> list[str]:
        """Keys no class declares, by dotted path, in this record and the records it holds (OPEN ones excepted)."""
        out = [] if self.OPEN else [f"{where}{k}" for k in self.model_extra or {}]
        for name in (n for n in type(self).model_fields if n in self.model_fields_set):
            for key, value in _children(getattr(self, name)):
                if isinstance(value, Record):
                    out += value.undeclared(f"{where}{name}{key}.")
        return out


def _children(value) -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        return [(f"[{k!r}]", v) for k, v in value.items()]
    if isinstance(value, list):
        return [(f"[{i}]", v) for i, v in enumerate(value)]
    return [("", value)]


# ------------------------------------------------------------------------------------------------ the manifest

class FormatRecord(Record):
    name: str  # the recipe's `format:` (quantize/formats)
    quant_method: str  # what config.json's quantization_config declares to vLLM


class RecipeSnapshot(Record):
    """The resolved recipe (`Recipe.to_dict()`): the keys readers use declared, every other setting kept."""

    OPEN: ClassVar[bool] = True
    name: str | None = None
    method: str
    w_bit: int
    q_group_size: int
    zero_point: bool
    dtype: str
    modules_to_not_convert: list[str] = []
    serve: dict[str, Any] | None = None
    mixed: dict[str, Any] | None = None  # the recipe's `mixed:` block where it has one


class ModelRecord(Record):
    spec: str  # the recipe's `model` as given: a Hub id, a path, a GGUF
    resolved: str | None = None  # the local directory it was read from
    kind: str | None = None
    gguf_sha256: str | None = None
    architecture: list[str] | None = None
    tie_word_embeddings: bool | None = None
    license: str | None = None


class Calibration(Record):
    OPEN: ClassVar[bool] = True  # the calibration loader's provenance (source, hashes) may grow
    dataset: str
    n_samples: int
    seq_len: int
    seed: int


class Deploy(Record):
    """Pre-flight's deployability table: the kernel vLLM runs per compute capability and tensor-parallel size."""

    OPEN: ClassVar[bool] = True
    dtype: str
    source: str
    kernels: dict[str, dict[str, str]]


class Capacity(Record):
    """What serving the artifact costs in GPU memory (`quantize.export.capacity.facts`)."""

    max_model_len: int
    parameters: int
    base_weight_bytes: int
    artifact_weight_bytes: int
    bits_per_weight: Num | None = None
    size_vs_base: Num | None = None
    kv_bytes_per_token: dict[str, int]
    kv_bytes_per_sequence: dict[str, int]
    gpu_memory_utilization: Num
    sequences_that_fit: dict[str, dict[str, int]]


class Mixed(Record):
    """A mixed group size's choice (`quantize.mixed`): the budget, what it reached, each linear's size and its
    relative output error at every size (layer -> linear -> ...), as the manifest's `mixed`."""

    base_group: int
    finer: list[int]
    budget_bits_per_weight: Num
    bits_per_weight: Num  # reached: bytes of the quantized linears x 8 / their weights, as compare measures it
    bits_per_weight_at: dict[str, Num]  # group size -> the same with every linear at that size
    weights: int  # quantized weights
    linears: dict[str, int]  # group size -> linears written at it
    error_sum: dict[str, Num]  # group size (and "chosen") -> the summed relative output error of every linear
    objective: str
    groups: dict[str, dict[str, int]]
    errors: dict[str, dict[str, dict[str, Num]]]


class Experts(Record):
    """One MoE layer's routing record inside a method's statistics."""

    OPEN: ClassVar[bool] = True  # a method adds its own figures (a GPTQ loss) beside the counts
    tokens: int
    routed_tokens: list[int]
    min_expert_tokens: int
    calibrated_on_all_tokens: list[int]


class FileRecord(Record):
    sha256: str
    bytes: int


class ReportHashes(Record):
    """The manifest's record of the eval: each report file's sha256 and whether the eval passed."""

    report_json: str | None = Field(None, alias="report.json")
    report_md: str | None = Field(None, alias="report.md")
    passed: bool | None = None

    def hashes(self) -> dict[str, str]:
        """Every report file the manifest vouches for -> its sha256 (one a newer version adds included)."""
        return {k: v for k, v in self.to_json().items() if k != "passed"}


class Seal(Record):
    """The part of a manifest that closes the artifact, every file's sha256 and the report's: all that
    `manifest.verify` reads, so an artifact of any version that wrote these verifies (and a registered version
    resolves) whatever the rest of its manifest holds."""

    WHAT: ClassVar[str] = "manifest"
    files: dict[str, FileRecord] = {}
    report: ReportHashes | None = None


class Manifest(Record):
    """manifest.json: what was made, from what, how, and the sha256 of every file (`quantize.manifest`).

    The method's per-layer statistics sit under a key the method names (`awq_stats`, `gptq_stats`, ...): read
    them with `stats`. At export the card is rendered from a manifest without `files` yet."""

    artifact: str
    format: FormatRecord
    recipe: RecipeSnapshot
    model: ModelRecord
    calibration: Calibration | None = None
    quantized_modules: int | None = None
    unconverted: list[str] | None = None
    copied_unchanged: list[str] | None = None
    notes: list[str] | None = None
    skipped_linears: dict[str, str] | None = None
    tensor_parallel_sizes: list[int] | None = None
    deploy: Deploy | None = None
    serve: dict[str, Any] | None = None  # vllm-serve.yaml's settings, flag name -> value
    serve_endpoint: str | None = None
    capacity: Capacity | None = None
    output_error: dict[str, dict[str, Num]] | None = None  # layer -> linear -> relative output error
    mixed: Mixed | None = None  # several group sizes under a budget: what was chosen (`quantize.mixed`)
    shared_pass: dict[str, Any] | None = None
    device: str | None = None
    compute_dtype: str | None = None
    cuda_allocator: Any = None
    versions: dict[str, Any] | None = None  # package -> version where it was quantized
    cpu: dict[str, Any] | None = None  # the processor it was made on, for the card's CPU serve advice (cpu_serve)
    git: dict[str, Any] | None = None
    timings_s: dict[str, Num] | None = None
    stage_parts_s: dict[str, dict[str, Num]] | None = None  # stage -> part -> seconds (`runner.Timings.laps`)
    pass_seconds: dict[str, Num] | None = None
    distributed: dict[str, Any] | None = None
    expert_plot: str | None = None
    error_plot: str | None = None
    files: dict[str, FileRecord] = {}
    report: ReportHashes | None = None

    @property
    def stats_key(self) -> str:
        return stats_key(self.recipe.method)

    @property
    def stats(self) -> dict[str, dict[str, Any]]:
        """The method's per-layer statistics, layer index -> record; {} when the manifest holds none."""
        return (self.model_extra or {}).get(self.stats_key) or {}

    def undeclared(self, where: str = "") -> list[str]:
        return [k for k in super().undeclared(where) if k != f"{where}{self.stats_key}"]

    def expert_layers(self) -> list[tuple[int, Experts]]:
        """[(layer index, its routing record)] in layer order; [] for a dense model."""
        return sorted((int(i), Experts.of(s["experts"])) for i, s in self.stats.items() if "experts" in s)


# -------------------------------------------------------------------------------------------------- the report

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
    seconds: Num | None = None
    cached: bool | None = None  # the reference's scores came from the reference cache
    error: str | None = None
    exit_code: int | None = None
    exit: str | None = None  # the vLLM child's abort after it wrote its scores (they stand)
    skipped: str | None = None


class LmEval(Record):
    """lm-eval's record (`eval.lmeval`): `skipped` with its reason, or both models' scores and their difference."""

    skipped: str | None = None
    tasks: list[str] | None = None
    limit: int | None = None
    not_run: dict[str, str] = {}
    load_s: Num | None = None
    reference: LmScores | None = None
    quantized: LmScores | None = None
    difference: dict[str, dict[str, Num | None]] = {}
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
    vllm_smoke: Smoke
    lm_eval: LmEval | None = None
    quantize_timings_s: dict[str, Num] | None = None
    eval_timings_s: dict[str, Num] | None = None
    passed: bool

    @property
    def failures(self) -> list[str]:
        """Why the eval failed: the gates' failures, then the smoke test's errors."""
        return (self.gates.failures if self.gates else []) + self.vllm_smoke.errors

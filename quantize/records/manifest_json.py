"""manifest.json, written by quantize: what was quantized from what, how, and the files it holds."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field

from .base import Num, Record, stats_key


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
    coarser: list[int] = []  # sizes above the base a linear may fall back to (-1 = per channel); [] where none
    bits_per_weight: Num  # reached: bytes of the quantized linears x 8 / their weights, as compare measures it
    bits_per_weight_at: dict[str, Num]  # group size -> the same with every linear at that size
    weights: int  # quantized weights
    linears: dict[str, int]  # group size -> linears written at it
    error_sum: dict[str, Num]  # group size (and "chosen") -> the summed relative output error of every linear
    objective: str
    groups: dict[str, dict[str, int]]
    errors: dict[str, dict[str, dict[str, Num]]]


class AutoCandidate(Record):
    """One candidate of `method: auto`: how it scored on the held-out samples and what it cost."""

    method: str
    format: str  # the format it was written in (its own default under `format: auto`)
    kl_mean: Num | None  # mean per-token KL(FP || candidate), nats, over the FP model's top-k (a lower bound)
    top1: Num | None  # share of held-out tokens whose most likely next token agrees with the FP model's
    quantize_s: Num  # its own share of the shared layer-by-layer pass
    score_s: Num  # loading its decoded weights and scoring them
    problem: str | None = None  # why it could not be chosen (a KL that is not finite)


class AutoChoice(Record):
    """`method: auto`'s choice (`pipeline.auto`): every candidate's held-out KL and seconds, which won and why, the
    held-out samples (rows after the ones the methods fit on) and the whole cost, as the manifest's `auto`."""

    chosen: str
    why: str  # "lowest held-out KL", or the tie it broke
    candidates: list[AutoCandidate]
    left_out: dict[str, str]  # default candidates this recipe cannot write -> why
    holdout: dict[str, Any]  # first_sample, n_samples, seq_len, tokens, samples_sha256, top_k
    pass_s: Num  # the run of every candidate: pre-flight, load, the shared pass, every candidate's export
    reference_s: Num  # the FP model loaded and scored on the held-out samples
    seconds: Num  # the whole choice: pass, reference, every candidate's score


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
    auto: AutoChoice | None = None  # `method: auto`: the method chosen, every candidate's score and seconds
    shared_pass: dict[str, Any] | None = None
    device: str | None = None
    compute_dtype: str | None = None
    cuda_allocator: Any = None
    versions: dict[str, Any] | None = None  # package -> version where it was quantized
    cpu: dict[str, Any] | None = None  # the processor it was made on, for the card's CPU serve advice (cpu_serve)
    git: dict[str, Any] | None = None
    timings_s: dict[str, Num] | None = None
    stage_parts_s: dict[str, dict[str, Num]] | None = None  # stage -> part -> seconds (`runlog.Timings.laps`)
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

    def group_text(self) -> str:
        """The group size its linears got: the recipe's, or for a mixed artifact each size used, e.g. "64+32" or
        "64+32+channel" (-1, one group per output channel)."""
        if self.mixed is None:
            return str(self.recipe.q_group_size)
        x = self.mixed
        return "+".join("channel" if g == -1 else str(g) for g in [x.base_group, *x.finer, *x.coarser]
                        if x.linears.get(str(g)))

    def expert_layers(self) -> list[tuple[int, Experts]]:
        """[(layer index, its routing record)] in layer order; [] for a dense model."""
        return sorted((int(i), Experts.of(s["experts"])) for i, s in self.stats.items() if "experts" in s)

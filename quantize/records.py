"""The records that cross package lines: an artifact's manifest (written by quantize) and its eval report (written
by eval), as schema classes that every reader goes through: the model card, the registry, compare and eval.

The JSON keeps the shape artifacts have always had, so an artifact written (and registered) before these
classes existed verifies and reads as it is: `record_version` is absent there and read as 1. A later change of
shape raises RECORD_VERSION and adds a reader for the previous shape to `_upgrade`. Keys a record does not
model are kept as they are (`extra="allow"`) and written back unchanged: a reader never drops what a newer
writer added, and `raw` gives the JSON object itself for the few places that walk every key.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from .methods.base import stats_key

RECORD_VERSION = 1  # the shape of manifest.json and report.json described here


class _Record(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True, protected_namespaces=())

    @property
    def raw(self) -> dict[str, Any]:
        """The record as its JSON object (modelled and unmodelled keys alike)."""
        return self.model_dump(mode="json", by_alias=True, exclude_unset=True)


# ---- manifest ------------------------------------------------------------------------------------------------

class RecipeRecord(_Record):
    """The resolved recipe as the artifact records it (recipe.yaml); the keys every reader uses are typed."""

    name: str
    method: str
    w_bit: int
    q_group_size: int
    zero_point: bool
    dtype: str
    modules_to_not_convert: list[str] = Field(default_factory=list)
    serve: dict[str, Any] = Field(default_factory=dict)


class ModelRecord(_Record):
    """The base model: how the recipe named it, where it was read from, what it is."""

    spec: str
    resolved: str | None = None
    kind: str | None = None
    gguf_sha256: str | None = None
    architecture: list[str] | None = None
    tie_word_embeddings: bool | None = None
    license: str | None = None


class FormatRecord(_Record):
    name: str
    quant_method: str


class FileRecord(_Record):
    sha256: str
    bytes: int


class Manifest(_Record):
    """manifest.json: what the artifact is, how it was made, and the sha256 of every file it holds."""

    record_version: int = RECORD_VERSION
    artifact: str
    format: FormatRecord
    recipe: RecipeRecord
    model: ModelRecord
    calibration: dict[str, Any] | None = None
    quantized_modules: int | None = None
    skipped_linears: dict[str, str] = Field(default_factory=dict)
    tensor_parallel_sizes: list[int] | None = None
    device: str | None = None
    compute_dtype: str | None = None
    versions: dict[str, Any] = Field(default_factory=dict)
    git: dict[str, Any] = Field(default_factory=dict)
    timings_s: dict[str, float] = Field(default_factory=dict)
    files: dict[str, FileRecord] = Field(default_factory=dict)
    report: dict[str, Any] | None = None  # the eval report's files' sha256 and whether it passed, once evaluated

    @property
    def stats(self) -> dict[str, Any]:
        """The method's per-layer statistics (key `<method>_stats`), {} when there are none."""
        return (self.model_extra or {}).get(stats_key(self.recipe.method)) or {}

    @property
    def size_bytes(self) -> int:
        return sum(f.bytes for f in self.files.values())

    @property
    def evaluated(self) -> bool:
        return self.report is not None

    @property
    def report_passed(self) -> bool:
        return bool((self.report or {}).get("passed"))


# ---- report --------------------------------------------------------------------------------------------------

class PerplexityScore(_Record):
    ppl: float
    tokens: int | None = None
    seconds: float | None = None


class PerplexityRecord(_Record):
    protocol: dict[str, Any]
    fp16: PerplexityScore
    quantized: PerplexityScore
    delta: float
    delta_pct: float


class Gates(_Record):
    passed: bool
    failures: list[str] = Field(default_factory=list)


class Smoke(_Record):
    """The vLLM smoke-load: skipped (with why), or what vLLM did with the artifact."""

    skipped: str | None = None
    passed: bool | None = None
    method: str | None = None
    token_agreement: float | None = None
    load_s: float | None = None
    tokens_per_s: float | None = None
    errors: list[str] = Field(default_factory=list)
    checks: dict[str, bool] = Field(default_factory=dict)

    @property
    def ran(self) -> bool:
        return self.skipped is None


class Report(_Record):
    """report.json: both models scored under one protocol, the gates, the vLLM smoke-load, timings."""

    record_version: int = RECORD_VERSION
    artifact: str
    base_model: str
    date: str
    machine: str
    passed: bool
    files_scored: str | None = None
    manifest_verified: bool | None = None
    reference_dtype: str | None = None
    scored_on: dict[str, Any] | None = None
    perplexity: PerplexityRecord
    gates: Gates
    vllm_smoke: Smoke
    lm_eval: dict[str, Any] | None = None
    quantize_timings_s: dict[str, float] | None = None
    eval_timings_s: dict[str, float] = Field(default_factory=dict)

    @property
    def failures(self) -> list[str]:
        """Every reason the eval failed: its gates', then the smoke-load's."""
        return [*self.gates.failures, *self.vllm_smoke.errors]


def _upgrade(data: dict[str, Any]) -> dict[str, Any]:
    """A record of any shape this version reads -> the current shape (version 1 is the first: nothing to do)."""
    version = data.get("record_version", 1)
    if version > RECORD_VERSION:
        raise ValueError(f"record_version {version} is newer than this quantize reads ({RECORD_VERSION}); "
                         f"upgrade quantize")
    return data


def manifest(data: dict[str, Any]) -> Manifest:
    """A manifest.json object -> Manifest (ValueError, pydantic's, when it lacks what every manifest holds)."""
    return Manifest.model_validate(_upgrade(data))


def report(data: dict[str, Any]) -> Report:
    """A report.json object -> Report."""
    return Report.model_validate(_upgrade(data))

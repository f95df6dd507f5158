"""Recipe schema: one YAML file per artifact, validated before any model loads.

A recipe names the model, the method and its settings, the calibration text and the output format.
`base: <recipe>` inherits another recipe and overrides keys (nested mappings merge key by key), so a
group-size family is a few small files. Unknown keys, bad values and combinations vLLM cannot serve are
refused with a message that names the key, the value and what is allowed.

Settings that say what the artifact is or how good it is (method, bits, group size, symmetry, calibration, the
AWQ and GPTQ settings of the papers and of AutoAWQ, incl. awq.search_tokens, whose default already subsamples)
are top-level keys and sections. Speed experiments are under `advanced:`: their defaults are the plain
algorithm, and changing one trades quality for time or changes only time and memory, as docs/BENCHMARKS.md
measured for each:
  advanced.awq.coarse_step   coarse-to-fine over the ratio grid (k = 4 missed the grid minimum: +0.07 ppl)
  advanced.awq.grid_batch    candidates per matmul in single-linear groups (memory; exact)
  advanced.gptq.kernel       the column sweep's implementation: auto (Triton on CUDA) | torch | triton (same codes)
  advanced.gptq.update       the sweep's cross-block update in float32 or in TF32 operands (an approximation)
"""

from __future__ import annotations

import itertools
import math
import re
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from . import formats, methods
from .errors import UserError, did_you_mean
from .methods.awq import AwqOptions
from .methods.gptq import GptqOptions

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"

GROUP_SIZES = (-1, 32, 64, 128)  # -1 = per output channel (formats/ says which take it)


class RecipeError(UserError, ValueError):
    """A recipe a user wrote is wrong; the message says what to change."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Calibration(_Strict):
    """Which text calibrates the activations, and how much of it."""

    dataset: str = "groups-merged"  # groups-merged | wikitext2 (bundled) | pileval | a hub id (hub only) | a local file
    n_samples: int = Field(128, gt=0)
    seq_len: int = Field(512, gt=0)
    seed: int = 0
    split: str | None = None  # hub datasets only; default per dataset
    text_column: str = "text"
    subset: str | None = None  # hub dataset configuration name (e.g. wikitext-2-raw-v1)


MIN_EXPERT_TOKENS = 128  # one GPTQ block / AWQ group of columns sees at least this many samples


class MoeOptions(_Strict):
    """Mixture-of-experts calibration (models with experts only; see docs/MOE.md).

    Each routed expert is calibrated on the tokens the router sends to it. An expert that receives fewer than
    min_expert_tokens of the calibration tokens is calibrated on every calibration token instead (its Hessian and
    activation statistics would be too thin: with none, GPTQ would write all-zero weights); the manifest lists
    every expert's routed token count and which experts took this rule.
    """

    min_expert_tokens: int = Field(MIN_EXPERT_TOKENS, ge=0)


class AdvancedAwq(_Strict):
    """AWQ search-speed experiments."""

    # 1 = every grid point; k > 1 = every k-th, then refine by halving steps (k=4 missed the grid minimum of
    # attention groups, whose loss is not unimodal in α: +0.07 ppl on SmolLM2, see docs/BENCHMARKS.md)
    coarse_step: int = Field(1, gt=0)
    grid_batch: int = Field(4, gt=0)  # candidates per matmul in single-linear groups (memory knob, exact)


class AdvancedGptq(_Strict):
    """GPTQ sweep-speed experiments."""

    kernel: Literal["auto", "torch", "triton"] = "auto"  # column sweep; auto = triton on CUDA when it imports
    # the sweep's cross-block update: float32, or tf32 operands (10-bit mantissa; tensor cores on CUDA, emulated
    # elsewhere). An approximation: its quality and speed are measured in docs/BENCHMARKS.md
    update: Literal["float32", "tf32"] = "float32"


class Advanced(_Strict):
    """Speed experiments, not quality settings: the defaults are the plain algorithm (module docstring)."""

    awq: AdvancedAwq = AdvancedAwq()
    gptq: AdvancedGptq = AdvancedGptq()


class PerplexityOptions(_Strict):
    """Perplexity protocol (defaults = the GPTQ/AWQ papers': WikiText-2 test, 2048-token windows)."""

    dataset: str = "wikitext2"  # wikitext2 | a local .txt path
    seq_len: int = Field(2048, gt=1)
    max_windows: int | None = Field(None, gt=0)  # None = every full window


class VllmSmokeOptions(_Strict):
    enabled: bool = True
    timeout_s: int = Field(600, gt=0)
    max_tokens: int = Field(32, gt=0)
    min_token_agreement: float = Field(0.6, ge=0, le=1)  # teacher-forced top-1 agreement with the FP16 model


class LmEvalOptions(_Strict):
    """lm-evaluation-harness tasks, scored on both models in the eval stage (eval/lmeval.py). Shipped tasks
    (eval/tasks/, e.g. wikitext_continuation) need no network; any other lm-eval task needs its data."""

    tasks: tuple[str, ...] = ()
    limit: int | None = Field(None, gt=0)  # documents per task (None = all)
    vllm: bool = True  # also score the artifact through lm-eval's vLLM backend where vLLM can serve it
    timeout_s: int = Field(1800, gt=0)  # the vLLM backend's child process


# Default distribution gates: a healthy 4-bit artifact passes them, one damaged linear fails them
# (docs/BENCHMARKS.md: SmolLM2-135M, measured figures)
MAX_KL = 0.5
MIN_TOP1 = 0.6


class EvalOptions(_Strict):
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


class ServeTarget(_Strict):
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


class ServeOptions(_Strict):
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


class Recipe(_Strict):
    """A validated recipe. Field names map 1:1 to the YAML keys."""

    name: str
    base: str | None = None
    description: str = ""
    model: str
    method: str  # a registered method (quantize/methods): awq | gptq | rtn
    w_bit: int = 4
    q_group_size: int = 128
    zero_point: bool = True  # AutoAWQ's key; false = symmetric (code inside the package says `symmetric`)
    format: Literal[("auto", *formats.NAMES)] = "auto"  # auto: the method's default format
    version: str = "gemm"  # AWQ kernel layout (format awq)
    on_indivisible: Literal["error", "skip"] = "error"  # a layer whose in_features the group size does not divide
    calibration: Calibration = Calibration()
    # the built-in methods' sections, declared so that they keep their place in recipe.yaml; a method registered
    # beside them brings its own section, validated by its `options` model and kept in `sections`
    awq: AwqOptions = AwqOptions()
    gptq: GptqOptions = GptqOptions()
    sections: dict[str, Any] = Field(default_factory=dict, exclude=True)
    eval: EvalOptions = EvalOptions()
    serve: ServeOptions = ServeOptions()
    modules_to_not_convert: tuple[str, ...] = ("lm_head",)
    dtype: Literal["float16", "bfloat16"] = "float16"
    compute_dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    batch_size: int = Field(8, gt=0)  # calibration samples per forward
    max_shard_size: str = "2GB"  # shards are hashed in parallel at export and at every verify: ~1 s each
    # per-layer checkpoints (resume after a crash or kill): saved after a layer once this many seconds have
    # passed since the last save; 0 = after every layer; null = never
    checkpoint_every_s: float | None = Field(120.0, ge=0)
    trust_remote_code: bool = False
    advanced: Advanced = Advanced()
    moe: MoeOptions | None = None  # mixture-of-experts settings; None = the defaults (`MoeOptions`)

    @model_validator(mode="before")
    @classmethod
    def _method_sections(cls, data: Any) -> Any:
        """Move the sections of registered methods that are not declared fields into `sections`."""
        if not isinstance(data, dict) or "sections" in data:
            return data
        own = {n: data[n] for n in methods.names() if n not in cls.model_fields and n in data}
        return {**{k: v for k, v in data.items() if k not in own}, "sections": own} if own else data

    @field_validator("method")
    @classmethod
    def _method(cls, v: str) -> str:
        if v not in methods.REGISTRY:
            raise ValueError(f"method {v!r} is unknown; use one of {methods.names()}")
        return v

    @field_validator("q_group_size")
    @classmethod
    def _group(cls, v: int) -> int:
        if v not in GROUP_SIZES:
            raise ValueError(f"q_group_size {v} is not allowed; use one of {list(GROUP_SIZES)}")
        return v

    @field_validator("max_shard_size")
    @classmethod
    def _shard(cls, v: str) -> str:
        parse_size(v)
        return v

    @property
    def served_name(self) -> str:
        """The model name clients send to the server: serve.served_model_name, else the recipe name."""
        return self.serve.served_model_name or self.name

    @property
    def symmetric(self) -> bool:
        """No zero points: every group's zero is 2^(b-1). The one place the recipe's `zero_point` is turned
        into the name (and polarity) the code uses."""
        return not self.zero_point

    @property
    def out_format(self) -> str:
        """The on-disk format actually written."""
        return methods.get(self.method).default_format if self.format == "auto" else self.format

    @property
    def static_act_order(self) -> bool:
        """Columns are quantized in activation order with groups kept contiguous (what the formats record)."""
        return methods.get(self.method).static_act_order(self)

    @model_validator(mode="after")
    def _served_by_vllm(self) -> "Recipe":
        problem = formats.get(self.out_format).problem(self)
        if problem:
            raise ValueError(problem)
        if self.advanced.awq.coarse_step >= self.awq.n_grid:
            raise ValueError(f"advanced.awq.coarse_step {self.advanced.awq.coarse_step} must be below awq.n_grid "
                             f"{self.awq.n_grid} (1 evaluates every grid point)")
        for name, given in self.sections.items():
            if name not in methods.REGISTRY or name in type(self).model_fields:
                raise ValueError("key `sections` is not a recipe key; write a method's options under its name")
            try:
                methods.get(name).options(**(given or {}))
            except ValidationError as e:
                raise ValueError(f"`{name}`: " + "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}"
                                                        for x in e.errors())) from None
        problem = methods.get(self.method).problem(self)
        if problem:
            raise ValueError(problem)
        return self

    def method_options(self, name: str) -> Any:
        """The options section of registered method `name` (its `options` model, defaults where not given)."""
        if name in type(self).model_fields:
            return getattr(self, name)
        return methods.get(name).options(**self.sections.get(name, {}))

    def to_dict(self) -> dict[str, Any]:
        """The resolved recipe as plain data (what the artifact records); `moe` only when it was set."""
        d = self.model_dump(mode="json")
        if d["moe"] is None:
            del d["moe"]
        if self.sections:  # a registered method's own section, after the built-in ones
            keys = list(d)
            at = keys.index("gptq") + 1
            own = {n: self.method_options(n).model_dump(mode="json") for n in self.sections}
            d = {**{k: d[k] for k in keys[:at]}, **own, **{k: d[k] for k in keys[at:]}}
        return d

    @property
    def moe_options(self) -> MoeOptions:
        return self.moe or MoeOptions()


def parse_size(text: str) -> int:
    """'4GB' / '500MB' / '2GiB' -> bytes."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
    t = str(text).strip().upper()
    for unit in sorted(units, key=len, reverse=True):
        if t.endswith(unit):
            num = t[: -len(unit)].strip()
            try:
                value = float(num) * units[unit]
            except ValueError:
                break
            if not math.isfinite(value) or value < 1:  # inf/nan/0 bytes: no shard size
                break
            return int(value)
    raise ValueError(f"size {text!r} is not understood; write a finite size of at least 1 byte, like '4GB', "
                     f"'500MB' or '2GiB'")


def recipe_path(name_or_path: str | Path) -> Path:
    """A recipe name (`recipes/<name>.yaml`) or a path to a YAML file -> the file."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml"):
        if not p.is_file():
            near = did_you_mean(p.name, [x.name for x in p.parent.glob("*.y*ml")]) if p.parent.is_dir() else ""
            raise RecipeError(f"recipe file {p} does not exist{near}")
        return p
    candidate = RECIPES_DIR / f"{name_or_path}.yaml"
    if not candidate.is_file():
        hint = did_you_mean(name_or_path, list_recipes()) or "; `python -m pipeline list` lists the shipped recipes"
        raise RecipeError(f"no recipe named {name_or_path!r} (looked for {candidate}){hint} (or give a path to "
                          f"a .yaml file)")
    return candidate


def list_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def model_beside(model: str, recipe_file: Path) -> str:
    """A recipe's `model` that is a relative path -> that path resolved against the recipe file's directory, so
    a recipe means the same model from any working directory; anything else (a hub id, package:, an absolute
    path) unchanged. Relative: it starts with ./ or ../, or names a file or directory beside the recipe."""
    if model.startswith(("package:", "/", "~")):
        return model
    beside = recipe_file.resolve().parent / model
    if model.startswith(("./", "../")) or beside.exists():
        return str(beside.resolve())
    return model


def _merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


class _Refused(yaml.YAMLError):
    """A YAML construct recipes do not allow; the message is one line with its position."""


class _RecipeLoader(yaml.SafeLoader):
    """yaml's safe loader, stricter: no aliases (`*a`: expansion can be exponential, and `base:` is how recipes
    share keys) and no duplicate keys (YAML would keep the last one silently)."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            line = self.peek_event().start_mark.line + 1
            raise _Refused(f"line {line}: aliases (*name) are not allowed in a recipe; write the value out, or "
                           f"share keys with `base: <recipe>`")
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        first: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if not isinstance(key, (str, int, float, bool, type(None))):
                raise _Refused(f"line {line}: a recipe key must be a plain name")
            if key in first:
                raise _Refused(f"line {line}: key {_short(key)} is given twice in the same mapping (first on line "
                               f"{first[key]}); keep one")
            first[key] = line
        return super().construct_mapping(node, deep)


def _short(value: Any, limit: int = 80) -> str:
    """repr(value) for a message, never longer than `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _read_raw(path: Path, seen: tuple[Path, ...]) -> dict:
    """A recipe file's mapping, merged over its `base:` chain; seen: the chain so far, as resolved paths (a file
    respelled through `..` is still the same file, and must be caught as a loop, not followed until the path is
    too long)."""
    try:
        real = path.resolve()
    except OSError as e:
        raise RecipeError(f"{_short(str(path))}: cannot be read ({e.strerror}); give `base:` as a recipe name or "
                          f"a short path to a YAML file") from None
    if real in seen:
        chain = " -> ".join(p.stem for p in (*seen, real))
        raise RecipeError(f"recipe inheritance loops: {chain}; remove one of the `base:` keys")
    seen = (*seen, real)
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_RecipeLoader)  # noqa: S506 - a safe loader
    except OSError as e:
        raise RecipeError(f"{_short(str(path))}: cannot be read ({e.strerror}); check the recipe's path and its "
                          f"`base:`") from None
    except UnicodeDecodeError as e:
        raise RecipeError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); save the recipe as UTF-8") from None
    except _Refused as e:
        raise RecipeError(f"{path}: {e}") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise RecipeError(f"{path}{where}: not valid YAML: {_short(e.problem or e.context, 200)}") from None
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: not valid YAML: {_short(str(e), 200)}") from None
    if not isinstance(raw, dict):
        raise RecipeError(f"{path}: a recipe must be a YAML mapping of keys to values")
    if isinstance(raw.get("model"), str):
        raw["model"] = model_beside(raw["model"], path)
    if raw.get("name") != path.stem:
        raise RecipeError(
            f"{path}: key `name` is {_short(raw.get('name'))} but must equal the file stem {path.stem!r}"
        )
    base = raw.get("base")
    if base is None:
        return raw
    if not isinstance(base, str) or not base.strip():
        raise RecipeError(f"{path}: `base` is {_short(base)} but must be one recipe name or YAML path (a string); "
                          f"a recipe inherits from one base, which may itself have a `base:`")
    sibling = path.parent / (base if base.endswith((".yaml", ".yml")) else f"{base}.yaml")
    try:
        parent_path = sibling if sibling.is_file() else recipe_path(base)
    except OSError as e:
        raise RecipeError(f"{path}: `base` {_short(base)} cannot be read ({e.strerror}); give it as a recipe name "
                          f"or a short path to a YAML file") from None
    parent = _read_raw(parent_path, seen)
    return _merge(parent, raw)


def _format_error(path: Path, err: ValidationError, what: str = "recipe") -> str:
    lines = [f"{path}: {what} is invalid:"]
    for e in err.errors():
        key = ".".join(str(x) for x in e["loc"])[:120] or "(recipe)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            allowed = _allowed_keys(e["loc"])
            msg = f"unknown key{did_you_mean(e['loc'][-1], allowed)}; allowed keys here: {', '.join(allowed)}"
        value = e.get("input")
        shown = "" if e["type"] in ("missing", "extra_forbidden") or isinstance(value, dict) else f" = {_short(value)}"
        lines.append(f"  - `{key}`{shown}: {msg}")
    return "\n".join(lines)


def _allowed_keys(loc: tuple) -> list[str]:
    model: type[BaseModel] = Recipe
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        ann = getattr(field, "annotation", None)
        for option in (ann, *typing.get_args(ann)):  # `X | None` sections (moe) name their keys too
            if isinstance(option, type) and issubclass(option, BaseModel):
                model = option
                break
    return sorted(k for k, f in model.model_fields.items() if not f.exclude)  # `sections` is internal


def load_recipe(name_or_path: str | Path) -> Recipe:
    """Read, inherit and validate a recipe; raise RecipeError with every problem listed."""
    path = recipe_path(name_or_path)
    raw = _read_raw(path, ())
    if "sweep" in raw:
        n = len(expand_sweep(raw.get("sweep"), path))
        raise RecipeError(f"{path.stem} is a sweep of {n} variants; run it with `make compare RECIPES={path.stem}` "
                          f"(python -m pipeline compare {path.stem})")
    return _validate(raw, path)


def _validate(raw: dict, path: Path, label: str = "") -> Recipe:
    try:
        return Recipe(**raw)
    except ValidationError as e:
        raise RecipeError(_format_error(path, e, label or "recipe")) from None


# Short name parts for swept keys: q_group_size 64 -> "g64"; anything else -> "<last key part><value>".
_SUFFIX = {"q_group_size": "g{}", "w_bit": "w{}", "method": "{}", "format": "{}"}


def _suffix(key: str, value: Any) -> str:
    if key == "zero_point":
        return "asym" if value else "sym"
    text = _SUFFIX.get(key, key.rsplit(".", 1)[-1].replace("_", "") + "{}").format(value)
    return "".join(c if c.isalnum() or c in "-." else "-" for c in str(text).lower())


def expand_sweep(sweep: Any, path: Path) -> list[dict[str, Any]]:
    """`sweep: {key: [v1, v2], awq.n_grid: [..]}` -> one {dotted key: value} per variant (cartesian product)."""
    if not isinstance(sweep, dict) or not sweep:
        raise RecipeError(f"{path}: `sweep` must map recipe keys to lists of values, "
                          f"e.g. sweep: {{q_group_size: [32, 64, 128]}}")
    for key, values in sweep.items():
        if key in ("name", "base", "model", "sweep") or not isinstance(values, list) or not values:
            raise RecipeError(f"{path}: sweep key {_short(key)} must be a recipe setting (not name/base/model) "
                              f"with a non-empty list of values, e.g. q_group_size: [32, 64, 128]")
        if len({repr(v) for v in values}) != len(values):
            raise RecipeError(f"{path}: sweep key `{key}` lists a value twice: {_short(values)}")
    return [dict(zip(sweep, combo)) for combo in itertools.product(*sweep.values())]


def _set_dotted(raw: dict, key: str, value: Any) -> dict:
    out = dict(raw)
    head, _, rest = key.partition(".")
    out[head] = _set_dotted(dict(out.get(head) or {}), rest, value) if rest else value
    return out


def load_variants(name_or_path: str | Path) -> list[Recipe]:
    """A recipe -> [it]; a sweep recipe -> one validated recipe per combination, named `<name>-<g64>-...`.

    Every variant is validated before any model loads; all problems are listed together.
    """
    path = recipe_path(name_or_path)
    raw = _read_raw(path, ())
    if "sweep" not in raw:
        return [_validate(raw, path)]
    combos = expand_sweep(raw.pop("sweep"), path)
    variants, errors = [], []
    for combo in combos:
        v = dict(raw)
        for key, value in combo.items():
            v = _set_dotted(v, key, value)
        v["name"] = "-".join([raw["name"], *(_suffix(k, x) for k, x in combo.items())])
        try:
            variants.append(_validate(v, path, label=f"variant {v['name']} ({combo})"))
        except RecipeError as e:
            errors.append(str(e))
    if errors:
        raise RecipeError("\n".join(errors))
    return variants

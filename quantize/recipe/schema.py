"""The recipe: one validated object per artifact, its fields the YAML keys."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from .. import formats, methods
from ..errors import did_you_mean
from ..methods.awq import AwqOptions
from ..methods.gptq import GptqOptions
from .options import (AUTO, GROUP_SIZES, Advanced, AutoOptions, Calibration, EvalOptions, MixedOptions, MoeOptions,
                      ServeOptions, Strict, coarseness)


class Recipe(Strict):
    """A validated recipe. Field names map 1:1 to the YAML keys."""

    name: str
    base: str | None = None
    description: str = ""
    model: str
    method: str  # a registered method (quantize/methods): awq | gptq | rtn | signround; or auto (`auto:`)
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
    mixed: MixedOptions | None = None  # several group sizes under a bits-per-weight budget; None = q_group_size only
    auto: AutoOptions | None = None  # `method: auto`'s candidates and held-out samples; None = the defaults

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
        if v != AUTO and v not in methods.REGISTRY:
            raise ValueError(f"method {v!r} is unknown; use one of {methods.names()} or {AUTO}")
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
        # with method auto each candidate writes its own format: `_auto_problem` checks them one by one
        problem = formats.get(self.out_format).problem(self) if self.method != AUTO else None
        if problem:
            raise ValueError(problem)
        if self.advanced.awq.coarse_step >= self.awq.n_grid:
            raise ValueError(f"advanced.awq.coarse_step {self.advanced.awq.coarse_step} must be below awq.n_grid "
                             f"{self.awq.n_grid} (1 evaluates every grid point)")
        if self.advanced.awq.coarse_step > 1 and self.awq.screen_keep:
            raise ValueError(f"advanced.awq.coarse_step {self.advanced.awq.coarse_step} and awq.screen_keep "
                             f"{self.awq.screen_keep} are two ways to search part of the grid: set awq.screen_keep: "
                             f"null to search coarse-to-fine, or coarse_step: 1")
        for name, given in self.sections.items():
            if name not in methods.REGISTRY or name in type(self).model_fields:
                raise ValueError("key `sections` is not a recipe key; write a method's options under its name")
            try:
                methods.get(name).options(**(given or {}))
            except ValidationError as e:
                raise ValueError(f"`{name}`: " + "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}"
                                                        for x in e.errors())) from None
        if self.method == AUTO:
            problem = self._auto_problem()
        elif self.auto is not None:
            problem = f"auto: is read with method: {AUTO} only; remove the `auto:` block or set method: {AUTO}"
        else:
            problem = methods.get(self.method).problem(self) or self._mixed_problem()
        if problem:
            raise ValueError(problem)
        return self

    @property
    def auto_options(self) -> AutoOptions:
        """`method: auto`'s settings: the `auto:` block, or the defaults where the recipe has none."""
        return self.auto or AutoOptions()

    def candidate(self, method: str) -> "Recipe":
        """This recipe naming `method` instead of auto: what a candidate of `method: auto` quantizes and writes,
        the same recipe (name, settings, recipe.yaml) as one that named the method itself."""
        return self.model_copy(update={"method": method, "auto": None})

    def _candidate_problem(self, method: str) -> str | None:
        """Why this recipe with `method` cannot be written (its format's check, then the method's); None if it can."""
        c = self.candidate(method)
        return formats.get(c.out_format).problem(c) or methods.get(method).problem(c)

    def auto_candidates(self) -> tuple[list["Recipe"], dict[str, str]]:
        """`method: auto`'s candidates -> (one recipe per candidate method, in order; default methods left out
        because this recipe cannot write them -> why). Listed candidates are all kept: validation refused the
        recipe if one cannot be written."""
        listed = self.auto_options.candidates
        names = listed if listed is not None else [n for n in methods.names() if methods.get(n).auto_default]
        kept, left_out = [], {}
        for name in names:
            why = self._candidate_problem(name)
            if why:
                left_out[name] = why
            else:
                kept.append(self.candidate(name))
        return kept, left_out

    def _auto_problem(self) -> str | None:
        """What `method: auto` with these candidates cannot do, saying what to change; None when fine."""
        if self.mixed is not None:
            return (f"mixed: picks group sizes for one method's linears; with method: {AUTO} name the method "
                    f"instead, or remove the `mixed:` block")
        listed = self.auto_options.candidates
        for name in listed or ():
            if name == AUTO or name not in methods.REGISTRY:
                return (f"auto.candidates: method {name!r} is unknown{did_you_mean(name, methods.names())}; list "
                        f"methods of {methods.names()}")
            why = self._candidate_problem(name)
            if why:
                return f"auto.candidates: {name} cannot be written with this recipe: {why}; or remove {name} from " \
                       f"auto.candidates"
        kept, left_out = self.auto_candidates()
        if not kept:
            why = "; ".join(f"{n}: {w}" for n, w in left_out.items())
            return f"method {AUTO}: no default candidate can be written with this recipe ({why}); list auto.candidates"
        return None

    def _mixed_problem(self) -> str | None:
        """What a `mixed:` block asks that cannot be written or chosen, saying what to change; None when fine."""
        m = self.mixed
        if m is None:
            return None
        if m.base_group != self.q_group_size:
            return (f"mixed.base_group {m.base_group} differs from q_group_size {self.q_group_size}: every linear starts "
                    f"at the base size; set q_group_size: {m.base_group}")
        coarse = [g for g in m.finer if g >= m.base_group]
        if coarse:
            return (f"mixed.finer {list(m.finer)}: {coarse[0]} is not finer than base_group {m.base_group}; list "
                    f"sizes below it (32{' or 64' if m.base_group == 128 else ''})")
        fmt = formats.get(self.out_format)
        if not fmt.several_group_sizes:
            able = [n for n in formats.NAMES if formats.get(n).several_group_sizes]
            return (f"mixed: format {fmt.name} holds one group size per artifact; set format: {' or '.join(able)} "
                    f"(one config group per size)")
        method = methods.get(self.method)
        if not method.measures_output_error:
            able = [n for n in methods.names() if methods.get(n).measures_output_error]
            return (f"mixed: method {self.method} does not measure each linear's output error, which the choice of "
                    f"sizes ranks by; use method {' or '.join(able)}")
        return self._mixed_coarser_problem() or self._mixed_budget_problem()

    def _mixed_coarser_problem(self) -> str | None:
        """mixed.coarser sizes that are not coarser than the base, or that the method cannot quantize at."""
        m, method = self.mixed, methods.get(self.method)
        fine = [g for g in m.coarser if coarseness(g) <= m.base_group]
        if fine:
            return (f"mixed.coarser {list(m.coarser)}: {fine[0]} is not coarser than base_group {m.base_group}; list "
                    f"sizes above it ({', '.join(str(g) for g in (128, -1) if coarseness(g) > m.base_group)}; "
                    f"-1 = per channel)")
        for g in m.coarser:
            problem = method.problem(method.at_group_size(self, g))
            if problem:
                return f"mixed.coarser {g}: {problem}; or remove {g} from mixed.coarser"
        return None

    def _mixed_budget_problem(self) -> str | None:
        """A budget below what every linear stores at the coarsest size (where each starts), for a large linear."""
        m, fmt = self.mixed, formats.get(self.out_format)
        start, finest = m.ladder[0], m.ladder[-1]
        low = fmt.bits_per_weight(start, self.w_bit, self.symmetric)
        top = fmt.bits_per_weight(finest, self.w_bit, self.symmetric)
        if m.budget_bits_per_weight < low:
            where = f"base_group {start}" if start == m.base_group else f"the coarsest size {start}"
            return (f"mixed.budget_bits_per_weight {m.budget_bits_per_weight} is below the {low:.4f} bits per weight "
                    f"every linear at {where} stores; set at least {low:.4f} (g{finest} everywhere stores "
                    f"{top:.4f})" + ("" if m.coarser else ", or list a coarser size under mixed.coarser"))
        return None

    def method_options(self, name: str) -> Any:
        """The options section of registered method `name` (its `options` model, defaults where not given)."""
        if name in type(self).model_fields:
            return getattr(self, name)
        return methods.get(name).options(**self.sections.get(name, {}))

    def to_dict(self) -> dict[str, Any]:
        """The resolved recipe as plain data (what the artifact records); `moe`, `mixed` and `auto` only when set."""
        d = self.model_dump(mode="json")
        for key in ("moe", "mixed", "auto"):
            if d[key] is None:
                del d[key]
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

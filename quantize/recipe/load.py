"""Reading recipes: a name or path to a file, `base:` inheritance, `sweep:` variants, and errors that name
the key, the value and what is allowed."""

from __future__ import annotations

import itertools
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from ..errors import did_you_mean
from ..source.not_found import remember_tried
from .options import RecipeError
from .schema import Recipe

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"


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
    remember_tried(model, beside)  # a hub id, or a directory that is missing: the loader's error says both
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

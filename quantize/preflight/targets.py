"""serve.targets: the GPU generations and tensor-parallel sizes a recipe must serve at on a Marlin-class kernel,
checked against the deployability table (`deploy`), with the recipe changes that would fix a refused one."""

from __future__ import annotations

from pathlib import Path

from .. import formats, methods
from .deploy import MARLIN, REFUSED, TP_SIZES, DeployError, Table, build, cell_of, query, rule_answer
from .modules import recipe_modules


def _target_cells(recipe) -> list[tuple[str, int, str]]:
    return [(t.capability, t.tensor_parallel_size, recipe.dtype) for t in recipe.serve.targets]


def target_problem(table: Table, recipe, modules: list[dict], role: str = "",
                   finer: tuple[int, ...] = ()) -> str | None:
    """The first serve.target the table does not serve on a Marlin-class kernel -> one line naming the fix.
    role: "base", "finer" or "coarser" where the table is of one of a `mixed:` recipe's sizes (recipe: its
    `per_size` copy; finer: the mix's finer sizes)."""
    for cap, tp, dtype in _target_cells(recipe):
        c = table.cell(cap, tp, dtype)
        if c.verdict == MARLIN:
            continue
        what = (f"refuses it ({c.reason})" if c.verdict == REFUSED else
                f"runs {c.slowest}, slower than its Marlin-class kernels")
        g, found = recipe.q_group_size, fixes(recipe, modules, cap, tp, dtype)
        fix = f"remove {g} from mixed.{role}" if role in ("finer", "coarser") else \
            f"set {found or 'a different target'}"
        if role == "base":
            fix = _base_fix(found, finer)
        return (f"serve.targets: {f'mixed group size {g}: ' if role else ''}compute capability {cap} at "
                f"tensor_parallel_size {tp} in {dtype}: vLLM {what} (from {table.source.split(' (')[0]}); fix: {fix}")
    return None


def _base_fix(found: str, finer: tuple[int, ...]) -> str:
    """The fixes of a mix's base size: another base size that leaves a finer one below it, or a tensor-parallel
    size (the other formats hold one size; symmetry is the recipe's choice)."""
    kept, alone = [], []
    for x in found.split(" or ") if found else ():
        if x.startswith("tensor_parallel"):
            kept.append(x)
        elif x.startswith("q_group_size"):
            g = int(x.split(": ")[1])
            below = [f for f in finer if f < g]
            if not below:  # nothing finer than g: a mix cannot start there (the recipe check would refuse it)
                alone.append(x)
            else:
                kept.append(f"q_group_size and mixed.base_group: {g}"
                            + ("" if len(below) == len(finer) else f" with mixed.finer {below}"))
    fix = [f"set {' or '.join(kept)}"] if kept else []
    fix += [f"remove mixed: and set {alone[0]}"] if alone else []
    return " or ".join(fix) or "set a different target"


def per_size(recipe) -> list[tuple[object, str]]:
    """The recipe as each group size it writes, for the deployability table: [(recipe at that size, role)]: itself
    (role ""), or for a `mixed:` recipe the base size ("base") and each finer or coarser size it may give a linear
    ("finer", "coarser")."""
    if recipe.mixed is None:
        return [(recipe, "")]
    m = recipe.mixed
    return [(recipe.model_copy(update={"q_group_size": g, "mixed": None}),
             "base" if g == m.base_group else "finer" if g in m.finer else "coarser") for g in m.sizes]


def _serves(fmt: str, group: int, symmetric: bool, bits: int, modules, cap: str, tp: int, dtype: str) -> bool:
    q = {"format": fmt, "w_bit": bits, "group": group, "symmetric": symmetric, "modules": modules,
         "capabilities": [cap], "tp_sizes": [tp], "dtypes": [dtype]}
    return cell_of(rule_answer(q)["cells"][0], [m["name"] for m in modules]).verdict == MARLIN


def fixes(recipe, modules: list[dict], cap: str, tp: int, dtype: str) -> str:
    """Recipe changes that make (cap, tp, dtype) Marlin-class by the hand rules: group size, symmetry, format,
    tensor-parallel size (the first two found, least change first)."""
    fmt, g, sym, bits = recipe.out_format, recipe.q_group_size, recipe.symmetric, recipe.w_bit
    own = formats.get(fmt)
    method = methods.get(recipe.method)
    found = [f"q_group_size: {x}" for x in sorted(own.group_sizes, reverse=True)
             if x != g and method.problem(recipe.model_copy(update={"q_group_size": x})) is None
             and _serves(fmt, x, sym, bits, modules, cap, tp, dtype)]
    if not (own.symmetric_only and sym) and _serves(fmt, g, not sym, bits, modules, cap, tp, dtype):
        found.append(f"zero_point: {str(sym).lower()}")
    for other in formats.NAMES:
        o = formats.get(other)
        if other != fmt and g in o.group_sizes and not (o.symmetric_only and not sym) \
                and _serves(other, g, sym, bits, modules, cap, tp, dtype):
            found.append(f"format: {other}")
    found += [f"tensor_parallel_size: {t} in this target" for t in sorted(TP_SIZES, reverse=True)
              if t < tp and _serves(fmt, g, sym, bits, modules, cap, t, dtype)][:1]
    return " or ".join(found[:3])


def check_targets_by_rules(recipe, config, arch, is_skipped) -> None:
    """serve.targets by the hand rules, from the config alone (no weights, no vLLM import: instant)."""
    if not recipe.serve.targets:
        return
    problem = _rules_problem(recipe, recipe_modules(recipe, config, arch, is_skipped))
    if problem:
        raise DeployError(problem)


def _rules_problem(recipe, modules: list[dict]) -> str | None:
    caps = sorted({c for c, _, _ in _target_cells(recipe)}, key=float)
    for sized, role in per_size(recipe):
        table = build(query(sized, modules, caps, TP_SIZES, [recipe.dtype], for_vllm=False), use_vllm=False)
        problem = target_problem(table, sized, modules, role, recipe.mixed.finer if recipe.mixed else ())
        if problem:
            return problem
    return None


def refuse_targets_early(recipe, out: Path, force: bool) -> None:
    """serve.targets by the hand rules from config.json read as plain JSON, before the command line imports torch
    or transformers (they take seconds): a refused target fails at once, with pre-flight's own message.

    What this cannot decide is left to pre-flight, which checks the same targets on transformers' config: a model
    not on disk as a directory or in the hub cache (GGUF, a download), a size config.json leaves to transformers'
    defaults, an unsupported architecture, and the errors pre-flight reports before the targets (an existing
    output, custom code the recipe does not trust)."""
    if not recipe.serve.targets or (out.exists() and not force):
        return
    from ..source.arch import arch_for
    from ..source.load import config_json

    try:
        config = config_json(recipe.model, recipe.trust_remote_code)
        if config is None:
            return
        arch = arch_for(config)
        modules = recipe_modules(recipe, config, arch, formats.is_skipped)
    except (KeyError, AttributeError, TypeError, ValueError, ZeroDivisionError):
        return  # pre-flight reads the config with transformers and says what is wrong with it
    problem = _rules_problem(recipe, modules)
    if problem:
        raise DeployError(problem)

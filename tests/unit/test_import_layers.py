"""Imports run down the floors of the house only: a stage may import its own floor and those below, never one
above (capture knows no method, records know no registry, a helper several floors share lives on the ground).
Read from the source (ast), nothing is imported; imports inside functions and `importlib.import_module` of a
module named in the code count as well as those at the top."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("quantize", "eval", "pipeline")

# The floors, lowest first; every module belongs to the floor of the longest name here that it starts with.
# ground: helpers with no knowledge of a stage; records: the artifact's schema; source: checkpoint -> model and
# the architecture tables; capture: the layer-by-layer loop and its device; methods: the algorithms and their
# per-layer jobs, plugged into capture; formats: the on-disk layouts of what methods produce (they decode with
# the methods' primitives); mixed: one job per group size and the choice between them (what each size stores is
# its format's fact); recipe: the schema that names methods and formats; preflight and export: the run's
# checks and its writer (export records pre-flight's deployability facts); then the runner, eval, the CLI.
FLOORS = (
    ("quantize", "quantize.errors", "quantize.files", "quantize.paths", "quantize.progress", "quantize.runlog",
     "quantize.lock"),
    ("quantize.records", "quantize.manifest"),
    ("quantize.source",),
    ("quantize.calib",),
    ("quantize.capture",),
    ("quantize.methods",),
    ("quantize.formats",),
    ("quantize.mixed",),
    ("quantize.recipe",),
    ("quantize.preflight",),
    ("quantize.export",),
    ("quantize.runner",),
    ("eval",),
    ("pipeline",),
)
FLOOR = {name: i for i, names in enumerate(FLOORS) for name in names}


def floor(module: str) -> int | None:
    """The floor of `module` (a dotted name of ours), None for a module of another package."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in FLOOR:
            return FLOOR[".".join(parts[:n])]
    return None


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            out[".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")] = p
    return out


def _absolute(name: str, package: str, level: int) -> str:
    """A relative module name (`name` after `level` dots) in `package` -> its absolute name."""
    if not level:
        return name
    parts = package.split(".")[: len(package.split(".")) - level + 1]
    return ".".join(parts + ([name] if name else []))


def _named_module(call: ast.Call, package: str) -> str | None:
    """The module `import_module(...)` / `__import__(...)` loads, as far as the code spells it (an f-string: its
    constant head, e.g. f"..methods.{name}" -> the methods package), else None."""
    func = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
    if func not in ("import_module", "__import__") or not call.args:
        return None
    arg = call.args[0]
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        arg = arg.values[0]
    if not isinstance(arg, ast.Constant) or not isinstance(arg.value, str):
        return None
    text = arg.value.rstrip(".") if isinstance(call.args[0], ast.JoinedStr) else arg.value
    level = len(text) - len(text.lstrip("."))
    return _absolute(text[level:], package, level) if text else None


def imported(name: str, source: str, known: set[str], is_package: bool = False) -> list[tuple[str, int]]:
    """-> (module of ours or another's, line) for every import in `source`, the module `name`, anywhere in it."""
    package = name if is_package else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node.module or "", package, node.level)
            out += [(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base, node.lineno) for a in node.names]
        elif isinstance(node, ast.Call) and (target := _named_module(node, package)):
            out.append((target, node.lineno))
    return sorted(out, key=lambda x: x[1])


def upward(name: str, source: str, known: set[str], is_package: bool = False) -> list[str]:
    """The imports in `source` (module `name`) of a module on a higher floor, as 'module:line -> target'."""
    here = floor(name)
    return sorted({f"{name}:{line} -> {t}" for t, line in imported(name, source, known, is_package)
                   if (there := floor(t)) is not None and there > here})


def test_every_module_has_a_floor():
    assert [m for m in modules() if floor(m) is None] == [], "give each new top-level module a floor in FLOORS"


def test_no_import_runs_up_a_floor():
    found = modules()
    known = set(found)
    ups = [u for m, p in sorted(found.items()) for u in upward(m, p.read_text(), known, p.name == "__init__.py")]
    assert ups == [], "imports from a lower floor to a higher one:\n" + "\n".join(ups)


def test_an_upward_import_is_caught_wherever_it_is_written():
    known = {"quantize.methods", "quantize.methods.layer", "quantize.capture", "quantize.capture.loop"}
    src = ("from ..methods.layer import store\n"
           "def f():\n    from .. import methods\n"
           "def g(name):\n    return importlib.import_module(f'..methods.{name}', __package__)\n"
           "import quantize.methods.layer\n")
    assert [u.split(" -> ")[1] for u in upward("quantize.capture.fake", src, known)] == \
        ["quantize.methods.layer", "quantize.methods", "quantize.methods", "quantize.methods.layer"]
    down = "from .loop import LayerData\nfrom ..errors import UserError\nimport torch\n"
    assert upward("quantize.capture.fake", down, known) == []
    assert upward("quantize.methods.fake", "from ..capture.loop import LayerData\n", known) == []

"""scikit-learn and SciPy imported when something calls them, not whenever transformers builds a config.

transformers' configuration and model classes import its generation code and its loss table. Two corners of those
import an optional library at the top whenever it is installed (lm-eval and MLflow install both here), for features
no command of this tool calls:
- assisted decoding (`transformers.generation.candidate_generator`) imports `sklearn.metrics.roc_curve`:
  scikit-learn, SciPy's statistics and pandas, over a second of each process;
- the detection models' losses (`transformers.loss.loss_for_object_detection`, `loss_rt_detr`, ... six modules)
  import `scipy.optimize.linear_sum_assignment`: SciPy's optimize package.
Every process that reads a config paid for both, most of a pre-flight (docs/BENCHMARKS.md, "Pre-flight on a
7B-shaped directory").

`defer_imports()` (called by the command line's entry point before anything imports transformers) lets those
modules execute as if the library were absent, then gives each back transformers' own availability check and, for
every name its source imports from the library behind that check (read from the module's source, so a transformers
release that imports other names is served the same way), a function that imports the real one on its first call
and calls it. Assisted decoding and the detection losses behave as before. Every other module, and every later
import of scikit-learn or SciPy, is left alone. A module whose source is not readable, that imports the library
other than by `from ... import`, or a transformers laid out otherwise (no `is_<library>_available` in
`transformers.utils`) is imported as it would be.
"""

from __future__ import annotations

import ast
import importlib
import importlib.abc
import sys

# module (or package prefix ending in ".") -> the optional library its top level imports behind
# transformers' `is_<library>_available()`
DEFERRED = {"transformers.generation.candidate_generator": "sklearn", "transformers.loss.": "scipy"}


def defer_imports() -> None:
    """Install the import hook (no-op where it is already installed)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def library_for(fullname: str) -> str | None:
    if not fullname.startswith("transformers."):  # every import of the process asks: answered at once
        return None
    for key, lib in DEFERRED.items():
        if fullname == key or (key.endswith(".") and fullname.startswith(key)):
            return lib
    return None


def lazy(module: str, name: str):
    """`module.name` as a function that imports `module` on its first call and calls the real one."""

    def call(*args, **kwargs):
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"`{module}.{name}`, imported when first called (pipeline/deferred.py)"
    return call


def imported_names(source: str, lib: str) -> dict[str, tuple[str, str]] | None:
    """Names a module's top level binds from `lib` (inside `if`/`try` blocks too; a function's own imports run when
    it is called) -> {bound name: (module, name)}; None where it also imports `lib` as a module (`import lib...`)
    or with `*`, which no function can stand in for."""
    if lib not in source:
        return {}
    names, todo = {}, list(ast.parse(source).body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            todo += node.body + node.orelse if isinstance(node, ast.If) else \
                node.body if isinstance(node, ast.With) else \
                node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]
        elif isinstance(node, ast.Import) and any(a.name == lib or a.name.startswith(lib + ".") for a in node.names):
            return None
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                (node.module == lib or node.module.startswith(lib + ".")):
            if any(a.name == "*" for a in node.names):
                return None
            names.update({a.asname or a.name: (node.module, a.name) for a in node.names})
    return names


def _absent() -> bool:
    return False


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        lib = library_for(fullname)
        if lib is None:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None) if finder is not self else None
            spec = find(fullname, path, target) if find else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module") and hasattr(spec.loader, "get_source"):
            spec.loader = _Loader(spec.loader, lib)
        return spec


class _Loader(importlib.abc.Loader):
    """The module's own loader, with `lib` reported absent while the module's top level runs."""

    def __init__(self, inner, lib: str):
        self.inner, self.lib = inner, lib

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        check = f"is_{self.lib}_available"
        utils = sys.modules.get("transformers.utils")
        real = getattr(utils, check, None)
        names = _names_from(self.inner, module.__name__, self.lib)
        if real is None or not names:
            self.inner.exec_module(module)
            return
        before = set(sys.modules)
        setattr(utils, check, _absent)
        try:
            self.inner.exec_module(module)
        finally:
            setattr(utils, check, real)
            # a module first imported while this one ran saw the library absent too: it is mended the same way
            for n in set(sys.modules) - before - {module.__name__}:
                other = sys.modules.get(n)
                if other is not None and vars(other).get(check) is _absent:
                    _mend(other, check, real, _names_from(getattr(other, "__loader__", None), n, self.lib) or {})
        _mend(module, check, real, names)

    def __getattr__(self, name):  # get_source, get_filename, is_package ...: the module's own loader answers
        if name in ("inner", "lib"):
            raise AttributeError(name)
        return getattr(self.inner, name)


def _names_from(loader, fullname: str, lib: str) -> dict[str, tuple[str, str]] | None:
    """`imported_names` of the module's source as its loader reads it; None where there is no readable source."""
    try:
        source = loader.get_source(fullname) if loader is not None else None
        return imported_names(source, lib) if source else None
    except (ImportError, OSError, SyntaxError, UnicodeDecodeError):
        return None


def _mend(module, check: str, real, names: dict[str, tuple[str, str]]) -> None:
    """transformers' own `check` back in the module, and the names it skipped as functions that import on call."""
    space = vars(module)
    if space.get(check) is _absent:
        space[check] = real
    if real():
        for bound, (mod, name) in names.items():
            space.setdefault(bound, lazy(mod, name))

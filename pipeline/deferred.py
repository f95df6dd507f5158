"""scikit-learn imported when something calls it, not whenever transformers builds a config.

transformers' configuration and model classes import its generation code, whose assisted-decoding module
(`transformers.generation.candidate_generator`) imports `sklearn.metrics.roc_curve` at the top whenever
scikit-learn is installed (lm-eval and MLflow install it here). No command of this tool calls it, yet every process
that reads a config paid for it: scikit-learn, SciPy's statistics and pandas, 1.1-1.3 s on the 2-core CPU box and
1.9-2.6 s on the H200 host (docs/BENCHMARKS.md, "Pre-flight on a 7B-shaped directory"), most of a pre-flight.

`defer_sklearn()` (called by the command line's entry point before anything imports transformers) lets that one
module execute as if scikit-learn were absent, then gives it back transformers' own availability check and a
`roc_curve` that imports scikit-learn's on its first call, so assisted decoding behaves as before. Every other
module, and every later import of scikit-learn, is left alone. Where transformers is laid out otherwise (no
`is_sklearn_available` in `transformers.utils`), the module is imported as it would be.
"""

from __future__ import annotations

import importlib.abc
import sys

MODULE = "transformers.generation.candidate_generator"


def defer_sklearn() -> None:
    """Install the one-shot import hook for `MODULE` (no-op where it is already imported or hooked)."""
    if MODULE in sys.modules or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())


def roc_curve(*args, **kwargs):
    """`sklearn.metrics.roc_curve`, imported when first called (transformers' assisted decoding calls it)."""
    from sklearn.metrics import roc_curve as real

    return real(*args, **kwargs)


def _absent() -> bool:
    return False


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != MODULE:
            return None
        sys.meta_path.remove(self)  # one module, imported once per process
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Loader(spec.loader)
        return spec


class _Loader(importlib.abc.Loader):
    """The module's own loader, with scikit-learn reported absent while the module's top level runs."""

    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        utils = sys.modules.get("transformers.utils")
        real = getattr(utils, "is_sklearn_available", None)
        if real is None:
            self.inner.exec_module(module)
            return
        utils.is_sklearn_available = _absent
        try:
            self.inner.exec_module(module)
        finally:
            utils.is_sklearn_available = real
        if vars(module).get("is_sklearn_available") is _absent:
            module.is_sklearn_available = real
            if real() and "roc_curve" not in vars(module):
                module.roc_curve = roc_curve

    def __getattr__(self, name):  # get_source, get_filename, is_package ...: the module's own loader answers
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

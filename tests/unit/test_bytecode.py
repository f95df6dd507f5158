"""The bytecode cache (pipeline/bytecode.py): on a host that keeps no bytecode, the listed files are compiled in
parallel into the cache before the command imports them, and the imports then use that bytecode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import bytecode

ROOT = Path(__file__).resolve().parents[2]

# runs in a fresh interpreter: prepare() changes process-wide state (sys.pycache_prefix, the environment)
CHILD = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, sys.argv[2])
from pipeline import bytecode
bytecode.MIN_PER_WORKER = 1
bytecode._cores = lambda: int(sys.argv[4])
names = json.loads(sys.argv[3])
p = bytecode.prepare(names)
out = {"prepared": None if p is None else [str(p.prefix), p.compiled, p.present, p.workers],
       "env": [os.environ.get("PYTHONPYCACHEPREFIX"), os.environ.get("PYTHONDONTWRITEBYTECODE")]}
if p is not None:
    from importlib.util import cache_from_source
    out["before_import"] = [os.path.exists(cache_from_source(os.path.join(sys.argv[2], n))) for n in names[:3]]
    import mod_a, pkg_b.inner
    out["values"] = [mod_a.VALUE, pkg_b.inner.VALUE]
    out["cached"] = [mod_a.__cached__, pkg_b.inner.__cached__]
print(json.dumps(out))
"""


def _sources(tmp_path: Path, value: int) -> Path:
    lib = tmp_path / "lib"
    (lib / "pkg_b").mkdir(parents=True, exist_ok=True)
    (lib / "mod_a.py").write_text(f"VALUE = {value}\n")
    (lib / "pkg_b" / "__init__.py").write_text("")
    (lib / "pkg_b" / "inner.py").write_text(f"VALUE = {value}\n")
    return lib


def _child(lib: Path, cache: Path, names: list[str], cores: int = 4, **env) -> dict:
    e = {**os.environ, "QUANTIZE_CACHE_DIR": str(cache), "PYTHONDONTWRITEBYTECODE": "1", **env}
    e.pop("PYTHONPYCACHEPREFIX", None)
    r = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), str(lib), json.dumps(names), str(cores)], env=e,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("cores", [4, 2])
def test_listed_files_are_compiled_and_imported_from_the_cache(tmp_path, cores):
    lib = _sources(tmp_path, 1)
    cache = tmp_path / "cache"
    names = ["mod_a.py", "pkg_b/__init__.py", "pkg_b/inner.py", "absent_pkg/x.py", "pkg_b/absent.py"]
    first = _child(lib, cache, names, cores)
    prefix = cache / "bytecode"
    # the absent files are skipped; below MIN_CORES no workers: the process compiles as it imports, into the cache
    assert first["prepared"] == ([str(prefix), 3, 0, 3] if cores >= 4 else [str(prefix), 0, 0, 0])
    assert first["before_import"] == [cores >= 4] * 3
    # child processes are pointed at the same cache and allowed to write there
    assert first["env"] == [str(prefix), None]
    assert first["values"] == [1, 1]
    for cached in first["cached"]:
        assert Path(cached).is_file() and Path(cached).is_relative_to(prefix)
    assert not list(lib.rglob("__pycache__")), "nothing is written beside the sources"

    # Change the sources' text but keep their size and modification time: Python trusts bytecode whose header
    # matches the source's size and mtime, so an import that used the cache still sees the old values. This is
    # what shows that the second process imported the compiled files rather than the sources.
    stats = {p: p.stat() for p in (lib / "mod_a.py", lib / "pkg_b" / "inner.py")}
    _sources(tmp_path, 2)
    for p, st in stats.items():
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    second = _child(lib, cache, names, cores)
    assert second["prepared"] == [str(prefix), 0, 3, 0]
    assert second["values"] == [1, 1]


def test_nothing_is_done_where_python_keeps_bytecode_or_it_is_turned_off(tmp_path, monkeypatch):
    lib = _sources(tmp_path, 1)
    off = _child(lib, tmp_path / "c1", ["mod_a.py"], QUANTIZE_BYTECODE="off")
    assert off["prepared"] is None and off["env"] == [None, "1"]
    assert not (tmp_path / "c1").exists()
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    assert bytecode.prepare(["mod_a.py"]) is None


def test_packages_installed_with_their_bytecode_are_read_as_they_are(tmp_path):
    # pip compiles what it installs whatever PYTHONDONTWRITEBYTECODE says; a cache would hide that bytecode
    lib = _sources(tmp_path, 1)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPYCACHEPREFIX"}
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(lib)], check=True, env=env)
    got = _child(lib, tmp_path / "cache", ["mod_a.py", "pkg_b/__init__.py", "pkg_b/inner.py"])
    assert got["prepared"] is None and got["env"] == [None, "1"]
    assert not (tmp_path / "cache").exists()


def test_packages_that_carry_part_of_their_bytecode_get_the_cache(tmp_path):
    """An image whose packages carry bytecode for some files only: the cache is used, and every listed file is
    compiled into it, since once a cache is set Python reads no bytecode beside the sources."""
    lib = _sources(tmp_path, 1)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPYCACHEPREFIX"}
    for f in ("mod_a.py", "pkg_b/__init__.py"):  # 2 of the 3 listed
        subprocess.run([sys.executable, "-m", "py_compile", str(lib / f)], check=True, env=env)
    got = _child(lib, tmp_path / "cache", ["mod_a.py", "pkg_b/__init__.py", "pkg_b/inner.py"])
    assert got["prepared"] == [str(tmp_path / "cache" / "bytecode"), 3, 0, 3]
    assert got["values"] == [1, 1]


def test_a_setting_that_is_neither_on_nor_off_stops_the_command(monkeypatch, capsys):
    from pipeline.__main__ import main

    monkeypatch.setenv("QUANTIZE_BYTECODE", "disable")
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    prefix = sys.pycache_prefix
    assert main(["run", "smollm2-awq-g64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: QUANTIZE_BYTECODE='disable' is neither on nor off: set it to off to leave Python's "
                   "bytecode settings alone, or unset it"]
    assert sys.pycache_prefix == prefix and "PYTHONPYCACHEPREFIX" not in os.environ


def test_commands_that_import_no_torch_are_left_alone(monkeypatch):
    called = []
    monkeypatch.setattr(bytecode, "prepare", lambda: called.append(1))
    monkeypatch.setattr(bytecode, "PREPARED", None)
    for argv in (["list"], ["validate"], ["--help"], ["run", "x", "-h"], []):
        bytecode.prepare_for(argv)
    assert not called
    bytecode.prepare_for(["run", "smollm2-awq-g64"])
    assert called == [1]


def test_the_shipped_list_names_what_a_run_imports():
    names = bytecode.LIST.read_text().split()
    assert names == sorted(set(names))
    for must in ("torch/__init__.py", "transformers/__init__.py", "quantize/runner.py", "safetensors/torch.py"):
        assert must in names
    found = bytecode.listed(names)
    assert len(found) >= 0.8 * len(names), "most of the list exists where these tests run"

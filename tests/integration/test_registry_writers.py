"""Several `register` commands at once into one SQLite registry (separate processes, as CI jobs run them): every
version lands with its own number, `registry` lists them all, and `serve models:/<name>@<alias>` racing an alias
move resolves one whole version or the other."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline import registry
from pipeline.cli import main as cli_main
from pipeline.stages import evaluate, write_report
from quantize import runner
from quantize.recipe import EvalOptions
from quantize.records import Smoke
from tests.conftest import tiny_recipe

ROOT = Path(__file__).resolve().parents[2]
MODEL = "shared"  # every writer adds a version to this one registered model: the numbers race


@pytest.fixture(scope="module")
def registrable(tiny_llama, tmp_path_factory) -> Path:
    """A tiny RTN artifact, perplexity evaluated, with a passing vLLM smoke recorded through write_report (the
    registry's own gate on vLLM is tested by the tests marked vllm)."""
    tmp = tmp_path_factory.mktemp("writers")
    out = runner.run(tiny_recipe(tmp, tiny_llama, name="writer", method="rtn"), out_root=tmp / "a")
    eopts = EvalOptions.model_validate({"perplexity": {"seq_len": 64, "max_windows": 1}, "vllm": {"enabled": False}})
    report = evaluate(out, None, eopts)
    report.vllm_smoke = Smoke(passed=True, checks={"loaded": False}, errors=[], method="awq", token_agreement=1.0)
    report.passed = True
    write_report(out, report)
    return out


def registry_env(uri: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    return {**env, "MLFLOW_TRACKING_URI": uri, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1",
            "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}


def register_at_once(artifact: Path, n: int, work: Path, uri: str, timeout: float = 300) -> list[int]:
    """`python -m pipeline register` on n copies of `artifact` (as n CI jobs have n checkouts), all started
    before any is waited for -> the version numbers they printed. Fails on any error exit."""
    copies = [shutil.copytree(artifact, work / f"job{i}" / "writer") for i in range(n)]
    procs = [subprocess.Popen([sys.executable, "-m", "pipeline", "register", "--artifact", str(c), "--name", MODEL],
                              cwd=ROOT, env=registry_env(uri), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for c in copies]
    deadline, results = time.monotonic() + timeout, []
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    failed = [f"exit {rc}: {err.strip()[-600:]}" for rc, _, err in results if rc != 0]
    assert not failed, f"{len(failed)} of {n} writers failed:\n" + "\n".join(failed)
    assert not any("database is locked" in err for _, _, err in results)
    return [int(out.split(f"registered {MODEL} version ")[1].split()[0]) for _, out, _ in results]


def listed(monkeypatch, capsys, uri: str) -> list[dict]:
    """`python -m pipeline registry --json` (in this process) -> its rows."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv("MLFLOW_REGISTRY_URI", raising=False)
    capsys.readouterr()
    assert cli_main(["registry", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def check_round(registrable, work: Path, monkeypatch, capsys, writers: list[int]) -> None:
    """Waves of writers at once into one fresh SQLite registry: each version number once, 1..total, all listed."""
    uri = f"sqlite:///{work / 'reg' / 'mlflow.db'}"
    got = []
    for wave, n in enumerate(writers):
        got += register_at_once(registrable, n, work / f"wave{wave}", uri)
    total = sum(writers)
    assert sorted(got) == list(range(1, total + 1)), got
    rows = listed(monkeypatch, capsys, uri)
    assert sorted(r["version"] for r in rows if r["name"] == MODEL) == list(range(1, total + 1))
    assert len({r["source"] for r in rows}) == total  # each version its own copy of the artifact
    for r in rows:
        copy = Path(r["source"].removeprefix("file://"))
        assert (copy / "manifest.json").is_file(), r["source"]


@pytest.mark.parametrize("n", [2, 8])
def test_writers_at_once_into_a_fresh_sqlite_registry(registrable, tmp_path, monkeypatch, capsys, n):
    """The first use of a database creates its schema: n processes arrive there together."""
    check_round(registrable, tmp_path, monkeypatch, capsys, [n])


@pytest.mark.slow
def test_two_then_eight_writers_twenty_rounds_in_a_row(registrable, tmp_path, monkeypatch, capsys):
    """Two writers at once into a fresh registry, then eight more at once into the same one; twenty rounds."""
    for i in range(20):
        check_round(registrable, tmp_path / f"round{i}", monkeypatch, capsys, [2, 8])

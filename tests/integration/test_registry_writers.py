"""Several `register` commands at once into one SQLite registry (separate processes, as CI jobs run them): every
version lands with its own number, `registry` lists them all, and `serve models:/<name>@<alias>` racing an alias
move resolves one whole version or the other."""

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline import registry
from pipeline.stages import write_report
from quantize.manifest import read_report
from tests.integration.registry_jobs import MODEL, listed, register_at_once, registry_env, tree


def check_round(artifact: Path, work: Path, monkeypatch, capsys, writers: list[int]) -> None:
    """Waves of writers at once into one fresh SQLite registry: each version number once, 1..total, all listed."""
    uri = f"sqlite:///{work / 'reg' / 'mlflow.db'}"
    got = []
    for wave, n in enumerate(writers):
        got += register_at_once(artifact, n, work / f"wave{wave}", uri)
    total = sum(writers)
    assert sorted(got) == list(range(1, total + 1)), got
    rows = listed(monkeypatch, capsys, uri)
    assert sorted(r["version"] for r in rows if r["name"] == MODEL) == list(range(1, total + 1))
    assert len({r["source"] for r in rows}) == total  # each version its own copy of the artifact
    for r in rows:
        assert (Path(r["source"].removeprefix("file://")) / "manifest.json").is_file(), r["source"]


@pytest.mark.parametrize("n", [2, 8])
def test_writers_at_once_into_a_fresh_sqlite_registry(registrable_artifact, tmp_path, monkeypatch, capsys, n):
    """The first use of a database creates its schema: n processes arrive there together."""
    check_round(registrable_artifact, tmp_path, monkeypatch, capsys, [n])


@pytest.mark.slow
def test_two_then_eight_writers_twenty_rounds_in_a_row(registrable_artifact, tmp_path, monkeypatch, capsys):
    """Two writers at once into a fresh registry, then eight more at once into the same one; twenty rounds."""
    for i in range(20):
        check_round(registrable_artifact, tmp_path / f"round{i}", monkeypatch, capsys, [2, 8])


MOVE_ALIAS = """
import sys, pathlib
from mlflow import MlflowClient
client, stop, moving, n = MlflowClient(), pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), 0
while not stop.exists():
    client.set_registered_model_alias("race", "champion", str(1 + n % 2))
    n += 1
    moving.touch()
print(n)
"""


def test_serve_racing_an_alias_move_resolves_one_whole_version(registrable_artifact, tmp_path, monkeypatch):
    """Another process moves @champion between two versions while serve's resolution path fetches it: each fetch
    is all of version 1 or all of version 2 (the alias is read once, then that version's files are fetched)."""
    uri = f"sqlite:///{tmp_path / 'reg' / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv("MLFLOW_REGISTRY_URI", raising=False)
    a = shutil.copytree(registrable_artifact, tmp_path / "a" / "writer")
    b = shutil.copytree(registrable_artifact, tmp_path / "b" / "writer")
    report = read_report(b)
    report.date = "2000-01-01"  # another evaluation: its report, card and manifest differ from a's
    write_report(b, report)
    whole = {1: tree(a), 2: tree(b)}
    assert whole[1] != whole[2]
    assert registry.register(a, model_name="race", alias="champion")["version"] == 1
    assert registry.register(b, model_name="race")["version"] == 2

    stop, moving = tmp_path / "stop", tmp_path / "moving"
    mover = subprocess.Popen([sys.executable, "-c", MOVE_ALIAS, str(stop), str(moving)], env=registry_env(uri),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    try:
        deadline = time.monotonic() + 120
        while not moving.exists():
            assert mover.poll() is None and time.monotonic() < deadline, mover.communicate()[1][-2000:]
            time.sleep(0.1)
        for i in range(40):
            got = tree(registry.resolve("models:/race@champion", tmp_path / f"serve{i}"))
            assert got in (whole[1], whole[2]), f"fetch {i} mixes the two versions' files"
            seen.append(1 if got == whole[1] else 2)
            if len(seen) >= 8 and set(seen) == {1, 2}:
                break
    finally:
        stop.touch()
        out, err = mover.communicate(timeout=60)
    assert mover.returncode == 0, err[-2000:]
    assert set(seen) == {1, 2}, f"the alias never moved under the fetches ({seen}, {out.strip()} moves)"

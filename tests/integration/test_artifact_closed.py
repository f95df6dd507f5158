"""An artifact is a closed set: eval and register refuse anything the manifest does not list, symlinks, and names
that leave the directory; the registry copies exactly what was verified."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

from quantize.manifest import ArtifactError, verify as verify_manifest
from tests.conftest import eval_main, registrable
from pipeline import registry
from pipeline.cli import main as cli_main


@pytest.fixture(scope="module")
def evaluated(tiny_llama, tmp_path_factory):
    return registrable(tmp_path_factory.mktemp("closed"), tiny_llama, "closed", windows=2)


@pytest.fixture
def art(evaluated, tmp_path):
    return shutil.copytree(evaluated, tmp_path / "closed")


@pytest.fixture
def sqlite_registry(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'reg' / 'mlflow.db'}")
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", f"sqlite:///{tmp_path / 'reg' / 'mlflow.db'}")
    return tmp_path / "reg"


def test_evaluated_artifact_verifies_with_its_report_and_card(art):
    """eval rewrote README.md and manifest.json and added report.json/.md: all of them are covered."""
    m = json.loads((art / "manifest.json").read_text())
    assert "README.md" in m["files"] and {"report.json", "report.md"} <= set(m["report"])
    assert verify_manifest(art) is True
    listed = set(m["files"]) | {n for n in m["report"] if n != "passed"} | {"manifest.json"}
    assert {p.name for p in art.iterdir()} == listed


def test_unlisted_safetensors_refused_by_eval_and_register(art, sqlite_registry, capsys):
    """A shard nobody listed (a zeroed embedding) would be decoded by eval and copied by register."""
    save_file({"model.embed_tokens.weight": torch.zeros(512, 256, dtype=torch.float16)},
              str(art / "model-extra.safetensors"))
    with pytest.raises(ArtifactError, match=r"model-extra.safetensors \(not listed in the manifest\)"):
        verify_manifest(art)
    assert eval_main(["--artifact", str(art), "--no-vllm", "--max-windows", "1"]) == 2
    err = capsys.readouterr().err
    assert "error: " in err and "model-extra.safetensors (not listed in the manifest)" in err
    assert cli_main(["register", "--artifact", str(art)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and err.endswith("model-extra.safetensors (not listed in the manifest)")
    assert not (sqlite_registry / "artifacts").exists()


def test_symlink_inside_artifact_refused_and_never_followed(art, tmp_path, sqlite_registry, capsys):
    secret = tmp_path / "secret.txt"
    secret.write_text("outside the artifact")
    os.symlink(secret, art / "notes.txt")
    assert cli_main(["register", "--artifact", str(art)]) == 2
    err = capsys.readouterr().err
    assert f"notes.txt (a symlink, to {secret})" in err
    assert not any(p.read_bytes() == secret.read_bytes() for p in tmp_path.rglob("*") if p.is_file()
                   and p != secret and not p.is_symlink())
    # a listed file swapped for a symlink to identical bytes: refused too (the bytes it points at can change)
    os.unlink(art / "notes.txt")
    shutil.copy(art / "config.json", tmp_path / "config-copy.json")
    os.unlink(art / "config.json")
    os.symlink(tmp_path / "config-copy.json", art / "config.json")
    with pytest.raises(ArtifactError, match=r"config.json \(a symlink, to "):
        verify_manifest(art)


def test_manifest_name_leaving_the_artifact_refused(art, tmp_path):
    (tmp_path / "outside.json").write_text("{}")
    m = json.loads((art / "manifest.json").read_text())
    m["files"]["../outside.json"] = {"sha256": "0" * 64, "bytes": 2}
    (art / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match=r"\.\./outside.json \(its path leads outside the artifact\)"):
        verify_manifest(art)


def test_register_copies_exactly_the_verified_files(art, sqlite_registry):
    res = registry.register(art)
    copied = next(sqlite_registry.rglob("model/manifest.json")).parent
    assert res["version"] == 1
    assert {p.name: p.read_bytes() for p in copied.iterdir()} == {p.name: p.read_bytes() for p in art.iterdir()}


def test_corrupt_registry_database_is_one_line(sqlite_registry, capsys):
    sqlite_registry.mkdir(parents=True, exist_ok=True)
    (sqlite_registry / "mlflow.db").write_bytes(os.urandom(4096))
    assert cli_main(["registry"]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and "\n" not in err
    assert err.startswith(f"error: the model registry sqlite:///{sqlite_registry / 'mlflow.db'} cannot be used (")
    assert f"move {sqlite_registry / 'mlflow.db'} aside (a new one is created)" in err

"""MLflow registry (a temporary SQLite file): register an evaluated artifact, read it back; refuse bad ones."""

import json
import shutil

import pytest

from tests.conftest import eval_main
from pipeline import registry
from pipeline.cli import main as cli_main
from quantize.records import Report

pytestmark = pytest.mark.vllm  # only artifacts that vLLM loaded are registered


@pytest.fixture
def sqlite_registry(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'reg.db'}")
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", f"sqlite:///{tmp_path / 'reg.db'}")
    return tmp_path


@pytest.fixture(scope="module")
def evaluated(tiny_eval_artifact):
    out, recipe = tiny_eval_artifact
    rep = out / "report.json"
    if not rep.is_file() or "skipped" in json.loads(rep.read_text())["vllm_smoke"]:
        assert eval_main([str(recipe), "--artifact", str(out)]) == 0
    return out


def test_register_then_read_back_with_metrics(evaluated, sqlite_registry, capsys):
    res = registry.register(evaluated)
    assert res["name"] == "tiny-eval" and res["version"] == 1 and res["source"].endswith("/model")
    copied = sqlite_registry / "artifacts"  # beside the database file, not in the working directory
    assert res["source"].startswith(copied.as_uri()) and list(copied.rglob("model/manifest.json"))
    again = registry.register(evaluated, by_reference=True)
    assert again["version"] == 2 and again["source"] == evaluated.resolve().as_uri()
    rows = registry.versions("tiny-eval")
    assert [r["version"] for r in rows] == [2, 1]
    report = json.loads((evaluated / "report.json").read_text())
    v1 = rows[1]
    assert v1["metrics"]["ppl"] == pytest.approx(report["perplexity"]["quantized"]["ppl"])
    assert v1["metrics"]["vllm_smoke_passed"] == 1.0
    assert v1["tags"]["method"] == "awq" and v1["tags"]["group_size"] == "64"
    assert v1["tags"]["base_model"] == json.loads((evaluated / "manifest.json").read_text())["model"]["spec"]
    assert cli_main(["registry"]) == 0
    out = capsys.readouterr().out
    assert "tiny-eval" in out and "awq" in out and f"{report['perplexity']['quantized']['ppl']:9.4f}" in out


def test_tampered_failed_and_unevaluated_artifacts_are_refused(evaluated, sqlite_registry, tmp_path, capsys):
    bad = tmp_path / "tampered"
    shutil.copytree(evaluated, bad)
    (bad / "config.json").write_text((bad / "config.json").read_text().replace("64", "65", 1))
    assert cli_main(["register", "--artifact", str(bad)]) == 2
    assert "config.json (sha256 differs from the manifest)" in capsys.readouterr().err

    failed = tmp_path / "failed"
    shutil.copytree(evaluated, failed)
    rep = json.loads((failed / "report.json").read_text())
    rep.update(passed=False, gates={**rep["gates"], "passed": False,
                                    "failures": ["perplexity delta 9.0 > eval.max_ppl_delta 1.0"]})
    from pipeline.stages import write_report

    write_report(failed, Report.model_validate(rep))  # a consistent, verified artifact whose eval failed
    with pytest.raises(registry.RegistryError, match="its eval failed: perplexity delta 9.0"):
        registry.register(failed)

    fresh = tmp_path / "fresh"
    shutil.copytree(evaluated, fresh)
    m = json.loads((fresh / "manifest.json").read_text())
    m.pop("report")
    (fresh / "manifest.json").write_text(json.dumps(m))
    for name in ("report.json", "report.md"):  # what quantize alone leaves: no report files either
        (fresh / name).unlink()
    with pytest.raises(registry.RegistryError, match="not evaluated; run `make eval RECIPE=tiny-eval`"):
        registry.register(fresh)
    assert registry.versions() == []  # nothing was registered by any refused attempt

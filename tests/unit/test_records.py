"""The manifest and the report read through their schema classes: a record written by an earlier version (a real
tiny-model run, kept in tests/golden/records) reads and writes back to the same bytes, the card and the report
rendered from the records are the ones that run wrote, unknown keys survive, a writer's stray key is refused,
and a damaged record a user hands in is one `error:` line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quantize import manifest
from quantize.export import modelcard
from quantize.records import Manifest, Report

RECORDS = Path(__file__).resolve().parents[1] / "golden" / "records"
RUNS = sorted(p.name for p in RECORDS.iterdir())  # an AWQ dense run with its eval; a GPTQ mixture of experts


def _dumped(record) -> str:
    return json.dumps(record.to_json(), indent=2) + "\n"  # as manifest.py and pipeline/stages.py write them


@pytest.mark.parametrize("run", RUNS)
def test_a_written_manifest_and_report_read_and_write_back_byte_for_byte(run):
    for name, cls in (("manifest.json", Manifest), ("report.json", Report)):
        text = (RECORDS / run / name).read_text()
        record = cls.model_validate(json.loads(text))
        assert _dumped(record) == text, f"{run}/{name} changed on a read and write"
        assert record.undeclared() == [], "every key this version writes is declared"


@pytest.mark.parametrize("run", RUNS)
def test_the_card_and_the_report_render_from_the_records_as_that_run_wrote_them(run):
    from eval.report_md import render_markdown

    m, r = manifest.read(RECORDS / run), manifest.read_report(RECORDS / run)
    assert isinstance(m, Manifest) and isinstance(r, Report)
    assert modelcard.render(m, r) == (RECORDS / run / "README.md").read_text()
    assert render_markdown(r) == (RECORDS / run / "report.md").read_text()


def test_typed_reads_of_the_nested_parts():
    m = manifest.read(RECORDS / "records-gptq-moe")
    assert (m.recipe.method, m.format.quant_method, m.stats_key) == ("gptq", "gptq", "gptq_stats")
    layers = m.expert_layers()
    assert [i for i, _ in layers] == [0, 1] and layers[0][1].tokens == 1024 and len(layers[0][1].routed_tokens) == 4
    assert m.report.passed and set(m.report.hashes()) == {"report.json", "report.md"}
    assert m.files["model.safetensors"].bytes > 0 and m.capacity.sequences_that_fit["artifact/fp8"]["24"] > 0
    r = manifest.read_report(RECORDS / "records-awq")
    assert r.perplexity.protocol.windows == 4 and r.gates.passed and r.vllm_smoke.skipped
    assert r.output_error_worst[0].error >= r.output_error_worst[-1].error


def test_unknown_keys_of_another_version_are_kept_where_they_stood():
    """A newer version's extra keys (top level and nested) neither fail the read nor move on a write back."""
    data = json.loads((RECORDS / "records-awq" / "manifest.json").read_text())
    newer = {"artifact": data["artifact"], "from_the_future": {"x": 1}, **data}
    newer["recipe"] = {**newer["recipe"], "new_option": 3}
    newer["model"] = {"added": True, **newer["model"]}
    newer["report"] = {**newer["report"], "report.html": "0" * 64}
    m = Manifest.model_validate(newer)
    assert json.dumps(m.to_json()) == json.dumps(newer)
    assert m.undeclared() == ["from_the_future", "model.added", "report.report.html"]  # a recipe's keys are open
    assert m.report.hashes()["report.html"] == "0" * 64  # verify checks a report file a newer eval added


def test_an_older_manifest_without_the_optional_records_reads():
    """An artifact from before serve configs, capacity, deploy tables and output errors still reads."""
    data = json.loads((RECORDS / "records-awq" / "manifest.json").read_text())
    for key in ("deploy", "serve", "serve_endpoint", "capacity", "output_error", "error_plot", "shared_pass",
                "cuda_allocator", "pass_seconds", "report"):
        data.pop(key, None)
    m = Manifest.model_validate(data)
    assert json.dumps(m.to_json()) == json.dumps(data)  # nothing absent is written back as null
    card = modelcard.render(m)
    assert "vllm serve /path/to/this/directory" in card and "## Deployment" not in card


def test_an_artifact_of_the_first_manifest_shape_still_verifies(tmp_path):
    """`verify` (and so `make serve` of a registered version) reads only the files' and the report's hashes: a
    manifest of the first shape (its format unnamed, a recipe of other keys) still verifies and is still refused
    when a file differs; a full read (the card, the registry), which needs the format's name, refuses it with a
    message that names the key."""
    data = json.loads((RECORDS / "records-awq" / "manifest.json").read_text())
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    manifest.write(tmp_path, Manifest.model_validate({k: v for k, v in data.items() if k not in ("files", "report")}))
    first = {"artifact": "tiny", "format": {"quant_method": "awq", "version": "gemm"}, "recipe": {"name": "tiny"},
             "files": json.loads((tmp_path / "manifest.json").read_text())["files"]}
    (tmp_path / "manifest.json").write_text(json.dumps(first, indent=2))
    assert manifest.verify(tmp_path) is True
    with pytest.raises(manifest.ArtifactError, match=r"manifest.json is not a manifest this version can read "
                                                      r"\(format.name: Field required"):
        manifest.read(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"weightz")
    with pytest.raises(manifest.ArtifactError, match=r"model.safetensors \(sha256 differs from the manifest\)"):
        manifest.verify(tmp_path)


def test_a_writer_stray_key_is_refused(tmp_path):
    data = json.loads((RECORDS / "records-awq" / "manifest.json").read_text())
    data.pop("files"), data.pop("report")
    (tmp_path / "a.txt").write_text("a")
    manifest.write(tmp_path, Manifest.model_validate(data))
    written = json.loads((tmp_path / "manifest.json").read_text())
    assert list(written) == [*data, "files"] and written["files"]["a.txt"]["bytes"] == 1
    with pytest.raises(TypeError, match=r"no record declares: \['capacity.kv_byte_per_token'\]"):
        manifest.write(tmp_path, Manifest.model_validate(
            {**data, "capacity": {**data["capacity"], "kv_byte_per_token": 1}}))


@pytest.mark.parametrize("content,why", [
    ("{}", "(artifact: Field required (and 3 more))"),
    ('{"artifact": "x", "format": {"name": "awq"}, "recipe": {}, "model": {"spec": "m"}}',
     "(format.quant_method: Field required (and 5 more))"),
    ("MANIFEST_WITH_BAD_RECIPE", "(recipe.w_bit: Input should be a valid integer"),
])
def test_a_malformed_manifest_handed_to_eval_is_one_error_line(tmp_path, capsys, content, why):
    from pipeline.cli import main

    art = tmp_path / "art"
    art.mkdir()
    (art / "config.json").write_text("{}")
    if content == "MANIFEST_WITH_BAD_RECIPE":
        data = json.loads((RECORDS / "records-awq" / "manifest.json").read_text())
        content = json.dumps({**data, "recipe": {**data["recipe"], "w_bit": "four"}})
    (art / "manifest.json").write_text(content)
    assert main(["eval", "--artifact", str(art), "--no-vllm"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {art / 'manifest.json'} is not a manifest this version can "
                                               f"read {why}"), err
    assert err[0].endswith("restore that file, or re-create the artifact with make quantize")


def test_a_malformed_report_handed_to_the_registry_is_one_error_line(tmp_path, capsys, monkeypatch):
    """A closed, verified artifact whose report.json (hashed into its manifest) is not a report."""
    from pipeline.cli import main

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    art = tmp_path / "art"
    art.mkdir()
    (art / "config.json").write_text("{}")
    data = json.loads((RECORDS / "records-awq" / "manifest.json").read_text())
    manifest.write(art, Manifest.model_validate({k: v for k, v in data.items() if k not in ("files", "report")}))
    (art / "report.json").write_text('{"passed": true}')
    (art / "report.md").write_text("# report\n")
    manifest.add_report(art, True, None)
    assert manifest.verify(art)
    assert main(["register", "--artifact", str(art)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {art / 'report.json'} is not a report this version can "
                                               f"read (date: Field required (and 2 more)); restore that file, or "
                                               f"evaluate the artifact again with make eval"), err
    assert not (tmp_path / "mlflow.db").exists()  # refused before the registry was opened

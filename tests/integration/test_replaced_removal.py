"""`--force` over an existing artifact: export removes the previous one once the new one is in place and reports
those seconds as its own `replaced` part, not inside `seal` (a replaced 7B artifact took 1.8-2.2 s there)."""

from quantize import runner
from quantize.runlog import RunLog
from tests.conftest import tiny_recipe


def test_previous_artifact_removed_in_export_and_timed_apart(tiny_llama, tmp_path, caplog):
    recipe = tiny_recipe(tmp_path, tiny_llama, name="keep", method="rtn")
    arts = tmp_path / "artifacts"
    first = RunLog()
    runner.run(recipe, out_root=arts, runlog=first)
    assert "replaced" not in first.export_parts and "seal" in first.export_parts  # nothing was there to replace
    again = RunLog()
    with caplog.at_level("INFO"):
        runner.run(recipe, out_root=arts, force=True, runlog=again)
    assert again.export_parts["replaced"] > 0 and again.export_parts["seal"] >= 0
    assert any(r.getMessage().startswith(f"wrote {arts / 'keep'}") and "replaced" in r.getMessage()
               for r in caplog.records)
    assert sorted(p.name for p in arts.iterdir()) == ["keep"] and (arts / "keep" / "manifest.json").is_file()

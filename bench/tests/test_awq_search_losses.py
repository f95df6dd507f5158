"""bench/awq_search_losses.py: its recording search is the exhaustive search (same artifact), and its analysis
reads the losses it records."""

from __future__ import annotations

import json

from bench import awq_search_losses
from quantize import runner
from quantize.methods import awq_search as awq
from tests.conftest import tiny_recipe


def test_recorded_run_is_the_recipe_and_its_losses_analyse(tiny_qwen2, tmp_path, monkeypatch):
    monkeypatch.setattr(awq, "search_scales", awq.search_scales)  # record() replaces it for the process
    recipe = tiny_recipe(tmp_path, tiny_qwen2, name="l")  # 16 samples, batch_size 4
    plain = runner.run(str(recipe), tmp_path / "plain")
    awq_search_losses.record(str(recipe), tmp_path / "l.json", tmp_path / "rec")
    recorded = tmp_path / "rec" / "l"
    for f in sorted(p.name for p in plain.glob("*.safetensors")):
        assert (plain / f).read_bytes() == (recorded / f).read_bytes()
    doc = json.loads((tmp_path / "l.json").read_text())
    grid = len(doc["searches"][0]["losses"])
    assert len(doc["searches"]) == 2 * 2  # the attention and MLP blocks of each of the 2 layers
    assert all(len(per) == 4 for s in doc["searches"] for per in s["losses"])  # 4 batches of 4 samples
    result = awq_search_losses.analyse(tmp_path / "l.json")
    assert result["searches"] == 4 and result["batches"] == 4 and result["grid"] == grid
    assert 1 / grid <= result["exact_pruning_cost"] <= 1
    full = [r for r in result["screened"] if r["batches"] == 3]
    assert {r["keep"] for r in full} == {1, 2, 3, 4, 5} and all(0 <= r["same_pick"] <= 4 for r in full)
    awq_search_losses.main(["analyse", str(tmp_path / "l.json"), "--plot", str(tmp_path / "l.png")])
    assert (tmp_path / "l.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

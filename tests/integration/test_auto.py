"""`method: auto` end to end on a tiny model: one pass over three methods, each scored on held-out calibration
samples, and the artifact written is the lowest KL's, the one a recipe naming that method writes."""

import json

import torch
from transformers import AutoTokenizer

from eval import heldout
from pipeline.cli import main
from pipeline.stages import evaluate
from quantize import calib, manifest, runner
from quantize.recipe import EvalOptions, load_recipe
from quantize.source import load as source
from tests.conftest import tiny_recipe

CANDIDATES = ["awq", "gptq", "rtn"]


def test_auto_writes_the_artifact_of_the_lowest_held_out_kl(tiny_llama, tmp_path):
    recipe = tiny_recipe(tmp_path, tiny_llama, name="tiny-auto", method="auto", format="compressed-tensors",
                         auto={"candidates": CANDIDATES, "holdout_samples": 4})
    out_root = tmp_path / "out"
    assert main(["run", str(recipe), "--out", str(out_root), "--no-eval"]) == 0
    art = out_root / "tiny-auto"
    assert manifest.verify(art)  # a closed artifact: the card re-rendered with the choice is what it lists
    m = manifest.read(art)
    a = m.auto
    rows = {c.method: c for c in a.candidates}
    assert list(rows) == CANDIDATES and a.left_out == {}
    assert all(c.kl_mean is not None and c.kl_mean >= 0 and c.quantize_s > 0 and c.score_s > 0 for c in rows.values())
    assert a.chosen == min(rows, key=lambda k: rows[k].kl_mean) and m.recipe.method == a.chosen
    assert len({c.kl_mean for c in rows.values()}) == 3  # three methods, three different artifacts
    assert a.pass_s >= sum(c.quantize_s for c in rows.values()) and a.seconds > a.pass_s
    # the cost is the choice's, not the winner's share: the quantize stage is the whole pass, the scoring its own
    assert sum(c.quantize_s for c in rows.values()) <= m.timings_s["quantize"] <= a.pass_s and m.shared_pass is None
    assert m.timings_s["auto_score"] >= sum(c.score_s for c in rows.values())
    assert json.loads((out_root / "tiny-auto.auto.json").read_text()) == a.to_json()
    assert sorted(p.name for p in out_root.iterdir()) == ["tiny-auto", "tiny-auto.auto.json"]  # no candidate left
    card = (art / "README.md").read_text()
    assert "## Method chosen by auto" in card and f"| {a.chosen} (chosen) |" in card

    # the same recipe naming the winner, run alone: every file the same bytes but the manifest and the card
    direct_dir = tmp_path / "direct"
    direct_dir.mkdir()
    direct = runner.run(tiny_recipe(direct_dir, tiny_llama, name="tiny-auto", method=a.chosen,
                                    format="compressed-tensors"), out_root=tmp_path / "d")
    md = manifest.read(direct)
    differ = sorted(f for f in m.files if f not in ("README.md",) and m.files[f].sha256 != md.files[f].sha256)
    assert differ == [] and set(m.files) == set(md.files)

    # the recorded score is the winner's weights' own: scored again, on the direct run's artifact
    samples, fit_sha = _heldout(tiny_llama, load_recipe(recipe))
    src = source.resolve(str(tiny_llama))
    ref, _ = heldout.reference(src, samples, torch.float32, torch.device("cpu"))
    again = heldout.score(direct, samples, ref, torch.float32, torch.device("cpu"), "again")
    assert again["kl_mean"] == rows[a.chosen].kl_mean

    # the held-out blocks follow the ones the methods fit on, and none of them is among those
    fit = _blocks(tiny_llama, load_recipe(recipe), 16)
    assert m.calibration.model_extra["samples_sha256"] == calib.samples_sha256(fit) == fit_sha
    assert a.holdout["samples_sha256"] == calib.samples_sha256(samples) and a.holdout["first_sample"] == 16
    assert not any(torch.equal(h, f) for h in samples for f in fit)

    # the eval's report shows the choice too, and the card re-rendered with the eval's numbers keeps it
    eopts = EvalOptions.model_validate({"perplexity": {"seq_len": 64, "max_windows": 1}, "vllm": {"enabled": False},
                                        "max_kl": None, "min_top1": None})
    assert evaluate(art, None, eopts).auto.chosen == a.chosen
    assert f"| {a.chosen} (chosen) |" in (art / "report.md").read_text()
    assert "## Method chosen by auto" in (art / "README.md").read_text() and manifest.verify(art)


def _blocks(model_dir, recipe, n: int) -> torch.Tensor:
    c = recipe.calibration
    tok = AutoTokenizer.from_pretrained(model_dir)
    return calib.make_samples(calib.load_text(c.dataset).documents, tok, n, c.seq_len, c.seed)


def _heldout(model_dir, recipe):
    from pipeline.auto import heldout_samples

    return heldout_samples(recipe, AutoTokenizer.from_pretrained(model_dir))

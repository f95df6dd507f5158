"""The eval's inputs made ahead (`eval.prepared`): the same report as an eval that makes them itself, used only
for the base model and protocol they were made for, and a hashing that stops when told."""

import threading

import pytest

from eval import refcache
from eval import report as eval_report
from eval.prepared import Prepared
from quantize.recipe import load_recipe
from quantize.source import load as source


def _eopts(recipe_path):
    r = load_recipe(recipe_path)
    return r, r.eval.model_copy(update={"vllm": r.eval.vllm.model_copy(update={"enabled": False})})


def test_prepared_inputs_give_the_same_report(tiny_eval_artifact, tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTIZE_CACHE_DIR", str(tmp_path / "cache"))
    art, recipe_path = tiny_eval_artifact
    r, eopts = _eopts(recipe_path)
    plain = eval_report.evaluate(art, None, eopts)
    assert "reference_hash" in plain.eval_timings_s and not plain.scored_on.reference_cache["hit"]

    prepared = Prepared(r.model, eopts.perplexity)
    ready = prepared.take(r.model, eopts.perplexity)
    assert ready is not None and ready.windows.shape[0] == plain.perplexity.protocol.windows
    assert ready.model_sha256 == refcache.model_sha256(source.resolve(r.model).path)
    ahead = eval_report.evaluate(art, None, eopts, prepared=prepared)
    # the reference cache's key is built from the prepared hash and windows: the first eval's entry is found
    assert ahead.scored_on.reference_cache["hit"]
    assert ahead.perplexity.fp16.ppl == plain.perplexity.fp16.ppl
    assert ahead.perplexity.quantized.ppl == plain.perplexity.quantized.ppl
    assert ahead.perplexity.protocol == plain.perplexity.protocol
    assert ahead.distribution.kl_mean == plain.distribution.kl_mean
    assert "reference_hash" not in ahead.eval_timings_s
    assert ahead.eval_timings_s["inputs_prepared_during_quantize"] == ready.seconds


def test_prepared_inputs_of_another_protocol_or_model_are_not_used(tiny_eval_artifact, tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTIZE_CACHE_DIR", str(tmp_path / "cache"))
    art, recipe_path = tiny_eval_artifact
    r, eopts = _eopts(recipe_path)
    other = eopts.perplexity.model_copy(update={"max_windows": 2})
    prepared = Prepared(r.model, other)
    assert prepared.take(r.model, eopts.perplexity) is None
    assert prepared.take("some/other-model", other) is None
    assert prepared.take(r.model, other) is not None
    report = eval_report.evaluate(art, None, eopts, prepared=prepared)
    assert report.perplexity.protocol.windows == 4  # the recipe's own protocol, not the prepared one
    assert "reference_hash" in report.eval_timings_s and "inputs_prepared_during_quantize" not in report.eval_timings_s


def test_preparing_for_a_missing_model_leaves_the_eval_to_say_so(tmp_path):
    from quantize.recipe.options import PerplexityOptions

    prepared = Prepared(str(tmp_path / "no-such-model"), PerplexityOptions(max_windows=1))
    assert prepared.take(str(tmp_path / "no-such-model"), PerplexityOptions(max_windows=1)) is None


def test_model_hash_stops_when_told(tiny_llama):
    stop = threading.Event()
    stop.set()
    with pytest.raises(refcache.HashStopped):
        refcache.model_sha256(tiny_llama, workers=2, stop=stop)
    assert refcache.model_sha256(tiny_llama, workers=2) == refcache.model_sha256(tiny_llama)


def test_a_run_that_prepares_its_eval_inputs_reports_them(tiny_llama, tmp_path, monkeypatch):
    """`pipeline run` where the eval's inputs are prepared during the pass (a GPU run; here told to): the report
    says how long preparing them took, and the reference hash was not computed again."""
    import json

    from pipeline import stages
    from pipeline.cli import main
    from tests.conftest import tiny_recipe

    monkeypatch.setenv("QUANTIZE_CACHE_DIR", str(tmp_path / "cache"))
    started = []
    monkeypatch.setattr(stages, "prepares_eval", lambda recipe: started.append(recipe.name) or True)
    recipe = tiny_recipe(tmp_path, tiny_llama, name="tiny-prepared", method="rtn",
                         eval=dict(perplexity=dict(dataset="wikitext2", seq_len=256, max_windows=2),
                                   vllm=dict(enabled=False), lm_eval=dict(tasks=[])))
    assert main(["run", str(recipe), "--out", str(tmp_path / "a")]) == 0
    report = json.loads((tmp_path / "a" / "tiny-prepared" / "report.json").read_text())
    assert started == ["tiny-prepared"]
    assert report["eval_timings_s"]["inputs_prepared_during_quantize"] > 0
    assert "reference_hash" not in report["eval_timings_s"] and report["passed"]

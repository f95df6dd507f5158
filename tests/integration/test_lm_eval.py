"""lm-eval runs for real in the eval stage: the shipped task over the bundled text on both models (the reference's
scores cached with its perplexity), and a named task whose data cannot be reached gets one line saying why."""

import json
import time

import pytest

from eval import lmeval, refcache, report
from eval.smoke import vllm_unavailable
from eval.tasks import continuation
from tests.conftest import eval_main, tiny_recipe


def test_shipped_task_documents_are_fixed_and_hold_the_true_continuation():
    text = continuation.TEXT.read_text(encoding="utf-8")
    a, b = continuation.build(text), continuation.build(text)
    assert a == b and len(a) > 1000
    assert all(len(d["choices"]) == 4 and len(set(d["choices"])) == 4 for d in a)
    assert {d["label"] for d in a} == {0, 1, 2, 3}
    assert "wikitext_continuation" in lmeval.shipped_tasks()


def test_a_task_whose_data_cannot_be_reached_says_why_at_once(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t0 = time.perf_counter()
    loaded, not_run = lmeval.load_tasks(("hellaswag",))
    seconds = time.perf_counter() - t0  # reported, not asserted: a loaded machine may be slow
    assert loaded == {} and "HF_HUB_OFFLINE=1" in not_run["hellaswag"] and "hellaswag" in not_run["hellaswag"]
    print(f"hellaswag refused in {seconds:.3f} s")


def test_lm_eval_scores_both_models_and_caches_the_reference(tiny_llama, tmp_path, monkeypatch, capsys):
    from quantize import runner

    monkeypatch.setattr(refcache, "cache_dir", lambda: tmp_path / "cache")
    recipe = tiny_recipe(tmp_path, tiny_llama, name="tiny-lm-eval", eval=dict(
        perplexity=dict(dataset="wikitext2", seq_len=128, max_windows=2), vllm=dict(enabled=False),
        lm_eval=dict(tasks=["wikitext_continuation", "hellaswag"], limit=8)))
    out = runner.run(recipe, out_root=tmp_path / "a")
    assert eval_main([str(recipe), "--artifact", str(out)]) == 0
    lm = json.loads((out / "report.json").read_text())["lm_eval"]
    ref, q = lm["reference"]["scores"]["wikitext_continuation"], lm["quantized"]["scores"]["wikitext_continuation"]
    assert 0 <= ref["acc"] <= 1 and 0 <= q["acc"] <= 1 and {"acc", "acc_norm"} <= set(q)
    assert lm["difference"]["wikitext_continuation"]["acc"] == q["acc"] - ref["acc"]
    assert lm["reference"]["cached"] is False and "HF_HUB_OFFLINE=1" in lm["not_run"]["hellaswag"]
    assert "cannot be fetched from the hub" in (out / "report.md").read_text()
    # lm-eval's vLLM backend scores the artifact on vLLM's own 4-bit kernels wherever vLLM can serve it (the CPU
    # build on an AVX-512 processor, a CUDA host), else says why not
    why_not = vllm_unavailable()
    if why_not is None:
        assert 0 <= lm["vllm"]["scores"]["wikitext_continuation"]["acc"] <= 1, lm["vllm"]
    else:
        assert lm["vllm"] == {"skipped": why_not}
    loads = []
    real = report.source.load_model
    monkeypatch.setattr(report.source, "load_model", lambda *a, **k: loads.append(1) or real(*a, **k))
    capsys.readouterr()
    assert eval_main([str(recipe), "--artifact", str(out)]) == 0  # a task not run fails no gate
    assert loads == [] and "lm-eval hellaswag: not run" in capsys.readouterr().out
    again = json.loads((out / "report.json").read_text())["lm_eval"]
    assert again["reference"]["cached"] is True and again["reference"]["scores"] == lm["reference"]["scores"]
    assert again["quantized"]["scores"] == lm["quantized"]["scores"]


def test_hellaswag_subset_pairs_both_models_on_the_same_documents(tiny_llama, tmp_path, monkeypatch, capsys):
    from pipeline import compare, registry
    from quantize import runner
    from quantize.records import Report

    monkeypatch.setattr(refcache, "cache_dir", lambda: tmp_path / "cache")
    recipe = tiny_recipe(tmp_path, tiny_llama, name="tiny-hellaswag", eval=dict(
        perplexity=dict(dataset="wikitext2", seq_len=128, max_windows=2), vllm=dict(enabled=False),
        lm_eval=dict(tasks=["hellaswag_local"], subset=8, vllm=False)))
    out = runner.run(recipe, out_root=tmp_path / "a")
    assert eval_main([str(recipe), "--artifact", str(out)]) == 0
    rep = Report.model_validate_json((out / "report.json").read_text())
    lm = rep.lm_eval
    ids = lmeval.subset_indices(10042, 8)
    for side in (lm.reference, lm.quantized):
        assert side.outcomes["hellaswag_local"]["doc_id"] == ids  # the same documents on both sides
        assert sum(side.outcomes["hellaswag_local"]["acc_norm"]) / 8 == side.scores["hellaswag_local"]["acc_norm"]
    p = lm.paired["hellaswag_local"]["acc_norm"]
    assert p.n == 8 and p.delta == pytest.approx(lm.difference["hellaswag_local"]["acc_norm"])
    assert "± paired stderr" in (out / "report.md").read_text()
    card = (out / "README.md").read_text()
    assert "acc_norm Δ against the base" in card and "lm-eval `hellaswag_local` acc_norm on 8 documents" in card
    assert "distinguishable" in capsys.readouterr().out
    m = registry._metrics(compare.manifest.read(out), rep)
    assert m["lm_eval_delta_stderr_hellaswag_local_acc_norm"] == p.stderr
    md = compare.render_markdown("x", [compare.row(out)], {"date": "d", "machine": "m"})
    assert "| tiny-hellaswag | hellaswag_local | acc_norm | 8 |" in md

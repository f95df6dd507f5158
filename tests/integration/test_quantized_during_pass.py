"""The artifact decoded during the reference's pass where the device has room for both: the same numbers as
decoding it after, the decode on a thread of its own, and nothing left running when the eval fails."""

import json
import threading

import pytest

from eval import refcache, report
from pipeline import stages
from quantize import runner
from quantize.recipe import EvalOptions
from tests.conftest import tiny_recipe


@pytest.fixture(scope="module")
def artifact(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("during")
    recipe = tiny_recipe(tmp, tiny_llama, name="tiny-during", eval=dict(vllm=dict(enabled=False)))
    return runner.run(recipe, out_root=tmp / "a")


EOPTS = dict(perplexity=dict(dataset="wikitext2", seq_len=128, max_windows=3), vllm=dict(enabled=False),
             max_kl=None, min_top1=None, max_ppl_delta_pct=None)


@pytest.fixture
def decodes(monkeypatch):
    """Every decode of the artifact, as the name of the thread that ran it."""
    seen = []
    real = report.load_dequantized
    monkeypatch.setattr(report, "load_dequantized",
                        lambda *a, **k: seen.append(threading.current_thread().name) or real(*a, **k))
    return seen


def _left() -> list[threading.Thread]:
    """The decode's thread if it still runs: one whose work has ended exits within moments of handing its result
    back (a pool's worker returns after it), so each is given that long."""
    threads = [t for t in threading.enumerate() if t.name.startswith("quantized-load")]
    for t in threads:
        t.join(timeout=10)
    return [t for t in threads if t.is_alive()]


def test_decoded_during_the_pass_gives_the_same_report(artifact, decodes, monkeypatch, tmp_path):
    monkeypatch.setattr(refcache, "cache_dir", lambda: tmp_path / "after")
    after = stages.evaluate(artifact, None, EvalOptions(**EOPTS))
    assert decodes == ["MainThread"]  # the CPU never has room for both: decoded after the pass, in line
    monkeypatch.setattr(report._Quantized, "room", lambda self, ref, batch, seq_len: True)
    monkeypatch.setattr(refcache, "cache_dir", lambda: tmp_path / "during")
    during = stages.evaluate(artifact, None, EvalOptions(**EOPTS))
    assert len(decodes) == 2 and decodes[1].startswith("quantized-load")
    assert {"load_quantized", "load_quantized_wait"} <= set(during.eval_timings_s)
    assert "load_quantized_wait" not in after.eval_timings_s
    assert during.perplexity.model_dump() | {"fp16": None, "quantized": None} == \
        after.perplexity.model_dump() | {"fp16": None, "quantized": None}
    for side in ("fp16", "quantized"):
        assert getattr(during.perplexity, side).ppl == getattr(after.perplexity, side).ppl
    assert during.distribution.kl_mean == after.distribution.kl_mean
    assert during.distribution.top1 == after.distribution.top1
    assert json.loads((artifact / "report.json").read_text())["perplexity"]["quantized"]["ppl"] == \
        after.perplexity.quantized.ppl
    assert not _left()


def test_a_failing_reference_pass_leaves_no_decode_running(artifact, decodes, monkeypatch, tmp_path):
    monkeypatch.setattr(refcache, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(report._Quantized, "room", lambda self, ref, batch, seq_len: True)
    real = report.perplexity

    def failing(model, wins, batch=1, label="model", **k):
        if label == "reference":
            raise RuntimeError("the reference's pass failed (this test)")
        return real(model, wins, batch, label, **k)

    monkeypatch.setattr(report, "perplexity", failing)
    with pytest.raises(RuntimeError, match="this test"):
        stages.evaluate(artifact, None, EvalOptions(**EOPTS))
    assert len(decodes) == 1 and decodes[0].startswith("quantized-load")
    assert not _left()

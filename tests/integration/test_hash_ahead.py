"""The base model's files hashed during a GPU run's quantize stage, for its eval's reference-cache key: the same
sha256 as the eval's own hash, used only for files unchanged since, stopped on every way out."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from eval import refcache
from pipeline import stages
from pipeline.cli import main
from quantize import runner
from quantize.preflight import stage
from quantize.preflight.checks import PreflightError
from tests.conftest import threads_running, tiny_recipe


@pytest.fixture
def model(tiny_llama, tmp_path):
    """A copy of the tiny model whose files a test may touch."""
    return Path(shutil.copytree(tiny_llama, tmp_path / "model"))


def test_ahead_gives_the_eval_hash_of_the_files_as_they_stand(model, tmp_path):
    ahead = refcache.HashAhead(model)
    assert ahead.result(model) == refcache.model_sha256(model)
    assert ahead.seconds is not None
    assert ahead.result(tmp_path) is None  # asked about another directory


def test_files_changed_since_the_hash_began_are_hashed_again(model):
    ahead = refcache.HashAhead(model)
    ahead.future.result()
    config = model / "config.json"
    st = config.stat()
    os.utime(config, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert ahead.result(model) is None


def test_cancel_stops_the_hash(model):
    # 2 GiB of sparse data beside the weights: hashing it takes far longer than the cancel that follows the start
    with open(model / "zz-extra.safetensors", "wb") as f:
        f.truncate(2 << 30)
    ahead = refcache.HashAhead(model)
    ahead.cancel()
    assert isinstance(ahead.future.exception(timeout=60), refcache.Cancelled)
    assert ahead.result(model) is None
    assert not threads_running("base-model-hash")
    with pytest.raises(refcache.Cancelled):
        refcache.model_sha256(model, stop=ahead.stop)


@pytest.fixture
def as_if_cuda(monkeypatch, tmp_path):
    """The run's hook sees a CUDA run (the quantize and eval stages still compute on the CPU)."""
    real = stages.BaseHashes.before_weights
    monkeypatch.setattr(stages.BaseHashes, "before_weights",
                        lambda self, recipes, tokenizer, src, device: real(self, recipes, tokenizer, src,
                                                                           torch.device("cuda")))
    monkeypatch.setattr(refcache, "cache_dir", lambda: tmp_path / "cache")


def _recipe(tmp_path, model):
    return tiny_recipe(tmp_path, model, name="tiny-hash", eval=dict(
        perplexity=dict(dataset="wikitext2", seq_len=128, max_windows=2), vllm=dict(enabled=False),
        max_ppl_delta_pct=None))


def test_a_gpu_run_eval_uses_the_hash_made_during_its_quantize_stage(model, tmp_path, as_if_cuda):
    assert main(["run", str(_recipe(tmp_path, model)), "--out", str(tmp_path / "a")]) == 0
    rep = json.loads((tmp_path / "a" / "tiny-hash" / "report.json").read_text())
    timings = rep["eval_timings_s"]
    assert "reference_hash_ahead" in timings and "reference_hash_wait" in timings
    assert "reference_hash" not in timings
    assert rep["scored_on"]["reference_cache"]["model_sha256"] == refcache.model_sha256(model)
    assert not threads_running("base-model-hash")


def test_a_cpu_run_hashes_in_its_eval(model, tmp_path, monkeypatch):
    monkeypatch.setattr(refcache, "cache_dir", lambda: tmp_path / "cache")
    assert main(["run", str(_recipe(tmp_path, model)), "--out", str(tmp_path / "a")]) == 0
    timings = json.loads((tmp_path / "a" / "tiny-hash" / "report.json").read_text())["eval_timings_s"]
    assert "reference_hash" in timings and "reference_hash_ahead" not in timings


def test_a_run_refused_after_the_hash_began_leaves_none_running(model, tmp_path, as_if_cuda, monkeypatch, capsys):
    started = []
    real = refcache.HashAhead

    def spy(path):
        started.append(real(path))
        return started[-1]

    monkeypatch.setattr(refcache, "HashAhead", spy)

    def no_disk(*a, **k):
        raise PreflightError("not enough free disk (this test)")

    monkeypatch.setattr(stage, "check_free_disk", no_disk)
    assert main(["run", str(_recipe(tmp_path, model)), "--out", str(tmp_path / "a")]) == 2
    assert "error: not enough free disk" in capsys.readouterr().err
    assert len(started) == 1 and started[0].stop.is_set()
    assert not threads_running("base-model-hash")
    assert not (tmp_path / "a" / "tiny-hash").exists()

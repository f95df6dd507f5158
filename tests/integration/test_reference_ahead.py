"""The reference model loading ahead, beside the eval's hashing and tokenizing: only when it will be scored, never
while a vLLM smoke test still needs the device, never left loading after the eval, with the same numbers."""

import json
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch

from eval import refcache, report
from pipeline import stages
from quantize import runner
from quantize.manifest import ArtifactError
from quantize.recipe import EvalOptions
from tests.conftest import eval_main, threads_running, tiny_recipe


@pytest.fixture(scope="module")
def artifact(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ahead")
    recipe = tiny_recipe(tmp, tiny_llama, name="tiny-ahead", eval=dict(
        perplexity=dict(dataset="wikitext2", seq_len=128, max_windows=3), vllm=dict(enabled=False),
        max_ppl_delta_pct=50))
    return runner.run(recipe, out_root=tmp / "a"), recipe


@pytest.fixture
def loads(monkeypatch):
    """Every reference load, as the name of the thread that ran it."""
    seen = []
    real = report.source.load_model
    monkeypatch.setattr(report.source, "load_model",
                        lambda *a, **k: seen.append(threading.current_thread().name) or real(*a, **k))
    return seen


def test_cold_cache_loads_ahead_warm_cache_loads_nothing(artifact, loads, monkeypatch, tmp_path):
    out, recipe = artifact
    monkeypatch.setattr(refcache, "cache_dir", lambda: tmp_path)
    assert not refcache.probably_cached(recipe_model(out), torch.float32, torch.device("cpu"), 64)
    assert eval_main([str(recipe), "--artifact", str(out)]) == 0
    first = json.loads((out / "report.json").read_text())
    assert len(loads) == 1 and loads[0].startswith("reference-load")
    assert {"load_reference", "load_reference_wait", "reference_hash", "reference_store"} <= set(first["eval_timings_s"])
    # the entry was written beside the artifact's load and waited for before the report
    assert Path(first["scored_on"]["reference_cache"]["stored"]).is_file()
    assert not threads_running("reference-load", "reference-store")
    # the files were hashed and their entry stored: the next eval guesses a hit and loads nothing
    assert refcache.probably_cached(recipe_model(out), torch.float32, torch.device("cpu"), 64)
    assert not refcache.probably_cached(recipe_model(out), torch.float32, torch.device("cpu"), 32)
    assert eval_main([str(recipe), "--artifact", str(out)]) == 0
    again = json.loads((out / "report.json").read_text())
    assert len(loads) == 1 and again["scored_on"]["reference_cache"]["hit"] is True
    assert "load_reference" not in again["eval_timings_s"]
    assert again["perplexity"]["fp16"] == first["perplexity"]["fp16"]
    assert again["distribution"] == first["distribution"]


def test_the_guess_follows_the_files_and_the_numbers_do_not(artifact, loads, monkeypatch, tmp_path):
    """A touched file is a miss for the guess (the reference loads ahead); the hash still finds the entry, so the
    early load goes unused, is waited for and dropped, and the report reads the cache as before."""
    out, recipe = artifact
    monkeypatch.setattr(refcache, "cache_dir", lambda: tmp_path)
    assert eval_main([str(recipe), "--artifact", str(out)]) == 0
    first = json.loads((out / "report.json").read_text())
    model = recipe_model(out)
    config = model / "config.json"
    st = config.stat()
    try:
        os.utime(config, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        assert not refcache.probably_cached(model, torch.float32, torch.device("cpu"), 64)
        assert eval_main([str(recipe), "--artifact", str(out)]) == 0
    finally:
        os.utime(config, ns=(st.st_atime_ns, st.st_mtime_ns))
    again = json.loads((out / "report.json").read_text())
    assert len(loads) == 2 and loads[1].startswith("reference-load")  # loaded ahead, not used
    assert again["scored_on"]["reference_cache"]["hit"] is True
    assert "load_reference_wait" not in again["eval_timings_s"]
    assert again["perplexity"]["fp16"] == first["perplexity"]["fp16"]
    assert again["perplexity"]["quantized"]["ppl"] == first["perplexity"]["quantized"]["ppl"]
    assert not threads_running("reference-load", "reference-store")


def test_no_load_ahead_while_vllm_needs_the_device(artifact, loads, monkeypatch, tmp_path):
    """Where the smoke test runs, vLLM starts on a device this process holds nothing on: the reference loads only
    when the smoke test asks for it, in line."""
    out, recipe = artifact
    art = tmp_path / "art"
    shutil.copytree(out, art)
    monkeypatch.setattr(refcache, "cache_dir", lambda: tmp_path / "cache")
    monkeypatch.setattr(report, "vllm_unavailable", lambda: None)
    loaded_at_smoke = []

    def fake_smoke(artifact, reference, *a, **k):
        loaded_at_smoke.append(list(loads))
        reference()
        return {"passed": False, "errors": ["not served in this test"]}

    monkeypatch.setattr(report, "smoke", fake_smoke)
    eopts = EvalOptions(perplexity=dict(dataset="wikitext2", seq_len=128, max_windows=2), max_kl=None,
                        min_top1=None, max_ppl_delta_pct=None)
    r = stages.evaluate(art, None, eopts)
    assert loaded_at_smoke == [[]]  # nothing on the device when the server would start
    assert loads == ["MainThread"] and not r.passed
    assert "load_reference_wait" not in r.eval_timings_s


def test_a_refused_artifact_leaves_no_load_running(artifact, loads, monkeypatch, tmp_path):
    """An artifact whose manifest does not verify is refused while the reference loads ahead: the refusal waits
    for that load, so nothing keeps filling the device after the eval has answered."""
    out, recipe = artifact
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    with open(bad / "model.safetensors", "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    monkeypatch.setattr(refcache, "cache_dir", lambda: tmp_path / "cache")
    eopts = EvalOptions(perplexity=dict(dataset="wikitext2", seq_len=128, max_windows=2), vllm=dict(enabled=False))
    with pytest.raises(ArtifactError, match="sha256 differs from the manifest"):
        stages.evaluate(bad, None, eopts)
    assert len(loads) == 1 and loads[0].startswith("reference-load")
    assert not threads_running("reference-load", "reference-store")


def recipe_model(out):
    """The base model directory the artifact's manifest names."""
    return Path(json.loads((out / "manifest.json").read_text())["model"]["resolved"])

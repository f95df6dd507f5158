"""What a user who points a recipe at their own model is told: a mistyped directory does not exist, a directory
without weight files has none; nothing is looked up on the hub for either."""

from __future__ import annotations

import pytest

from quantize.source import load as source


@pytest.fixture
def no_hub(monkeypatch):
    """Any hub lookup fails the test: a local path must never be taken for a hub id."""
    import huggingface_hub

    def refuse(*a, **k):
        raise AssertionError("a local path was looked up on the hub")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)


@pytest.mark.parametrize("spec", ["./my-model", "../models/mine", "models/mine", "/abs/models/mine", "a/b/c"])
def test_a_mistyped_local_directory_says_it_does_not_exist(tmp_path, monkeypatch, no_hub, spec):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()  # `models/mine`: its parent is here, so it is a local path, not owner/name
    with pytest.raises(source.ModelSourceError, match=r"directory .* does not exist; fix the path") as e:
        source.resolve(spec)
    assert "local_files_only" not in str(e.value) and "hub" in str(e.value)


def test_a_hub_id_offline_says_it_is_not_in_the_cache(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(source.ModelSourceError, match="HF_HUB_OFFLINE=1 and it is not in the local hub cache"):
        source.resolve("Owner/model-7b")


def test_config_without_weights_says_no_weight_files_were_found(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    src = source.resolve(str(tmp_path / "m"))
    with pytest.raises(source.ModelSourceError, match=r"no weight files were found in .*m \(no \*\.safetensors") as e:
        source.check_weights(src)
    assert "pickle" not in str(e.value).lower()


def test_a_tokenizer_is_loaded_once_while_its_files_are_unchanged(tmp_path):
    """A run asks for its base model's tokenizer three times; the same object comes back until a tokenizer file
    changes, and a broken rewrite is still refused with the usual message."""
    import os

    from tests.conftest import build_tiny_model

    src = source.resolve(str(build_tiny_model(tmp_path / "m", "llama")))
    first = source.load_tokenizer(src)
    assert source.load_tokenizer(src) is first
    assert first("hello world")["input_ids"] == source.load_tokenizer(src)("hello world")["input_ids"]
    tj = src.path / "tokenizer.json"
    os.utime(tj, ns=(tj.stat().st_atime_ns, tj.stat().st_mtime_ns + 1_000_000))  # touched: loaded again
    again = source.load_tokenizer(src)
    assert again is not first and again("hello world")["input_ids"] == first("hello world")["input_ids"]
    tj.write_text("{ not json")
    with pytest.raises(source.ModelSourceError, match="the tokenizer in .* cannot be loaded"):
        source.load_tokenizer(src)

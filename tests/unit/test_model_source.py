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

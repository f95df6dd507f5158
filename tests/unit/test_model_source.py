"""What a user who points a recipe at their own model is told: a mistyped directory does not exist, a directory
without weight files has none; nothing is looked up on the hub for either."""

from __future__ import annotations

import pytest

from quantize.source import ModelSourceError, load as source


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
    with pytest.raises(ModelSourceError, match=r"directory .* does not exist; fix the path") as e:
        source.resolve(spec)
    assert "local_files_only" not in str(e.value) and "hub" in str(e.value)


def test_a_hub_id_offline_says_it_is_not_in_the_cache(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(ModelSourceError) as e:
        source.resolve("Owner/model-7b")
    assert f"there is no directory {tmp_path / 'Owner' / 'model-7b'} (resolved against the working directory)" \
        in str(e.value)
    assert "hub id 'Owner/model-7b' is not in the local hub cache (HF_HUB_OFFLINE=1: the hub was not asked)" \
        in str(e.value)


def test_a_recipe_model_missing_beside_it_and_from_the_hub_cache_says_both(tmp_path, monkeypatch):
    """`model: models/does-not-exist` reads like a hub id: the message names the directory looked for beside the
    recipe and the hub id looked for in the cache, what to change, and none of the hub library's own text."""
    from quantize.recipe import load_recipe
    from tests.conftest import write_recipe

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    (tmp_path / "recipes").mkdir()
    recipe = load_recipe(str(write_recipe(tmp_path / "recipes" / "mine.yaml", base="smollm2-awq-g64",
                                          model="models/does-not-exist")))
    with pytest.raises(ModelSourceError) as e:
        source.resolve(recipe.model)
    msg = str(e.value)
    assert msg.startswith("model 'models/does-not-exist' was found neither as a directory nor on the hub: ")
    assert f"no directory {tmp_path / 'recipes' / 'models' / 'does-not-exist'} (a relative `model` is looked for " \
           f"beside the recipe)" in msg
    assert "hub id 'models/does-not-exist' is not in the local hub cache" in msg
    assert "Fix the path if the model is local, or fetch the hub model once" in msg
    assert "local_files_only" not in msg and "snapshot" not in msg


def test_config_without_weights_says_no_weight_files_were_found(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    src = source.resolve(str(tmp_path / "m"))
    with pytest.raises(ModelSourceError, match=r"no weight files were found in .*m \(no \*\.safetensors") as e:
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
    with pytest.raises(ModelSourceError, match="the tokenizer in .* cannot be loaded"):
        source.load_tokenizer(src)


def test_a_load_onto_a_gpu_copies_as_stored_then_converts_there(monkeypatch):
    """Inside `converted_on_the_device`, transformers' per-tensor copy sends a bf16 tensor to a CUDA device first
    and converts it there (torch would otherwise convert it on the host); CPU loads and tensors already in their
    dtype take transformers' own path, and the function is transformers' own again afterwards."""
    import torch
    from transformers import core_model_loading as loading

    plain = loading._materialize_copy
    steps = []
    real_to = torch.Tensor.to

    def to(self, *a, **k):  # no GPU here: record each copy's target and convert on the CPU
        steps.append((str(k.get("device")) if "device" in k else None, a[0] if a else k.get("dtype")))
        return real_to(self, dtype=k.get("dtype", a[0] if a else None) or self.dtype)

    t = torch.arange(6, dtype=torch.bfloat16) / 3
    with source.converted_on_the_device():
        assert loading._materialize_copy is not plain
        monkeypatch.setattr(torch.Tensor, "to", to)
        out = loading._materialize_copy(t, "cuda:0", torch.float16)
        assert steps == [("cuda:0", None), (None, torch.float16)]
        steps.clear()
        loading._materialize_copy(t, "cpu", torch.float16)  # a CPU load: one copy that converts, as before
        loading._materialize_copy(t, "cuda:0", torch.bfloat16)  # already in its dtype
        assert [s[0] for s in steps] == ["cpu", "cuda:0"]
        monkeypatch.undo()
    assert loading._materialize_copy is plain
    assert out.dtype == torch.float16 and torch.equal(out, t.to(torch.float16))

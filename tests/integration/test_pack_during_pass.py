"""The weights written while the pass goes on (`export.stream.WeightStream`, as runs on CUDA do) are the bytes
written at export (as on a CPU): each layer is handed to the writer as soon as its job keeps it."""

import json

import pytest
from safetensors import safe_open

from quantize import runner
from quantize.methods.job import Job
from quantize.recipe import load_recipe
from tests.conftest import tiny_recipe


def _files(artifact):
    m = json.loads((artifact / "manifest.json").read_text())
    return {f: r["sha256"] for f, r in m["files"].items() if "safetensors" in f}


def _run(recipes, out, monkeypatch, during: bool, queued: list | None = None):
    monkeypatch.setattr(runner, "WRITE_DURING_PASS", {"cpu"} if during else set())
    if queued is not None:
        real = Job.keep

        def keep(self, index, layer):
            real(self, index, layer)
            queued.append((self.recipe.name, index, len(self.weights.futures)))
        monkeypatch.setattr(Job, "keep", keep)
    return runner.run_many([load_recipe(r) for r in recipes], out)


@pytest.mark.parametrize("shard", [None, "300KB"], ids=["one-file", "shards"])
def test_weights_written_during_the_pass_are_the_bytes_written_at_export(tiny_qwen2, tmp_path, monkeypatch, shard):
    """AWQ (Qwen2's q/k/v biases rescaled), GPTQ in compressed-tensors and RTN in one shared pass, each layer
    written as it ends against all at export: every weight file and the index are the same."""
    extra = {"max_shard_size": shard} if shard else {}
    recipes = [tiny_recipe(tmp_path, tiny_qwen2, name="p-awq", **extra),
               tiny_recipe(tmp_path, tiny_qwen2, name="p-gptq", method="gptq", format="compressed-tensors", **extra),
               tiny_recipe(tmp_path, tiny_qwen2, name="p-rtn", method="rtn", **extra)]
    at_export = _run(recipes, tmp_path / "at-export", monkeypatch, during=False)
    queued = []
    during = _run(recipes, tmp_path / "during", monkeypatch, during=True, queued=queued)
    for a, b in zip(at_export, during):
        assert _files(a) == _files(b) and _files(a), a.name
        if shard:
            assert len(_files(a)) > 2  # several shards and the index
    # the tensors outside the layers at the start, then each layer when kept: 1 + (index + 1) groups queued
    assert queued == [(r.stem, i, i + 2) for i in range(2) for r in recipes]


def test_shards_follow_the_pass_order(tiny_qwen2, tmp_path, monkeypatch):
    """The embeddings, final norm and lm_head come first, then the layers in order: a layer's tensors are never in
    a shard before an earlier layer's, and every tensor of the checkpoint is in the index once."""
    recipe = tiny_recipe(tmp_path, tiny_qwen2, name="order", max_shard_size="200KB")
    out = _run([recipe], tmp_path / "a", monkeypatch, during=True)[0]
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    shard_no = {n: int(f.split("-")[1]) for n, f in index.items()}

    def group(name):
        parts = name.split(".")
        return int(parts[2]) if name.startswith("model.layers.") else -1
    by_group = {}
    for n, s in shard_no.items():
        by_group.setdefault(group(n), []).append(s)
    groups = sorted(by_group)
    assert groups == [-1, 0, 1]
    for g, h in zip(groups, groups[1:]):
        assert max(by_group[g]) <= min(by_group[h]), (g, h)
    seen = set()
    for fname in sorted(set(index.values())):
        with safe_open(str(out / fname), "pt") as f:
            keys = set(f.keys())
        assert not keys & seen and all(index[k] == fname for k in keys)
        seen |= keys
    assert seen == set(index)

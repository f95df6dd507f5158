"""bench/awq_variants.py: variants that differ only after AWQ's scale search share one pass, and the search runs
once per layer and scale group for all of them."""

from __future__ import annotations

import sys

from bench import awq_variants
from quantize.methods import awq_search as awq
from tests.conftest import tiny_recipe


def test_two_variants_one_search_per_layer_and_group(tiny_qwen2, tmp_path, monkeypatch):
    searches = []
    real = awq.search_scales
    monkeypatch.setattr(awq, "search_scales", lambda *a, **k: searches.append(1) or real(*a, **k))
    recipe = tiny_recipe(tmp_path, tiny_qwen2, name="v")
    monkeypatch.setattr(sys, "argv", ["awq_variants.py", str(recipe), "a:", "b:awq.clip_search=per_side",
                                      "--out", str(tmp_path / "art")])
    awq_variants.main()
    assert sorted(p.name for p in (tmp_path / "art").iterdir() if p.is_dir()) == ["v-a", "v-b"]
    one = len(searches)
    searches.clear()
    monkeypatch.setattr(sys, "argv", ["awq_variants.py", str(recipe), "a:", "--out", str(tmp_path / "one")])
    awq_variants.main()
    assert one == len(searches) > 0  # two variants searched as often as one

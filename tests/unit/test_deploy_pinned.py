"""The kernel the installed vLLM picks for the shipped 7B and MoE recipes, pinned cell by cell.

A vLLM upgrade that changes a kernel choice (or a refusal) fails here, naming the recipe and the cell. After
checking the new answers (docs/DEPLOY.md), re-pin them with:

    PYTHONPATH=. python -m tests.unit.test_deploy_pinned --write
"""

from __future__ import annotations

import json
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PINNED = ROOT / "tests" / "golden" / "deploy-answers.json"
# the shipped recipes' models as bench/configs holds their shapes (the hub is not reachable in tests)
CONFIGS = {"Qwen/Qwen2.5-7B-Instruct": "qwen2.5-7b", "Qwen/Qwen3-30B-A3B": "qwen3-30b-a3b"}
RECIPES = ("qwen7b-awq-g32", "qwen7b-awq-g64", "qwen7b-awq-g128", "qwen7b-gptq-g32", "qwen7b-gptq-g64",
           "qwen7b-gptq-g128", "qwen3-30b-a3b-awq-g128", "qwen3-30b-a3b-gptq-g128")


def answers() -> dict:
    """{recipe: {"vllm": version, "cells": {"<capability>/tp<n>/<dtype>": "<verdict>: module=kernel, ..."}}}"""
    from quantize.preflight import deploy
    from quantize.source.arch import arch_for
    from quantize.formats import is_skipped
    from quantize.recipe import load_recipe
    from quantize.source import ModelSource
    from quantize.source.load import read_config

    out = {}
    for name in RECIPES:
        recipe = load_recipe(name)
        config = read_config(ModelSource("x", ROOT / "bench" / "configs" / CONFIGS[recipe.model], "dir"))
        table, _ = deploy.recipe_table(recipe, config, arch_for(config), is_skipped, use_vllm=True)
        assert table.vllm_version, table.source  # pinned answers are vLLM's, never the hand rules'
        out[name] = {"vllm": table.vllm_version, "cells": {
            f"{c.capability}/tp{c.tp}/{c.dtype}": f"{c.verdict}: " + ", ".join(f"{m}={k}" for m, k in c.kernels.items())
            + (f" ({c.reason})" if c.verdict == "refused" else "") for c in table.cells}}
    return out


@pytest.mark.skipif(find_spec("vllm") is None, reason="vLLM is not installed")
def test_kernel_choices_are_pinned():
    pinned = json.loads(PINNED.read_text())
    got = answers()
    changed = [f"{name} {cell}: pinned {old!r} (vLLM {pinned[name]['vllm']}), now {got[name]['cells'].get(cell)!r} "
               f"(vLLM {got[name]['vllm']})"
               for name in RECIPES for cell, old in pinned[name]["cells"].items()
               if got[name]["cells"].get(cell) != old]
    assert sum(len(v["cells"]) for v in got.values()) == len(RECIPES) * 7 * 4 * 2
    assert not changed, f"{len(changed)} kernel choices changed:\n" + "\n".join(changed[:20])


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    PINNED.write_text(json.dumps(answers(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {PINNED}")

"""The benchmark's tests: a tiny Qwen2 (the 7B benchmark's architecture) and one timed run of it by
bench/bench_ours.py, shared by the tests that read its record."""

from __future__ import annotations

import pytest

from tests.conftest import build_tiny_model, tiny_recipe


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("bench-tiny-qwen2"), "qwen2")


@pytest.fixture(scope="session")
def ours_record(tiny_qwen2, tmp_path_factory) -> dict:
    """bench_ours' record of a GPTQ run (true-sequential: four stages per layer) on the tiny Qwen2."""
    from bench import bench_ours

    tmp = tmp_path_factory.mktemp("bench-ours")
    recipe = tiny_recipe(tmp, tiny_qwen2, name="bench-tiny-gptq", method="gptq", zero_point=False, format="gptq")
    return bench_ours.main([str(recipe), "--out-root", str(tmp / "a"), "--json", str(tmp / "r.json")])

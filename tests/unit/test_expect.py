"""A CPU run on a processor without AVX-512 says at its start, once, what to expect: the processor, the default
recipe's measured time on such a box with its record, and that the vLLM smoke will be skipped and why. This box
has AVX-512, so the processor's flags and vLLM's 4-bit probe are stood in for."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from pipeline import cli, expect
from tests.conftest import tiny_recipe

ROOT = Path(__file__).resolve().parents[2]
AVX2 = {"model": "AMD EPYC 7B13", "avx512": False, "amx": False}
AVX512 = {"model": "Intel Xeon Platinum 8480+", "avx512": True, "amx": True}


def test_the_line_names_the_processor_the_measured_run_and_the_skipped_smoke():
    from eval.serve import INT4_MISSING

    line = expect.cpu_line(AVX2, 2, INT4_MISSING)
    assert line == (
        "this CPU (AMD EPYC 7B13, 2 cores, no AVX-512: vLLM's CPU build runs its AVX2 library): the default recipe "
        "smollm2-awq-g64 measured 342 s for the quantize stage and 10 min 19 s for the whole `make quantize` with "
        "its eval on a 2-core AVX2-only box (bench/results/cpu-make-quantize-avx2-2026-12-04.json); the vLLM smoke "
        f"test will be skipped: {INT4_MISSING}")
    assert "smoke" not in expect.cpu_line(AVX2, 2, None)  # no eval, or a vLLM that can serve 4-bit here
    assert expect.cpu_line(AVX512, 2, INT4_MISSING) is None and expect.cpu_line(None, 2, None) is None


def test_the_figures_are_the_records():
    m = expect.AVX2_DEFAULT
    rec = json.loads((ROOT / m.record).read_text())
    assert rec["stages_s"]["quantize"] == m.quantize_s and rec["wall_s"] == m.whole_s
    assert m.recipe in rec["command"] and "AVX2 only" in rec["machine"] and "2 cores" in rec["machine"]
    assert (ROOT / "recipes" / f"{m.recipe}.yaml").is_file()


@pytest.fixture
def stood_in(monkeypatch, tmp_path):
    """`pipeline run` with its stages stood in for: the quantize stage returns a directory, the eval passes."""
    from eval import smoke
    from quantize import runner
    from quantize.export import cpu_serve

    probes = []
    monkeypatch.setattr(runner, "run", lambda *a, **k: tmp_path / "art")
    monkeypatch.setattr(cli, "run_eval", lambda *a, **k: 0)
    monkeypatch.setattr(smoke, "int4_kernel_missing", lambda: probes.append(1) or smoke.INT4_MISSING)

    def on(cpu):
        monkeypatch.setattr(cpu_serve, "facts", lambda: cpu)
        return probes
    return on


@pytest.mark.parametrize("evaluates", [True, False])
def test_a_cpu_run_without_avx512_says_it_once_at_its_start(stood_in, tiny_llama, tmp_path, caplog, evaluates):
    probes = stood_in(AVX2)
    recipe = tiny_recipe(tmp_path, tiny_llama, name="slow-cpu")
    caplog.set_level(logging.INFO, logger="pipeline.expect")
    assert cli.main(["run", str(recipe), "--out", str(tmp_path / "out")] + ([] if evaluates else ["--no-eval"])) == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "pipeline.expect"]
    assert len(lines) == 1 and lines[0].startswith("this CPU (AMD EPYC 7B13, ") and "342 s" in lines[0]
    assert ("the vLLM smoke test will be skipped: vLLM's CPU build on this processor (no AVX-512" in lines[0]) \
        == evaluates
    assert len(probes) == evaluates  # the seconds-long probe runs only where the smoke would


def test_a_processor_with_avx512_is_told_nothing_and_probes_nothing(stood_in, tiny_llama, tmp_path, caplog):
    probes = stood_in(AVX512)
    caplog.set_level(logging.INFO, logger="pipeline.expect")
    assert cli.main(["run", str(tiny_recipe(tmp_path, tiny_llama, name="fast-cpu")), "--out", str(tmp_path)]) == 0
    assert not [r for r in caplog.records if r.name == "pipeline.expect"] and not probes

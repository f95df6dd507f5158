"""bench/gptq_layer_anatomy.py on small shapes (CPU): every part timed, and the output error's numerator read off
the sweep's loss agreeing with the float64 products."""

from __future__ import annotations

import json

import pytest

from bench import gptq_layer_anatomy


def test_every_part_is_timed_and_the_sweeps_numerator_is_the_products(tmp_path):
    out = tmp_path / "anatomy.json"
    assert gptq_layer_anatomy.main(["--tiny", "--device", "cpu", "--reps", "1", "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert set(rec["problems"]) == {"qkv", "o", "gate_up", "down"} and set(rec["grams"]) == {"64", "128"}
    for p in rec["problems"].values():
        assert all(p[k] > 0 for k in ("factorisation_s", "sweep_total_s", "output_error_s", "denominator_only_s"))
        assert p["numerator_rel_diff_vs_float64"] < 1e-5


def test_a_bad_device_is_a_one_line_error(capsys):
    assert gptq_layer_anatomy.main(["--device", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1


@pytest.mark.parametrize("args", [["--tokens", "0"], ["--reps", "0"], ["--json", "/no/such/folder/a.json"]])
def test_bad_arguments_are_one_line_errors_before_any_work(args, capsys):
    assert gptq_layer_anatomy.main(["--tiny", "--device", "cpu", *args]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1 and captured.out == ""

"""`method: auto` in a recipe: its candidates, and the ones refused before any model loads."""

import pytest

from pipeline.cli import main
from quantize.recipe import RecipeError, load_recipe
from tests.conftest import write_recipe

BASE = dict(model="/nowhere/model", method="auto", w_bit=4, q_group_size=64, zero_point=True)


def test_default_candidates_are_the_shipped_methods_the_format_can_write(tmp_path):
    """format auto with zero points: GPTQ's own format is symmetric only, so it is left out, saying why;
    compressed-tensors writes all three. SignRound is tried only where listed."""
    r = load_recipe(write_recipe(tmp_path / "a.yaml", **BASE))
    kept, left_out = r.auto_candidates()
    assert [c.method for c in kept] == ["awq", "rtn"] and list(left_out) == ["gptq"]
    assert "zero_point" in left_out["gptq"]
    r = load_recipe(write_recipe(tmp_path / "b.yaml", **BASE, format="compressed-tensors"))
    assert [c.method for c in r.auto_candidates()[0]] == ["awq", "gptq", "rtn"]


def test_a_candidate_is_the_recipe_naming_that_method(tmp_path):
    r = load_recipe(write_recipe(tmp_path / "a.yaml", **BASE, auto={"candidates": ["rtn", "awq"]}))
    direct = load_recipe(write_recipe(tmp_path / "a.yaml", **{**BASE, "method": "awq"}))
    kept, _ = r.auto_candidates()
    assert [c.method for c in kept] == ["rtn", "awq"]  # the recipe's order: a tie goes to the first listed
    assert kept[1].to_dict() == direct.to_dict() and kept[1].out_format == "awq"
    assert "auto" not in direct.to_dict() and r.to_dict()["auto"]["candidates"] == ["rtn", "awq"]


@pytest.mark.parametrize("keys, says", [
    (dict(auto={"candidates": ["awq", "gptqq"]}), "auto.candidates: method 'gptqq' is unknown; did you mean `gptq`?"),
    (dict(auto={"candidates": ["awq", "auto"]}), "auto.candidates: method 'auto' is unknown"),
    (dict(auto={"candidates": ["awq", "gptq"]}), "auto.candidates: gptq cannot be written with this recipe: "
                                                 "zero_point true (asymmetric) is not allowed with format gptq"),
    (dict(q_group_size=-1, auto={"candidates": ["awq", "rtn"]}), "auto.candidates: awq cannot be written"),
    (dict(auto={"candidates": []}), "auto.candidates is empty"),
    (dict(auto={"candidates": ["awq", "awq"]}), "lists a method twice"),
    (dict(method="awq", auto={"candidates": ["awq"]}), "auto: is read with method: auto only"),
    (dict(format="gptq", zero_point=True, q_group_size=64), "no default candidate can be written"),
])
def test_bad_candidates_are_refused_with_what_to_change(tmp_path, keys, says):
    with pytest.raises(RecipeError) as e:
        load_recipe(write_recipe(tmp_path / "r.yaml", **{**BASE, **keys}))
    assert says in str(e.value)


def test_a_bad_candidate_stops_the_run_before_any_model_loads(tmp_path, capsys):
    """The model does not exist: the recipe's error, exit 2, is all the run says."""
    p = write_recipe(tmp_path / "r.yaml", **BASE, auto={"candidates": ["awq", "gptq"]})
    assert main(["run", str(p), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "remove gptq from auto.candidates" in err and "/nowhere" not in err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_compare_and_a_plain_pass_refuse_an_auto_recipe_before_any_model_loads(tmp_path):
    """Only `run` chooses; compare is told to list one recipe per method, and a pass of the recipe itself is
    refused (the model does not exist: neither gets as far as looking for it)."""
    from pipeline.compare import run_comparison
    from quantize import runner
    from quantize.preflight.checks import PreflightError

    p = write_recipe(tmp_path / "r.yaml", **BASE)
    with pytest.raises(RecipeError, match="give compare one recipe per method"):
        run_comparison([str(p)], tmp_path / "out")
    with pytest.raises(PreflightError, match="method auto is run by `python -m pipeline run`"):
        runner.run_many([load_recipe(p)], tmp_path / "out")

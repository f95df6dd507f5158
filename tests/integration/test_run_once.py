"""A `pipeline run` (and a `preflight`) reads its recipe file once and resolves its model once: the command line
parses the recipe and hands the object on, pre-flight resolves the model and hands it to the eval. A second read
could disagree with the first (a recipe edited mid-run), and a second resolve costs time (a GGUF model is hashed
at every resolve)."""

import pytest

from eval import refcache
from pipeline.cli import main
from quantize.recipe import load as recipe_load
from quantize.source import load as source
from tests.conftest import tiny_recipe


@pytest.fixture
def counted(monkeypatch, tmp_path):
    """-> {"parsed": the stem of each recipe file read, "resolved": each model spec resolved}, from now on."""
    seen: dict[str, list[str]] = {"parsed": [], "resolved": []}
    read, resolve = recipe_load._read_raw, source.resolve

    def counting_read(path, chain):
        if not chain:  # a `base:` recipe read on the way belongs to the same parse
            seen["parsed"].append(path.stem)
        return read(path, chain)

    monkeypatch.setattr(recipe_load, "_read_raw", counting_read)
    monkeypatch.setattr(source, "resolve", lambda spec: seen["resolved"].append(spec) or resolve(spec))
    monkeypatch.setattr(refcache, "cache_dir", lambda: tmp_path / "cache")
    return seen


def _recipe(tmp_path, model):
    return tiny_recipe(tmp_path, model, name="once", method="rtn", eval=dict(
        perplexity=dict(dataset="wikitext2", seq_len=64, max_windows=1), vllm=dict(enabled=False),
        max_ppl_delta_pct=None))


@pytest.mark.parametrize("evaluates", [False, True])
def test_a_run_parses_its_recipe_once_and_resolves_its_model_once(tiny_llama, tmp_path, counted, evaluates):
    argv = ["run", str(_recipe(tmp_path, tiny_llama)), "--out", str(tmp_path / "a")]
    assert main(argv + ([] if evaluates else ["--no-eval"])) == 0
    assert (tmp_path / "a" / "once" / "report.json").is_file() == evaluates
    assert counted["parsed"] == ["once"]
    assert counted["resolved"] == [str(tiny_llama)]


def test_preflight_parses_its_recipe_once(tiny_llama, tmp_path, counted):
    assert main(["preflight", str(_recipe(tmp_path, tiny_llama)), "--out", str(tmp_path / "a")]) == 0
    assert counted["parsed"] == ["once"]
    assert counted["resolved"] == [str(tiny_llama)]


def test_out_of_memory_names_the_values_of_the_one_parse(tiny_llama, tmp_path, counted, monkeypatch, capsys):
    from quantize import runner

    def oom(*a, **k):
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(runner, "run", oom)
    assert main(["run", str(_recipe(tmp_path, tiny_llama)), "--out", str(tmp_path / "a")]) == 2
    assert "(now: batch_size 4, calibration.n_samples 16" in capsys.readouterr().err
    assert counted["parsed"] == ["once"]

"""A method registered from this file alone goes through run, compare, eval and register: no project file names it.

`toyclip` is a small calibrated method: per converted linear it picks, from its recipe section's `shrinks`, the
clip of the weight range whose round-to-nearest codes give the least output error on the linear's captured
calibration inputs. It asks the capture loop for the FP model's inputs and every linear's input features, so it
exercises what AWQ and GPTQ use from the registry (options, calibration, propagation, features, stats, format).
"""

from __future__ import annotations

import json

import pytest
import torch

from pipeline.cli import main as cli_main
from pipeline.compare import run_comparison
from quantize import methods, runner
from quantize.methods.options import Strict
from quantize.recipe import RecipeError, load_recipe
from tests.conftest import eval_main, tiny_recipe


class ToyClipOptions(Strict):
    shrinks: tuple[float, ...] = (1.0, 0.9, 0.8)


class ToyClip(methods.Method):
    name = "toyclip"
    title = "toy clip search"
    options = ToyClipOptions
    default_format = "compressed-tensors"
    colour = "tab:green"

    def wants_features(self, recipe) -> bool:
        return True

    def layer(self, data, job) -> dict:
        from quantize.methods.layer import feature_of, local_linears, store
        from quantize.methods.primitives import dequantize, quantize_for_export

        r, shrinks, chosen = job.recipe, self.section(job.recipe).shrinks, {}
        for n in local_linears(job.arch, data.index, job.convert):
            w = data.layer.get_submodule(n).weight.data  # [out, in]
            x = data.features[feature_of(job.arch)[n]]  # [tokens, in]
            best = None
            for s in shrinks:
                bound = w.abs().amax(dim=1, keepdim=True) * s  # [out, 1]
                q = quantize_for_export(torch.maximum(torch.minimum(w, bound), -bound), r.w_bit, r.q_group_size,
                                        symmetric=r.symmetric, scale_dtype=job.scale_dtype)
                err = float(((x @ (w - dequantize(*q).to(w.dtype)).T) ** 2).sum())
                if best is None or err < best[0]:
                    best = (err, s, q)
            chosen[n] = best[1]
            store(data.layer, n, job.prefix(data.index), *best[2], job.results)
        return {"shrink": chosen}


@pytest.fixture
def toyclip():
    methods.register(ToyClip())
    yield methods.get("toyclip")
    methods.REGISTRY.pop("toyclip")


def _toy(tmp_path, model, name, vllm: bool = True, **over):
    keys = dict(method="toyclip", toyclip={"shrinks": [1.0, 0.9]},
                eval=dict(perplexity=dict(dataset="wikitext2", seq_len=128, max_windows=3),
                          vllm=dict(enabled=vllm, max_tokens=8, min_token_agreement=0.3)))
    return tiny_recipe(tmp_path, model, name=name, **{**keys, **over})


def test_an_unregistered_method_and_a_bad_option_are_refused_naming_what_exists(tiny_llama, tmp_path, toyclip):
    with pytest.raises(RecipeError, match=r"method 'nosuch' is unknown; use one of \['awq', 'gptq', 'rtn', 'signround', "
                                          r"'toyclip'\]"):
        load_recipe(tiny_recipe(tmp_path, tiny_llama, name="bad-method", method="nosuch"))
    with pytest.raises(RecipeError, match=r"`toyclip`: shrinks.0: Input should be a valid number"):
        load_recipe(_toy(tmp_path, tiny_llama, "bad-option", toyclip={"shrinks": ["x"]}))
    r = load_recipe(_toy(tmp_path, tiny_llama, "ok"))
    assert r.method_options("toyclip").shrinks == (1.0, 0.9) and r.out_format == "compressed-tensors"
    d = r.to_dict()
    assert list(d)[list(d).index("gptq") + 1] == "toyclip" and "sections" not in d  # its place in recipe.yaml


def test_a_registered_method_runs_compares_and_evaluates(tiny_llama, tmp_path, toyclip, capsys):
    out = runner.run(_toy(tmp_path, tiny_llama, "toy-g64"), out_root=tmp_path / "a")
    m = json.loads((out / "manifest.json").read_text())
    stats = m["toyclip_stats"]
    assert m["recipe"]["toyclip"] == {"shrinks": [1.0, 0.9]} and m["format"]["name"] == "compressed-tensors"
    assert set(stats) == {"0", "1"} and all(s in (1.0, 0.9) for layer in stats.values()
                                            for s in layer["shrink"].values())
    assert "toyclip" in (out / "README.md").read_text()

    assert eval_main([str(tmp_path / "toy-g64.yaml"), "--artifact", str(out), "--no-vllm"]) == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["passed"] and rep["perplexity"]["quantized"]["ppl"] > 0

    sweep = _toy(tmp_path, tiny_llama, "toy-sweep", vllm=False, sweep={"q_group_size": [32, 64]})
    doc, code = run_comparison([str(sweep)], tmp_path / "c")
    assert code == 0 and [r["method"] for r in doc["rows"]] == ["toyclip", "toyclip"]
    assert [r["group_size"] for r in doc["rows"]] == [32, 64] and all(r["ppl"] > 0 for r in doc["rows"])
    # a variant of the shared pass is the same artifact as a run of it alone
    alone = runner.run(_toy(tmp_path, tiny_llama, "toy-sweep-g64", vllm=False), out_root=tmp_path / "b")
    shared = tmp_path / "c" / "toy-sweep-g64"
    assert (alone / "model.safetensors").read_bytes() == (shared / "model.safetensors").read_bytes()


@pytest.mark.vllm  # registration takes only artifacts that vLLM loaded (skipped, saying why, where it cannot)
def test_a_registered_method_is_registered(tiny_llama, tmp_path, toyclip, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'reg.db'}")
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", f"sqlite:///{tmp_path / 'reg.db'}")
    out = runner.run(_toy(tmp_path, tiny_llama, "toy-reg"), out_root=tmp_path / "a")
    assert eval_main([str(tmp_path / "toy-reg.yaml"), "--artifact", str(out)]) == 0
    assert cli_main(["register", "--artifact", str(out)]) == 0
    from pipeline import registry

    (v,) = registry.versions("toy-reg")
    assert v["tags"]["method"] == "toyclip" and v["metrics"]["vllm_smoke_passed"] == 1.0

"""`compare RECIPES --artifact DIR`: another tool's directory (no manifest of ours) is scored against the
comparison's base model on its protocol, with the reference scored once for both, and is one row marked external
in compare-<name>.{json,md,png}; a directory made from another model is one `error:` line before any work."""

from __future__ import annotations

import json

import pytest

from eval import refcache
from pipeline import external, registry
from pipeline.cli import main
from tests.conftest import build_tiny_model, tiny_recipe
from tests.integration.test_foreign_artifacts import AUTOAWQ, GPTQMODEL, LLM_COMPRESSOR, write_peer_dir

EVAL = dict(perplexity=dict(seq_len=128, max_windows=3), vllm=dict(enabled=False))


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(refcache, "cache_dir", lambda: tmp_path / "refcache")


def test_a_peer_directory_is_a_row_beside_our_variant(tiny_llama, tmp_path, private_cache, monkeypatch, capsys):
    from eval import report

    forwards = []
    real = report.perplexity
    monkeypatch.setattr(report, "perplexity", lambda m, w, b=1, label="model", **k: forwards.append(label)
                        or real(m, w, b, label, **k))
    peer = tmp_path / "peers" / "gptqmodel-w4g64"
    write_peer_dir(tiny_llama, peer, "gptqmodel")
    recipe = tiny_recipe(tmp_path, tiny_llama, name="ours-rtn-g64", method="rtn", eval=EVAL)
    out = tmp_path / "art"
    assert main(["compare", str(recipe), "--artifact", str(peer), "--out", str(out), "--name", "mixed"]) == 0
    assert forwards == ["reference", "quantized", "quantized"]  # one reference for ours and theirs
    doc = json.loads((out / "compare-mixed.json").read_text())
    ours, theirs = doc["rows"]
    assert ours["variant"] == "ours-rtn-g64" and ours["external"] is False
    assert theirs["variant"] == "gptqmodel-w4g64" and theirs["external"] is True and theirs["artifact"] == str(peer)
    assert (theirs["tool"], theirs["format"], theirs["w_bit"], theirs["group_size"], theirs["zero_point"]) == \
        ("GPTQModel 2.2.0", "gptq", 4, 64, False)
    assert theirs["base_model"] == ours["base_model"] == str(tiny_llama) and theirs["protocol"] == ours["protocol"]
    assert theirs["ppl_fp16"] == ours["ppl_fp16"] and theirs["ppl"] > 1 and theirs["ppl"] != ours["ppl"]
    assert 0 <= theirs["kl_mean"] < 0.5 and 0 < theirs["top1"] <= 1 and theirs["eval_passed"] is True
    assert 4 < theirs["bits_per_weight"] < 5 and theirs["weight_file_bytes"] > 0 and theirs["quantize_s"] is None
    scored = json.loads((peer / "report.json").read_text())  # the eval stage's own report, as `eval --artifact`
    assert scored["perplexity"]["quantized"]["ppl"] == theirs["ppl"] and scored["manifest_verified"] is False
    md = (out / "compare-mixed.md").read_text()
    assert "| gptqmodel-w4g64 | external: GPTQModel 2.2.0 | 4 | 64 | gptq |" in md
    assert "- gptqmodel-w4g64: GPTQModel 2.2.0, GPTQ" in md and str(peer) in md
    assert (out / "compare-mixed.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert registry.comparison_artifacts(out, "mixed") == [out / "ours-rtn-g64"]  # theirs is not ours to register
    assert capsys.readouterr().out.strip() == str(out / "compare-mixed.md")
    # without an eval, the figures its report holds from this base model and protocol are shown again
    assert main(["compare", str(recipe), "--artifact", str(peer), "--out", str(out), "--name", "mixed", "--force",
                 "--no-eval"]) == 0
    again = json.loads((out / "compare-mixed.json").read_text())["rows"][1]
    assert again["ppl"] == theirs["ppl"] and again["kl_mean"] == theirs["kl_mean"]


@pytest.mark.parametrize("differs, says", [
    (dict(hidden=128, intermediate=256),
     "hidden_size 128 (base model 256), intermediate_size 256 (base model 512), head_dim 32 (base model 64)"),
    (dict(vocab=384), "vocab_size 384 (base model 512)"),
])
def test_a_directory_of_another_model_is_refused_before_any_work(differs, says, tiny_llama, tmp_path,
                                                                  private_cache, capsys):
    other = build_tiny_model(tmp_path / "other-model", **differs)
    peer = tmp_path / "peer"
    write_peer_dir(other, peer, "autoawq")
    recipe = tiny_recipe(tmp_path, tiny_llama, name="ours", method="rtn", eval=EVAL)
    out = tmp_path / "art"
    assert main(["compare", str(recipe), "--artifact", str(peer), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert line == (f"error: --artifact {peer} was not quantized from the comparison's base model {tiny_llama}: "
                    f"its config.json has {says}; compare it with recipes of the model it was made from")
    assert "Traceback" not in err and not (out / "ours").exists() and not (tmp_path / "refcache").exists()


def test_recipes_of_two_base_models_take_no_peer_directory(tiny_llama, tiny_qwen2, tmp_path, capsys):
    peer = tmp_path / "peer"
    write_peer_dir(tiny_llama, peer, "autoawq")
    recipes = [tiny_recipe(tmp_path, m, name=n, method="rtn") for m, n in ((tiny_llama, "a"), (tiny_qwen2, "b"))]
    assert main(["compare", *map(str, recipes), "--artifact", str(peer), "--out", str(tmp_path / "art")]) == 2
    assert "error: --artifact: the recipes name 2 base models" in capsys.readouterr().err
    assert not (tmp_path / "art" / "a").exists()


def test_the_tool_comes_from_the_keys_only_it_writes():
    assert external.tool(AUTOAWQ) == "AutoAWQ"
    assert external.tool(GPTQMODEL) == "GPTQModel 2.2.0"
    assert external.tool(LLM_COMPRESSOR) == "llm-compressor (compressed-tensors 0.10.2)"
    assert external.tool({"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True,
                          "autoround_version": "0.5.1"}) == "AutoRound 0.5.1"
    assert external.tool({"quant_method": "gptq", "bits": 4, "group_size": 128}) is None  # no key says who

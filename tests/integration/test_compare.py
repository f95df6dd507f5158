"""One shared pass for several recipes: same bytes as separate runs; comparison files, plot and model cards."""

import json

import pytest
import yaml

from quantize.manifest import verify as verify_manifest
from pipeline.compare import default_name, run_comparison, sizes
from quantize import runner
from quantize.export.modelcard import protocol_sentence
from quantize.recipe import load_recipe
from quantize.runlog import RunLog
from tests.conftest import tiny_recipe


def test_shared_pass_writes_the_same_bytes_as_separate_runs(tiny_qwen2, tmp_path):
    """AWQ g32/g64 (FP-propagated), GPTQ (private quantized chain) and RTN in one pass == four runs alone.
    Qwen2 has q/k/v biases, which AWQ rescales: the per-variant layer copies must carry them to the export.
    The shared run also fills a RunLog: per layer, its parts and every recipe's method stages."""
    recipes = [tiny_recipe(tmp_path, tiny_qwen2, name="v-awq-g32", q_group_size=32),
               tiny_recipe(tmp_path, tiny_qwen2, name="v-awq-g64"),
               tiny_recipe(tmp_path, tiny_qwen2, name="v-gptq-g64", method="gptq", zero_point=False),
               tiny_recipe(tmp_path, tiny_qwen2, name="v-rtn-g64", method="rtn")]
    runlog = RunLog()
    shared = runner.run_many([load_recipe(r) for r in recipes], tmp_path / "shared", runlog=runlog)
    alone = [runner.run(r, out_root=tmp_path / "alone") for r in recipes]
    for a, b in zip(shared, alone):
        ma, mb = (json.loads((d / "manifest.json").read_text()) for d in (a, b))
        for f in ("model.safetensors", "config.json"):
            assert ma["files"][f]["sha256"] == mb["files"][f]["sha256"], (a.name, f)
        assert ma["shared_pass"]["variants"] == [r.stem for r in recipes] and mb["shared_pass"] is None
    g32, g64 = (sizes(d, 4) for d in shared[:2])
    assert g32["bits_per_weight"] > g64["bits_per_weight"] > 4  # scales + zeros cost more at smaller groups
    assert list(runlog.stages) == ["preflight", "calibrate", "load", "quantize", "export"]
    # pre-flight's parts (no caller's eval check here), in order, within the stage's own seconds
    assert list(runlog.preflight_parts) == ["config", "checkpoint", "plan", "device"]
    assert sum(runlog.preflight_parts.values()) <= runlog.stages["preflight"] + 1e-3 * 5
    assert [r.index for r in runlog.layers] == [0, 1]
    for r in runlog.layers:
        assert r.seconds > 0 and set(r.parts) == {"to_device", "fp_forward", "jobs"}
        # every figure is rounded to 0.1 ms, so the parts may overshoot the layer's wall time by that rounding
        assert sum(r.parts.values()) <= r.seconds + 0.5e-4 * (len(r.parts) + 1)
        stages = [(s.recipe, s.stage, set(s.seconds)) for s in r.stages]
        assert stages == [("v-awq-g32", "awq", {"scale_search", "clip", "quantize"}),
                          ("v-awq-g64", "awq", {"scale_search", "clip", "quantize"})] + \
            [("v-gptq-g64", g, {"hessian", "sweep"}) for g in  # true-sequential stages
             ("self_attn.q_proj+self_attn.k_proj+self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj+mlp.up_proj",
              "mlp.down_proj")]
    assert runlog.peak_allocated_bytes is None and runlog.device["cuda_allocator"] is None  # CPU


def test_awq_variants_share_what_their_group_size_does_not_change(tiny_qwen2, tmp_path, monkeypatch):
    """Two AWQ group sizes in one pass compute the search's group-size-free parts (the inspected blocks' FP
    outputs, a single linear's Gram matrix) once per layer, not once per variant."""
    from quantize.methods import awq_search as awq

    calls = []
    real = awq.loss_gram
    monkeypatch.setattr(awq, "loss_gram", lambda x: calls.append(x.shape) or real(x))
    recipes = [load_recipe(tiny_recipe(tmp_path, tiny_qwen2, name=f"s-awq-g{g}", q_group_size=g)) for g in (32, 64)]
    runner.run_many(recipes, tmp_path / "shared")
    assert len(calls) == 2  # down_proj's XᵀX in each of the 2 layers (o_proj is not square here: no search)


def test_awq_variants_with_one_search_group_size_run_one_search(tiny_qwen2, tmp_path, monkeypatch):
    """Two group sizes that set one awq.search_group_size: each layer's scale searches run once, for the first
    variant; the second takes their results (its stats say so), and each variant's weights are still those of
    its run alone, which differ from each other (the clip and the codes are each group size's own)."""
    from quantize.methods import awq_search as awq, output_error

    calls, norms = [], []
    real = awq.search_scales
    monkeypatch.setattr(awq, "search_scales", lambda *a, **k: calls.append(a[4]) or real(*a, **k))
    for f in ("norm_from_inputs", "norm_from_hessian"):  # the output error's denominator, a value of W·s and X/s
        monkeypatch.setattr(output_error, f, lambda *a, f=getattr(output_error, f): norms.append(1) or f(*a))
    paths = [tiny_recipe(tmp_path, tiny_qwen2, name=f"o-awq-g{g}", q_group_size=g,
                         awq=dict(n_grid=10, clip_grid=10, search_group_size=64)) for g in (32, 64)]
    shared = runner.run_many([load_recipe(p) for p in paths], tmp_path / "shared")
    per_layer = len(calls) // 2
    assert per_layer >= 3 and len(calls) == 2 * per_layer  # q/k/v, gate/up, down_proj in each of 2 layers
    assert {(s.group, s.w_bit, s.symmetric) for s in calls} == {(64, 4, False)}
    stats = [json.loads((d / "manifest.json").read_text())["awq_stats"] for d in shared]
    for layer in ("0", "1"):
        first, second = stats[0][layer], stats[1][layer]
        groups = [k for k in first if k not in ("seconds", "output_error")]
        assert groups and all("shared" not in first[g] and second[g]["shared"] for g in groups)
        assert all(first[g]["best_ratio"] == second[g]["best_ratio"] for g in groups)
    assert len(norms) == 7 * 2  # once per linear and layer, for both variants
    calls.clear()
    alone = [runner.run(p, out_root=tmp_path / "alone") for p in paths]
    assert len(calls) == 2 * 2 * per_layer and len(norms) == 3 * 7 * 2  # alone, each searches for itself
    manifests = [[json.loads((d / "manifest.json").read_text()) for d in run] for run in (shared, alone)]
    sha = [[m["files"]["model.safetensors"]["sha256"] for m in run] for run in manifests]
    assert sha[0] == sha[1] and sha[0][0] != sha[0][1]
    errors = [[m["output_error"] for m in run] for run in manifests]
    assert errors[0] == errors[1] and errors[0][0] != errors[0][1]


def test_recipes_that_cannot_share_are_refused_together(tiny_qwen2, tiny_llama, tmp_path):
    a = load_recipe(tiny_recipe(tmp_path, tiny_qwen2, name="a"))
    b = load_recipe(tiny_recipe(tmp_path, tiny_llama, name="b"))
    with pytest.raises(runner.PreflightError, match=r"cannot share a pass: they differ in \['model'\]"):
        runner.run_many([a, b], tmp_path / "out")


def test_sweep_comparison_files_plot_and_model_cards(tiny_llama, tmp_path):
    recipe = tiny_recipe(tmp_path, tiny_llama, name="sw", sweep={"q_group_size": [32, 64]},
                         eval=dict(perplexity=dict(seq_len=128, max_windows=3), vllm=dict(enabled=False)))
    doc, code = run_comparison([str(recipe)], tmp_path / "art")
    assert code == 0 and doc["name"] == "sw"
    rows = doc["rows"]
    assert [r["variant"] for r in rows] == ["sw-g32", "sw-g64"] and [r["group_size"] for r in rows] == [32, 64]
    assert rows[0]["ppl_fp16"] == rows[1]["ppl_fp16"]  # one reference, measured once
    for r in rows:
        assert r["ppl"] > 1 and r["bytes_on_disk"] > 0 and r["vllm_smoke"] == "skipped" and r["quantize_s"] > 0
    on_disk = json.loads((tmp_path / "art" / "compare-sw.json").read_text())
    assert on_disk["rows"] == json.loads(json.dumps(rows))
    md = (tmp_path / "art" / "compare-sw.md").read_text()
    assert "| sw-g32 | awq | 4 | 32 |" in md and "compare-sw.png" in md
    png = (tmp_path / "art" / "compare-sw.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    # model card: front matter with settings and, after eval, the measured perplexities; manifest verifies
    art = tmp_path / "art" / "sw-g64"
    card = (art / "README.md").read_text()
    front = yaml.safe_load(card.split("---\n")[1])
    assert front["quantization"]["group_size"] == 64 and "awq" in front["tags"]
    metrics = front["model-index"][0]["results"][0]["metrics"]
    assert metrics[0]["value"] == round(rows[1]["ppl"], 4)
    assert verify_manifest(art)
    # one protocol sentence: the comparison, the model card and the eval report print the same one
    sentence = protocol_sentence(rows[1]["protocol"])
    assert "3 non-overlapping windows of 128 tokens" in sentence and "wikitext" in sentence
    for text in (md, card, (art / "report.md").read_text()):
        assert sentence in text


def test_the_reference_runs_once_for_every_variant_and_not_again(tiny_llama, tmp_path, monkeypatch):
    """Three variants of one comparison score the reference model once (its perplexity and top-k cached under
    the model files, protocol, dtype and device kind); the comparison run again scores only the variants."""
    from eval import refcache, report

    monkeypatch.setattr(refcache, "cache_dir", lambda: tmp_path / "cache")
    forwards = []
    real = report.perplexity
    monkeypatch.setattr(report, "perplexity", lambda m, w, b=1, label="model", **k: forwards.append(label)
                        or real(m, w, b, label, **k))
    recipe = tiny_recipe(tmp_path, tiny_llama, name="ref", method="rtn", sweep={"q_group_size": [32, 64, 128]},
                         eval=dict(perplexity=dict(seq_len=128, max_windows=3), vllm=dict(enabled=False)))
    doc, code = run_comparison([str(recipe)], tmp_path / "art")
    assert code == 0 and forwards == ["reference", "quantized", "quantized", "quantized"]
    assert all(r["kl_mean"] is not None for r in doc["rows"])
    forwards.clear()
    doc, code = run_comparison([str(recipe)], tmp_path / "art", force=True)
    assert code == 0 and forwards == ["quantized"] * 3


def test_default_comparison_name():
    assert default_name(["qwen7b-awq-g32", "qwen7b-awq-g64", "qwen7b-awq-g128"]) == "qwen7b-awq"
    assert default_name(["smollm2-awq-sweep"]) == "smollm2-awq-sweep"
    assert default_name(["a-x", "b-y"]) == "a-x-b-y"


def test_model_card_before_eval(tiny_llama, tmp_path):
    out = runner.run(tiny_recipe(tmp_path, tiny_llama, name="card", method="rtn"), out_root=tmp_path / "a")
    card = (out / "README.md").read_text()
    assert card.startswith("---\n") and "Not evaluated yet" in card and "vllm serve" in card
    assert json.loads((out / "manifest.json").read_text())["files"]["README.md"]["bytes"] == len(card.encode())

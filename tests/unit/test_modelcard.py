"""The model card is one huggingface_hub reads back: base model, license, tags, and the perplexities as a
model-index once evaluated; the body keeps the serve, quantization and evaluation sections."""

from __future__ import annotations

import json

import pytest
from huggingface_hub import ModelCard

from quantize.export import card_plots, modelcard

MANIFEST = {
    "artifact": "smollm2-awq-g64",
    "recipe": {"method": "awq", "w_bit": 4, "q_group_size": 64, "zero_point": True, "dtype": "float16",
               "modules_to_not_convert": ["lm_head"]},
    "model": {"spec": "HuggingFaceTB/SmolLM2-135M-Instruct", "license": "apache-2.0"},
    "format": {"name": "compressed-tensors", "quant_method": "compressed-tensors"},
    "calibration": {"dataset": "groups-merged", "n_samples": 128, "seq_len": 512, "seed": 0},
    "skipped_linears": {"model.layers.0.mlp.down_proj": "in_features not a multiple of the group"},
    "tensor_parallel_sizes": [1, 2],
    "versions": {"quantize": "0.1.0"}, "git": {"commit": "abc123"},
}
REPORT = {
    "date": "2026-12-01", "machine": "x86_64, 2 cores", "passed": True, "reference_dtype": "float32",
    "perplexity": {"protocol": {"dataset": "wikitext-2", "source": "data/wiki.test.raw", "text_sha256": "0" * 64,
                                "windows": 16, "seq_len": 512, "tokens_scored": 8176},
                   "fp16": {"ppl": 21.60541}, "quantized": {"ppl": 22.91234}, "delta": 1.30693, "delta_pct": 6.0491},
    "vllm_smoke": {"skipped": "vllm not importable"},
}
TAGS = {"quantized", "4-bit", "awq", "w4a16", "group-size-64", "compressed-tensors", "vllm"}


def _load(tmp_path, text: str) -> ModelCard:
    path = tmp_path / "README.md"
    path.write_text(text, encoding="utf-8")
    return ModelCard.load(path)


def test_card_before_eval_loads_with_base_model_license_and_tags(tmp_path):
    card = _load(tmp_path, modelcard.render(MANIFEST))
    d = card.data
    assert d.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct" and d.license == "apache-2.0"
    assert d.library_name == "transformers" and d.pipeline_tag == "text-generation"
    assert TAGS <= set(d.tags) and len(d.tags) == len(set(d.tags))
    assert d.eval_results is None and "model-index" not in d.to_dict()
    q = d.quantization
    assert (q["bits"], q["group_size"], q["zero_point"], q["format"]) == (4, 64, True, "compressed-tensors")
    assert q["linears_kept_16bit"] == ["lm_head", "model.layers.0.mlp.down_proj"]
    assert q["calibration"] == {"dataset": "groups-merged", "n_samples": 128, "seq_len": 512, "seed": 0}
    assert card.text.startswith("\n# smollm2-awq-g64\n")
    for heading in ("## Serve", "## Quantization", "## Evaluation", "## Integrity and reproduction"):
        assert f"\n{heading}\n" in card.text
    assert "Not evaluated yet" in card.text


def test_card_after_eval_carries_the_perplexities_as_a_model_index(tmp_path):
    card = _load(tmp_path, modelcard.render(MANIFEST, REPORT))
    got = {(r.metric_type, r.metric_name): r.metric_value for r in card.data.eval_results}
    assert got == {("perplexity", "perplexity (quantized)"): 22.9123,
                   ("perplexity", "perplexity (FP16 base)"): 21.6054,
                   ("perplexity_delta_pct", "perplexity increase (%)"): 6.049}
    r = card.data.eval_results[0]
    assert (r.task_type, r.dataset_type, r.dataset_split) == ("text-generation", "wikitext-2", "test")
    assert card.data.model_name == "smollm2-awq-g64"
    assert "| this artifact | 22.9123 | +1.3069 | +6.05 |" in card.text


def test_a_local_model_has_no_base_model_and_no_license(tmp_path):
    m = {**MANIFEST, "model": {"spec": "/models/tiny"}, "calibration": None}
    d = _load(tmp_path, modelcard.render(m)).data
    assert d.base_model is None and d.license is None and d.quantization["calibration"] is None


def test_source_license_from_a_hub_readme_and_from_a_gguf(tmp_path):
    import gguf

    hub = tmp_path / "snapshot"
    hub.mkdir()
    (hub / "README.md").write_text("---\nlicense: mit\nlibrary_name: transformers\n---\n# a model\n")
    assert modelcard.source_license(hub) == "mit"

    f = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(f), "llama")
    w.add_string("general.license", "apache-2.0")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    cache = tmp_path / "conversion"
    cache.mkdir()
    (cache / "source.json").write_text(json.dumps({"gguf": str(f), "sha256": "x"}))
    assert modelcard.source_license(cache) == "apache-2.0"

    (cache / "source.json").write_text(json.dumps({"gguf": str(tmp_path / "missing.gguf"), "sha256": "x"}))
    assert modelcard.source_license(cache) is None
    assert modelcard.source_license(tmp_path / "nothing-here") is None


@pytest.mark.parametrize("report", [None, REPORT])
def test_front_matter_is_plain_yaml(report):
    """The front matter reads back with yaml.safe_load (no Python-specific tags) as the card's own data."""
    import yaml

    text = modelcard.render(MANIFEST, report)
    front = yaml.safe_load(text.split("---\n")[1])
    assert front == modelcard.card_data(MANIFEST, report).to_dict()
    assert list(front)[:5] == ["base_model", "library_name", "license", "pipeline_tag", "tags"]


def test_a_moe_card_shows_each_layers_routed_tokens_and_the_experts_under_the_rule(tmp_path):
    stats = {"0": {"experts": {"tokens": 1024, "routed_tokens": [700, 0, 1300, 50], "min_expert_tokens": 128,
                               "calibrated_on_all_tokens": [1, 3]}, "loss": 1.0},
             "1": {"experts": {"tokens": 1024, "routed_tokens": [512, 512, 512, 512], "min_expert_tokens": 128,
                               "calibrated_on_all_tokens": []}}}
    card = _load(tmp_path, modelcard.render({**MANIFEST, "awq_stats": stats}))
    body = card.text.split("## Expert calibration\n", 1)[1].split("\n## ", 1)[0]
    assert "out of 1024 calibration tokens" in body and "fewer than 128" in body and "`awq_stats`" in body
    assert "| 0 | 4 | 0 | 700 | 1300 | 1, 3 |" in body
    assert "| 1 | 4 | 512 | 512 | 512 | none |" in body
    assert card.text.index("## Expert calibration") < card.text.index("## Evaluation")


def test_a_dense_card_has_no_expert_section(tmp_path):
    stats = {"0": {"self_attn.q_proj": {"loss": 1.0}}}
    assert "## Expert calibration" not in modelcard.render({**MANIFEST, "awq_stats": stats})  # MANIFEST is AWQ
    assert card_plots.plot_experts({**MANIFEST, "awq_stats": stats}, tmp_path / "e.png") is None
    assert not (tmp_path / "e.png").exists()


def test_the_expert_heatmap_draws_the_manifests_counts_and_the_card_links_it(tmp_path):
    from matplotlib.image import imread

    stats = {str(i): {"experts": {"tokens": 1024, "routed_tokens": [700 - i, 0, 1300, 50 + i],
                                  "min_expert_tokens": 128, "calibrated_on_all_tokens": [1, 3]}} for i in range(3)}
    m = {**MANIFEST, "awq_stats": stats}
    drawn = card_plots.plot_experts(m, tmp_path / "a.png")
    assert drawn == [stats[str(i)]["experts"]["routed_tokens"] for i in range(3)]
    img = imread(tmp_path / "a.png")
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100 and img[..., :3].std() > 0.05
    card_plots.plot_experts(m, tmp_path / "b.png")  # no timestamp or version inside: the same counts, same bytes
    assert (tmp_path / "a.png").read_bytes() == (tmp_path / "b.png").read_bytes()
    stats["2"]["experts"]["routed_tokens"][0] = 9
    card_plots.plot_experts(m, tmp_path / "c.png")
    assert (tmp_path / "a.png").read_bytes() != (tmp_path / "c.png").read_bytes()
    assert "](experts.png)" in modelcard.render({**m, "expert_plot": "experts.png"})
    assert "](experts.png)" not in modelcard.render(m)  # no plot written (matplotlib absent): no dead link


def test_the_card_lists_the_ten_largest_output_errors_and_links_their_plot(tmp_path):
    from matplotlib.image import imread

    errors = {str(i): {"self_attn.q_proj": 0.01 * (i + 1), "mlp.down_proj": 0.02 * (i + 1)} for i in range(8)}
    m = {**MANIFEST, "output_error": errors}
    assert card_plots.plot_errors(m, tmp_path / "e.png")
    img = imread(tmp_path / "e.png")
    assert img.ndim == 3 and img[..., :3].std() > 0.05
    card = modelcard.render({**m, "error_plot": "e.png"})
    body = card.split("## Where the error comes from\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in body.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 10 and rows[0] == "| 7 | mlp.down_proj | 0.1600 |" and "](e.png)" in body
    assert "## Where the error comes from" not in modelcard.render(MANIFEST)
    assert not card_plots.plot_errors(MANIFEST, tmp_path / "none.png")


def test_kl_and_top1_go_into_the_model_index():
    report = {**REPORT, "distribution": {"kl_mean": 0.0123, "kl_p99": 0.2, "top1": 0.91, "k": 64, "tokens": 8176}}
    names = {r.metric_type: r.metric_value for r in modelcard.card_data(MANIFEST, report).eval_results}
    assert names["kl_divergence"] == 0.0123 and names["top1_agreement"] == 0.91 and names["kl_divergence_p99"] == 0.2
    assert "top-1 agreement 0.9100" in modelcard.render(MANIFEST, report)


def test_the_smoke_line_names_the_vllm_it_ran_under():
    smoke = {"passed": True, "method": "awq_marlin", "token_agreement": 0.91, "vllm_version": "0.32.0"}
    text = modelcard.render(MANIFEST, {**REPORT, "vllm_smoke": smoke})
    assert "vLLM smoke-load: **passed** (vLLM 0.32.0, vLLM method `awq_marlin`" in text


def test_the_machine_names_the_processor_once_and_timings_read_as_seconds():
    import platform

    from eval.readable import machine, seconds_text

    m = machine()
    assert m.startswith(f"{platform.machine()}, ") and f"{platform.machine()} {platform.machine()}" not in m
    assert "cores" in m and "{" not in m
    assert seconds_text({"load": 12.345, "hash": 0.032, "eval": 0}) == "load 12.3 s, hash 0.032 s, eval 0 s"


def _serve_section(**over) -> str:
    serve = {"served-model-name": "smollm2-awq-g64", "quantization": "compressed-tensors", "max-model-len": 2048}
    text = modelcard.render({**MANIFEST, "serve": serve, **over})
    return text[text.index("## Serve"):text.index("## Quantization")]


AVX2 = {"model": "Intel(R) Core(TM) i7-8700", "avx512": False, "amx": False}
AMX = {"model": "Intel(R) Xeon(R) Platinum 8480+", "avx512": True, "amx": True}
AVX512 = {"model": "AMD EPYC 9654", "avx512": True, "amx": False}
BF16 = {**MANIFEST["recipe"], "dtype": "bfloat16"}


@pytest.mark.parametrize("cpu, recipe, verdict", [
    (AVX2, MANIFEST["recipe"], "(Intel(R) Core(TM) i7-8700: no AVX-512), neither command serves it: vLLM's CPU "
                               "build has no 4-bit kernel there"),
    (AMX, BF16, "(Intel(R) Xeon(R) Platinum 8480+: AVX-512, AMX), the launcher serves it and vLLM's own server "
                "does not (bfloat16 4-bit weights on AMX)"),
    (AMX, MANIFEST["recipe"], "(Intel(R) Xeon(R) Platinum 8480+: AVX-512, AMX), both commands serve it"),
    (AVX512, BF16, "(AMD EPYC 9654: AVX-512), both commands serve it"),
])
def test_the_cpu_serve_command_is_the_launcher_and_the_card_says_where_each_fails(cpu, recipe, verdict):
    """The card's first CPU command is quantize's launcher (it asks for the AMX tile state that vLLM 0.32's
    bfloat16 4-bit kernel needs, and refuses where there is no 4-bit kernel); vLLM's own server follows with where
    it fails, and the card says which of them serves the artifact on the processor it was made on."""
    text = _serve_section(cpu=cpu, recipe=recipe)
    blocks = text.split("```bash\n")[2:4]  # after the CUDA command: the launcher, then vLLM's own
    assert blocks[0].startswith("PYTHONPATH=/path/to/quantize python -m eval.serve . --port 8000\n")
    assert blocks[1].startswith("VLLM_CPU_KVCACHE_SPACE=1 python -m vllm.entrypoints.openai.api_server --model . ")
    assert "SIGILL" in text and "without AVX-512 a 4-bit model loads and its first request fails" in text
    assert f"On the processor this artifact was made on {verdict}." in text


def test_a_card_without_the_processor_recorded_gives_no_verdict():
    text = _serve_section()
    assert "python -m eval.serve" in text and "On the processor this artifact was made on" not in text


def test_the_processor_facts_come_from_cpuinfo(tmp_path):
    from quantize.export import cpu_serve

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
                    "flags\t\t: fpu sse avx2 avx512f amx_bf16 amx_tile\n")
    assert cpu_serve.facts(info) == {"model": "Intel(R) Xeon(R) Platinum 8480+", "avx512": True, "amx": True}
    info.write_text("flags\t\t: fpu sse avx2\n")
    assert cpu_serve.facts(info) == {"model": None, "avx512": False, "amx": False}
    assert cpu_serve.facts(tmp_path / "absent") is None

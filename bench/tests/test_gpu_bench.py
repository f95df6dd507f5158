"""bench/gpu_bench.py: job selection, the recipes it writes, its table and the 72B extrapolation from a
bench_ours record."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from bench import gpu_bench
from bench.bench_table import table
from bench.build_checkpoint import shaped_config


def test_table_and_extrapolation(ours_record):
    rec = ours_record
    peer_failed = {"ok": False, "rc": 1, "log_tail": "Traceback ..."}
    report = {"date": "d", "device": "cpu", "calibration": {"n_samples": 16, "seq_len": 64}, "builds": {},
              "runs": {"ours-gptq": {"ok": True, **rec}, "llmc-gptq": peer_failed,
                       "ours-72b-gptq": {"ok": True, **rec, "extrapolated": gpu_bench.extrapolate(rec, 80)}}}
    text = table(report)
    assert "llm-compressor: FAILED (rc 1)" in text
    first = rec["runlog"]["layers"][0]
    assert "ours-gptq, first layers (s)" in text and "layer 1" in text and "layer 2" in text
    assert f"{first['parts']['jobs']:.2f}" in text and "q_proj+k_proj+v_proj: hessian" in text
    assert "down_proj: sweep" in text and f"{rec['stages_s']['export']:.2f}" in text
    per = rec["per_layer"]["mean_after_first_s"]
    assert report["runs"]["ours-72b-gptq"]["extrapolated"]["quantize_s"] == round(per * 80, 1)
    # on a GPU the bound on a whole pass's peak adds the share of the device the results may keep there
    gpu = {**rec, "gpu_total_gib": 140.0, "peak_gpu_alloc_gib": 24.0}
    assert gpu_bench.extrapolate(gpu, 80)["peak_gpu_alloc_bound_gib"] == 24.0 + 0.25 * 140.0
    assert rec["gpu_total_gib"] is None and gpu_bench.extrapolate(rec, 80)["peak_gpu_alloc_bound_gib"] is None


def test_job_selection(tmp_path):
    assert gpu_bench.parse_args(["--only", "llmc-gptq,ours-72b"]).jobs == ["llmc-gptq", "ours-72b-awq",
                                                                           "ours-72b-gptq"]
    assert gpu_bench.parse_args([]).jobs == ["ours-gptq", "ours-gptq-warm", "ours-gptq-onepass", "ours-awq",
                                             "llmc-gptq", "llmc-awq"]
    args = gpu_bench.parse_args(["--batch-size", "32", "--work", str(tmp_path)])
    # the one-pass GPTQ job runs its own recipe; --batch-size reaches every recipe we write
    cmd = gpu_bench.job_command("ours-gptq-onepass", "/m", args)
    written = yaml.safe_load(Path(cmd[2]).read_text())
    assert written["base"].endswith("bench-gptq-onepass-g128.yaml") and written["batch_size"] == 32
    assert yaml.safe_load(Path(written["base"]).read_text())["gptq"]["true_sequential"] is False
    # the warm re-run is the default GPTQ recipe again
    warm = yaml.safe_load(Path(gpu_bench.job_command("ours-gptq-warm", "/m", args)[2]).read_text())
    assert warm["base"].endswith("bench-gptq-g128.yaml")
    warm = yaml.safe_load(Path(gpu_bench.job_command("ours-awq-warm", "/m", args)[2]).read_text())
    assert warm["base"].endswith("bench-awq-g128.yaml")
    with pytest.raises(SystemExit):
        gpu_bench.parse_args(["--only", "ours-awk"])


def test_shapes_built_for_the_benchmark():
    configs = gpu_bench.ROOT / "bench" / "configs"
    big = shaped_config(configs / "qwen2.5-72b", 2, tiny=False)
    assert (big.num_hidden_layers, big.hidden_size, big.intermediate_size) == (2, 8192, 29568)
    tiny = shaped_config(configs / "qwen2.5-7b", None, tiny=True)
    assert (tiny.num_hidden_layers, tiny.hidden_size, tiny.vocab_size) == (2, 256, 49152)


def test_comparison_jobs_and_summary(tmp_path):
    """compare-awq: the three group sizes alone, then all three in one pass under the same recipe names; the
    summary sets the pass against one run (g128) and the sum of the runs alone, and checks every variant's
    weights against its run alone."""
    args = gpu_bench.parse_args(["--only", "compare-awq", "--work", str(tmp_path)])
    assert args.jobs == ["ours-awq-g32", "ours-awq-g64", "ours-awq-g128", "ours-awq-compare"]
    cmd = gpu_bench.job_command("ours-awq-compare", "/m", args)
    written = [yaml.safe_load(Path(p).read_text()) for p in cmd[2:5]]
    assert [w["q_group_size"] for w in written] == [32, 64, 128] and cmd[5] == "--out-root"
    alone = {j: yaml.safe_load(Path(gpu_bench.job_command(j, "/m", args)[2]).read_text())
             for j in args.jobs[:3]}
    assert [a["name"] for a in alone.values()] == [w["name"] for w in written]
    assert all(a["base"].endswith("bench-awq-g128.yaml") for a in alone.values())

    def run(name, q, sha):
        return {"ok": True, "recipe": name, "stages_s": {"quantize": q}, "process_s": q + 10,
                "weights_sha256": {"model.safetensors": sha}}
    names = [w["name"] for w in written]
    runs = {j: run(n, q, n) for j, n, q in zip(args.jobs, names, (40.0, 38.0, 36.0))}
    runs["ours-awq-compare"] = {"ok": True, "stages_s": {"quantize": 120.0}, "process_s": 140.0,
                                "pass_seconds": {"jobs": 110.0, "checkpoint": 5.0},
                                "shared_pass": {"per_variant_s": {n: 36.0 for n in names}},
                                "variants_weights_sha256": {n: {"model.safetensors": n} for n in names[:2]}
                                | {names[2]: {"model.safetensors": "other"}}}
    c = gpu_bench.compare_summary(runs)["awq"]
    assert c["one_run_quantize_s"] == 36.0 and c["separate_quantize_s"] == 114.0
    assert c["compare_over_one_run"] == round(120 / 36, 3) and c["compare_over_separate"] == round(120 / 114, 3)
    assert list(c["byte_identical"].values()) == [True, True, False]
    assert "gptq" not in gpu_bench.compare_summary(runs)  # no GPTQ jobs ran
    report = {"date": "d", "device": "cpu", "calibration": {"n_samples": 16, "seq_len": 64}, "builds": {},
              "runs": runs, "compare": {"awq": c}}
    text = table(report)
    assert "pass / one run 3.33x (goal <= 1.5x: NOT met)" in text and "g128 NO" in text


def test_shared_search_comparison_jobs(tmp_path):
    """compare-awq-shared: the same three group sizes and pass, on the recipe whose scale search runs at g128."""
    args = gpu_bench.parse_args(["--only", "compare-awq-shared", "--work", str(tmp_path)])
    assert args.jobs == ["ours-awq-shared-g32", "ours-awq-shared-g64", "ours-awq-shared-g128", "ours-awq-shared-compare"]
    cmd = gpu_bench.job_command("ours-awq-shared-compare", "/m", args)
    written = [yaml.safe_load(Path(p).read_text()) for p in cmd[2:5]]
    assert [w["q_group_size"] for w in written] == [32, 64, 128]
    assert all(w["base"].endswith("bench-awq-shared-g128.yaml") for w in written)
    alone = yaml.safe_load(Path(gpu_bench.job_command("ours-awq-shared-g32", "/m", args)[2]).read_text())
    assert alone["name"] == written[0]["name"]
    assert gpu_bench._groups("ours-gptq-g64") == (64,) and gpu_bench._groups("ours-awq-shared-g64") == (64,)


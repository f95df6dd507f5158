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
    with pytest.raises(SystemExit):
        gpu_bench.parse_args(["--only", "ours-awk"])


def test_shapes_built_for_the_benchmark():
    configs = gpu_bench.ROOT / "bench" / "configs"
    big = shaped_config(configs / "qwen2.5-72b", 2, tiny=False)
    assert (big.num_hidden_layers, big.hidden_size, big.intermediate_size) == (2, 8192, 29568)
    tiny = shaped_config(configs / "qwen2.5-7b", None, tiny=True)
    assert (tiny.num_hidden_layers, tiny.hidden_size, tiny.vocab_size) == (2, 256, 49152)

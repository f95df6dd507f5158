"""The GPU benchmark harness (bench/) on a tiny model: what it reads from our pipeline is really there."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import yaml
from transformers import AutoConfig, AutoTokenizer

from bench import bench_ours, gpu_bench
from bench.bench_table import table
from bench.build_checkpoint import shaped_config
from quantize import calib
from tests.conftest import tiny_recipe


def test_bench_ours_reads_every_stage_and_layer(tiny_qwen2, tmp_path):
    recipe = tiny_recipe(tmp_path, tiny_qwen2, name="bench-tiny-gptq", method="gptq", zero_point=False,
                         format="gptq")
    rec = bench_ours.main([str(recipe), "--out-root", str(tmp_path / "a"), "--json", str(tmp_path / "r.json")])
    layers = AutoConfig.from_pretrained(tiny_qwen2).num_hidden_layers
    # the per-layer and stage log lines the harness parses must match what quantize logs
    assert rec["per_layer"]["n"] == layers and len(rec["per_layer"]["stamp_gaps_s"]) == layers - 1
    assert set(rec["stages_s"]) == {"preflight", "load", "calibrate", "quantize", "export"}
    assert rec["stages_s"]["export"] > 0
    # the first layers' breakdown (DEBUG records of capture and engine) and the stage stamps are parsed too
    assert set(rec["first_layers"]) == {"1", "2"}
    first = rec["first_layers"]["1"]
    assert {"to_device", "fp_forward", "jobs", "stage self_attn.q_proj+self_attn.k_proj+self_attn.v_proj"} <= set(first)
    assert set(first["stage mlp.down_proj"]) == {"hessian", "sweep"} and first["jobs"] > 0
    assert list(rec["timeline_s"])[:2] == ["preflight start", "preflight done"]
    assert rec["timeline_s"]["load done"] <= rec["timeline_s"]["quantize start"] < rec["timeline_s"]["quantize done"]
    assert rec["weights_sha256"] and all(len(h) == 64 for h in rec["weights_sha256"].values())  # runs comparable
    # llm-compressor's worker hashes its blocks the same way: equal hashes mean equal token blocks
    tok = AutoTokenizer.from_pretrained(tiny_qwen2)
    blocks = calib.make_samples(calib.load_text("groups-merged").documents, tok, 16, 64, 0)
    assert rec["calibration"]["samples_sha256"] == hashlib.sha256(blocks.numpy().tobytes()).hexdigest()

    peer_failed = {"ok": False, "rc": 1, "log_tail": "Traceback ..."}
    report = {"date": "d", "device": "cpu", "calibration": {"n_samples": 16, "seq_len": 64}, "builds": {},
              "runs": {"ours-gptq": {"ok": True, **rec}, "llmc-gptq": peer_failed,
                       "ours-72b-gptq": {"ok": True, **rec, "extrapolated": gpu_bench.extrapolate(rec, 80)}}}
    text = table(report)
    assert "llm-compressor: FAILED (rc 1)" in text
    assert "ours-gptq, first layers (s)" in text and f"{first['jobs']:.2f}" in text and "q_proj+k_proj+v_proj: hessian" in text
    assert f"{rec['stages_s']['export']:.2f}" in text
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

"""bench/bench_ours.py on a tiny model: its record comes from the run's RunLog, one entry per layer, and
its stage times account for the run."""

from __future__ import annotations

import hashlib
import json

from transformers import AutoConfig, AutoTokenizer

from quantize import calib

GPTQ_STAGES = ["self_attn.q_proj+self_attn.k_proj+self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj+mlp.up_proj", "mlp.down_proj"]


def test_one_entry_per_layer_with_positive_seconds(ours_record, tiny_qwen2):
    rec = ours_record
    n = AutoConfig.from_pretrained(tiny_qwen2).num_hidden_layers
    layers = rec["runlog"]["layers"]
    assert [x["index"] for x in layers] == list(range(n)) and rec["per_layer"]["n"] == n
    for x in layers:
        assert x["seconds"] > 0 and set(x["parts"]) == {"to_device", "fp_forward", "jobs"}
        # every figure is rounded to 0.1 ms, so the parts may overshoot the layer's wall time by that rounding
        assert sum(x["parts"].values()) <= x["seconds"] + 0.5e-4 * (len(x["parts"]) + 1)
        assert [s["stage"] for s in x["stages"]] == GPTQ_STAGES
        assert all(set(s["seconds"]) == {"hessian", "sweep"} for s in x["stages"])
        assert {s["recipe"] for s in x["stages"]} == {"bench-tiny-gptq"}
    assert rec["per_layer"]["seconds"] == [x["seconds"] for x in layers]
    # the layers are the quantize stage, less the first layer's inputs (embeddings) made before them
    # (layers are rounded to 0.1 ms, stages to 1 ms)
    assert sum(rec["per_layer"]["seconds"]) <= rec["stages_s"]["quantize"] + 0.5e-3 + 0.5e-4 * n
    total = sum(x["seconds"]["hessian"] + x["seconds"]["sweep"] for layer in layers for x in layer["stages"])
    assert abs(sum(rec["method_seconds"].values()) - total) < 1e-3


def test_stage_times_sum_close_to_the_run_time(ours_record):
    stages = ours_record["stages_s"]
    assert list(stages) == ["preflight", "calibrate", "load", "quantize", "export"]
    assert all(v > 0 for v in stages.values())
    # outside the stages: the output lock, provenance (a git subprocess), waiting for the warm-up thread
    assert 0.85 * ours_record["run_s"] <= sum(stages.values()) <= ours_record["run_s"]


def test_record_is_the_runs_own(ours_record, tiny_qwen2):
    rec = ours_record
    assert rec["runlog"]["device"] == {"device": "cpu", "compute_dtype": "float32", "cuda_allocator": None}
    assert rec["peak_gpu_alloc_gib"] is None and rec["gpu_total_gib"] is None
    assert rec["weights_sha256"] and all(len(h) == 64 for h in rec["weights_sha256"].values())  # runs comparable
    # llm-compressor's worker hashes its blocks the same way: equal hashes mean equal token blocks
    tok = AutoTokenizer.from_pretrained(tiny_qwen2)
    blocks = calib.make_samples(calib.load_text("groups-merged").documents, tok, 16, 64, 0)
    assert rec["calibration"]["samples_sha256"] == hashlib.sha256(blocks.numpy().tobytes()).hexdigest()
    json.dumps(rec)  # what gpu_bench writes


def test_shared_pass_record(tiny_qwen2, tmp_path):
    """Several recipes: one shared pass (as `pipeline compare`), each variant's share and weights recorded."""
    from bench import bench_ours
    from tests.conftest import tiny_recipe

    recipes = [str(tiny_recipe(tmp_path, tiny_qwen2, name=f"bench-tiny-gptq-g{g}", method="gptq", zero_point=False,
                               format="gptq", q_group_size=g)) for g in (32, 64)]
    rec = bench_ours.main([*recipes, "--out-root", str(tmp_path / "a"), "--json", str(tmp_path / "r.json")])
    names = ["bench-tiny-gptq-g32", "bench-tiny-gptq-g64"]
    assert rec["recipes"] == names and set(rec["shared_pass"]["per_variant_s"]) == set(names)
    assert all(v > 0 for v in rec["shared_pass"]["per_variant_s"].values())
    shas = [rec["variants_weights_sha256"][n]["model.safetensors"] for n in names]
    assert len(set(shas)) == 2 and rec["weights_sha256"]["model.safetensors"] == shas[0]
    assert set(rec["pass_seconds"]) == {"to_device", "fp_forward", "jobs", "checkpoint"}

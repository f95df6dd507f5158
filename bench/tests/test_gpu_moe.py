"""bench/gpu_moe.py in its CPU mode: the tiny Qwen3-MoE shape through our AWQ and GPTQ (and llm-compressor's
where its venv exists), each in its own process, recorded per layer."""

from __future__ import annotations

import json

import pytest

from bench import gpu_moe
from bench.build_checkpoint import shaped_config


def test_moe_shape_built_for_the_benchmark():
    cfg = shaped_config(gpu_moe.ROOT / "bench" / "configs" / gpu_moe.CONFIG, 2, tiny=False)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
            cfg.moe_intermediate_size, cfg.head_dim, cfg.vocab_size) == (2, 2048, 128, 8, 768, 128, 151936)
    tiny = shaped_config(gpu_moe.ROOT / "bench" / "configs" / gpu_moe.CONFIG, None, tiny=True)
    assert (tiny.num_experts, tiny.moe_intermediate_size, tiny.hidden_size) == (8, 128, 256)


def _run(tmp_path, jobs: str) -> dict:
    rc = gpu_moe.main(["--tiny", "--device", "cpu", "--only", jobs, "--work", str(tmp_path / "w"),
                       "--out", str(tmp_path / "out")])
    report = json.loads((tmp_path / "out" / "gpu_moe.json").read_text())
    assert rc == 0, {j: r.get("log_tail", "")[-2000:] for j, r in report["runs"].items()}
    return report


def test_ours_in_tiny_cpu_mode(tmp_path):
    report = _run(tmp_path, "ours-awq,ours-gptq")
    for job in ("ours-awq", "ours-gptq"):
        s = report["summary"][job]
        assert s["ok"] and len(s["per_layer_s"]) == 2 and all(x > 0 for x in s["per_layer_s"])
        assert (tmp_path / "out" / f"{job}.log").is_file()
        # every expert of every layer was calibrated and its token count recorded
        art = report["runs"][job]["artifact"]
        stats = json.loads(open(f"{art}/manifest.json").read())[f"{job[5:]}_stats"]
        assert all(len(stats[str(i)]["experts"]["routed_tokens"]) == 8 for i in range(2))
    assert "ours-gptq" in "\n".join(report["table"])


@pytest.mark.skipif(not gpu_moe.PEER_VENV_PYTHON.is_file(),
                    reason=f"llm-compressor's venv {gpu_moe.PEER_VENV_PYTHON} is absent here")
def test_llmcompressor_in_tiny_cpu_mode(tmp_path):
    report = _run(tmp_path, "llmc-gptq")
    assert report["summary"]["llmc-gptq"]["ok"]

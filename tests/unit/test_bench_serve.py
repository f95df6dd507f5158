"""make bench-serve: the command it gives vLLM's serving benchmark is one that benchmark's own parser accepts,
and the report puts both models side by side at every level, failures included."""

import json

import pytest

from eval import bench_serve


def test_bench_command_parses_with_vllms_benchmark_parser(tmp_path):
    serve_mod = pytest.importorskip("vllm.benchmarks.serve")
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cmd = bench_serve.bench_command("http://127.0.0.1:1234", "tiny-chat", tmp_path, 8, 16, 128, 32, tmp_path, "r.json")
    assert cmd[1:3] == ["-m", "eval.vllm_bench"]
    parser = FlexibleArgumentParser()
    serve_mod.add_cli_args(parser)
    args = parser.parse_args(cmd[3:])
    assert (args.base_url, args.served_model_name, args.max_concurrency, args.num_prompts, args.dataset_name,
            args.random_input_len, args.random_output_len, args.metric_percentiles) == (
        "http://127.0.0.1:1234", "tiny-chat", 8, 16, "random", 128, 32, "50,95")
    assert args.save_result and args.result_filename == "r.json" and args.ignore_eos


def _figures(x):
    return {"output_throughput": 10.0 * x, "request_throughput": x, "p50_ttft_ms": 100.0, "p95_ttft_ms": 150.0,
            "p50_itl_ms": 20.0, "p95_itl_ms": 30.0, "completed": 16, "failed": 0}


def test_report_side_by_side_with_a_failed_side(tmp_path, monkeypatch):
    art = tmp_path / "tiny-serve"
    art.mkdir()
    (art / "manifest.json").write_text(json.dumps({
        "artifact": "tiny-serve", "format": {"name": "awq", "quant_method": "awq"}, "model": {"spec": "base"},
        "recipe": {"method": "awq", "w_bit": 4, "q_group_size": 128, "zero_point": True, "dtype": "float16",
                   "serve": {"concurrency": [1, 8]}}}))
    (art / "vllm-serve.yaml").write_text("quantization: awq_marlin\nserved-model-name: tiny-chat\ndtype: float16\n")
    monkeypatch.setattr(bench_serve.source, "resolve", lambda spec: type("S", (), {"path": tmp_path / "ref"}))
    asked = []

    def fake_side(model_dir, extra, levels, n, input_len, output_len, work, label, timeout):
        asked.append((label, extra, levels))
        if label == "quantized":
            return {"model": str(model_dir), "served_name": "tiny-chat", "levels": {1: {"error": "no kernel"}}}
        return {"model": str(model_dir), "served_name": "tiny-chat-fp16", "levels": {c: _figures(c) for c in levels}}

    monkeypatch.setattr(bench_serve, "run_side", fake_side)
    r = bench_serve.bench(art, 16, 128, 32, None)
    assert asked == [("quantized", {}, [1, 8]),
                     ("fp16", {"served-model-name": "tiny-chat-fp16", "dtype": "float16"}, [1, 8])]
    md = (tmp_path / "tiny-serve-bench-serve.md").read_text()
    assert "| 8 | fp16 `tiny-chat-fp16` | 80.00 | 8.00 | 100.00 | 150.00 | 20.00 | 30.00 |" in md
    assert "| 1 | quantized `tiny-chat` | — |" in md and "no kernel" in md
    assert json.loads((tmp_path / "tiny-serve-bench-serve.json").read_text())["fp16"]["levels"]["8"][
        "output_throughput"] == 80.0
    assert (tmp_path / "tiny-serve-bench-serve.png").stat().st_size > 1000
    assert r["concurrency"] == [1, 8]

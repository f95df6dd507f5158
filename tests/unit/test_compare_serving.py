"""make compare's serving columns: when they are measured (and the one-line refusal of --serving where vLLM cannot
serve 4-bit weights), the table's columns and notes with a measured, a failed and an unserved row, the skipped
case, and the plot's quality-against-speed panel."""

from __future__ import annotations

import json

import pytest

from eval import serving
from pipeline import compare, compare_serving
from pipeline.cli import main

NO_KERNEL = "vLLM's CPU build on this processor (no AVX-512) has no 4-bit kernel"


def _row(variant, group, kl, serving_rec, external=False):
    return {"variant": variant, "artifact": f"/a/{variant}", "external": external, "tool": "AutoAWQ" if external
            else None, "method": None if external else "awq", "w_bit": 4, "group_size": group, "zero_point": True,
            "format": "awq", "format_title": "AutoAWQ GEMM", "bytes_on_disk": 2e6, "bits_per_weight": 4.5,
            "ppl_fp16": 10.0, "ppl": 10.5, "delta_ppl": 0.5, "delta_ppl_pct": 5.0, "vllm_smoke": "passed",
            "token_agreement": 0.9, "kl_mean": kl, "kl_p99": 0.3, "top1": 0.9, "eval_passed": True, "protocol": None,
            "quantize_s": 3.0, "pipeline_s": 4.0, "base_model": "base", "source_bytes": None,
            "h100_tp1_kernel": None, "serving": serving_rec}


def _figures(tok_s, kv_tokens, weights=None):
    return {"concurrency": 32, "num_prompts": 128, "input_len": 128, "output_len": 32, "served_name": "x",
            "load_s": 41.5, "gpu_memory_utilization": None, "output_throughput": tok_s, "request_throughput": 1.0,
            "p50_ttft_ms": 200.0, "p95_ttft_ms": 318.48, "completed": 128, "failed": 0, "duration": 2.0,
            "weights_gib": weights, "kv_cache_gib": 1.0, "kv_cache_tokens": kv_tokens, "error": None}


ROWS = [_row("m-g64", 64, 0.05, _figures(2020.43, 1048576, weights=5.17)),
        _row("m-g128", 128, 0.08, _figures(2410.0, 1100000)),
        _row("m-g32", 32, 0.03, {**_figures(None, None), "output_throughput": None,
                                 "error": "vLLM's server exited (1) while starting:\nValueError: out of memory"}),
        _row("peer", 64, 0.06, {"skipped": compare_serving.NOT_OURS}, external=True)]
META = {"date": "2026-12-07", "machine": "x86_64, 2 cores, no GPU", "serving": {**compare_serving.settings(None),
                                                                               "vllm": "0.32.0"}}


def test_markdown_puts_speed_and_memory_beside_quality_with_a_failed_and_an_unserved_row():
    md = compare.render_markdown("compare-m", ROWS, META)
    header = next(ln for ln in md.splitlines() if ln.startswith("| variant | method"))
    assert header.endswith("| H100 TP 1 kernel | output tok/s | TTFT p95 ms | weights GiB | KV cache tokens |")
    align = md.splitlines()[md.splitlines().index(header) + 1]
    assert align.count("|") == header.count("|")
    row = {ln.split(" | ")[0].lstrip("| "): ln for ln in md.splitlines()  # the main table's rows
           if ln.count("|") == header.count("|") and ln != header}
    assert row["m-g64"].endswith("| 2020.4 | 318.5 | 5.17 | 1,048,576 |")
    assert row["m-g128"].endswith("| 2410.0 | 318.5 | n/a | 1,100,000 |")  # no weights line (the CPU build)
    assert row["m-g32"].endswith("| failed | — | — | — |")
    assert row["peer"].endswith("| — | — | — | — |")
    assert "**m-g32: serving failed**" in md and "ValueError: out of memory" in md
    assert f"peer: not served: {compare_serving.NOT_OURS}." in md
    assert "vLLM 0.32.0's serving benchmark" in md and "(here 32)" in md
    assert "| m-g64 | 32 | 128 | 200.0 | 1.00 | 41.5 |" in md  # TTFT p50, KV GiB, server start in the detail table
    assert "| m-g32 | 32 |" not in md


def test_markdown_of_a_skipped_comparison_says_why_and_adds_no_columns():
    rows = [{**r, "serving": None} for r in ROWS[:2]]
    md = compare.render_markdown("compare-m", rows, {**META, "serving": compare_serving.settings("--no-serving")})
    assert "Serving columns: skipped: --no-serving." in md
    assert "output tok/s" not in md and "TTFT" not in md
    header = next(ln for ln in md.splitlines() if ln.startswith("| variant | method"))
    assert header.endswith("| H100 TP 1 kernel |")


def _panel(rows, meta):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    compare_serving.panel(ax, rows, meta, lambda r: "tab:blue", compare._point_label)
    points = [tuple(c.get_offsets()[0]) for c in ax.collections]
    texts = [t.get_text() for t in ax.texts]
    xlabel, failed = ax.get_xlabel(), ax.get_title(loc="right")
    plt.close(fig)
    return points, texts, xlabel, failed


def test_plot_panel_has_one_labelled_point_per_served_variant_and_names_the_failed():
    points, texts, xlabel, failed = _panel(ROWS, META)
    assert points == [(2020.43, 0.05), (2410.0, 0.08)]
    assert texts == ["awq g64", "awq g128"] and failed == "serving failed: m-g32"
    assert "concurrency 32" in xlabel


def test_plot_panel_of_a_skipped_comparison_says_why(tmp_path):
    meta = {**META, "serving": compare_serving.settings("vLLM's CUDA build does not run here")}
    rows = [{**r, "serving": None} for r in ROWS[:2]]
    points, texts, _, failed = _panel(rows, meta)
    assert points == [] and texts == ["serving: skipped: vLLM's CUDA build does not run here"] and not failed
    compare.plot(rows, tmp_path / "c.png", "compare-m", meta)
    assert (tmp_path / "c.png").stat().st_size > 1000


class _Recipe:
    def __init__(self, name, levels=(1, 8, 32), w_bit=4):
        self.name, self.w_bit = name, w_bit
        self.serve = type("S", (), {"concurrency": levels})


def test_plan_on_where_cuda_runs_off_elsewhere_and_forced_either_way(monkeypatch):
    monkeypatch.setattr(compare_serving, "int4_kernel_missing", lambda: None)
    monkeypatch.setattr(compare_serving, "cuda_build", lambda: False)
    v = [_Recipe("a")]
    assert "vLLM's CUDA build does not run here" in compare_serving.plan(None, True, v)
    assert compare_serving.plan(True, False, v) is None  # forced: measured on the CPU build, eval or not
    assert compare_serving.plan(False, True, v) == "--no-serving"
    monkeypatch.setattr(compare_serving, "cuda_build", lambda: True)
    assert compare_serving.plan(None, True, v) is None
    assert compare_serving.plan(None, False, v).startswith("--no-eval")
    monkeypatch.setattr(compare_serving, "cuda_build", lambda: False)
    monkeypatch.setattr(compare_serving, "int4_kernel_missing", lambda: NO_KERNEL)
    with pytest.raises(compare_serving.ServeError, match="--serving: vLLM cannot serve 4-bit weights on this host"):
        compare_serving.plan(True, True, v)
    assert compare_serving.plan(True, True, [_Recipe("a", w_bit=8)]) is None  # the missing kernel is 4-bit's


def test_forced_serving_where_4bit_cannot_serve_is_one_error_line_before_any_model_loads(tmp_path, monkeypatch,
                                                                                         capsys):
    from quantize import runner

    monkeypatch.setattr(compare_serving, "int4_kernel_missing", lambda: NO_KERNEL)
    monkeypatch.setattr(runner, "run_many", lambda *a, **k: pytest.fail("a model was loaded"))
    out = tmp_path / "art"
    assert main(["compare", "smollm2-awq-sweep", "--serving", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --serving: vLLM cannot serve 4-bit weights on this host: " + NO_KERNEL)
    assert "Traceback" not in "\n".join(err) and not out.exists()


def test_measure_all_serves_one_variant_at_a_time_at_its_highest_level_and_keeps_going(monkeypatch, caplog, tmp_path):
    calls = []

    def fake(artifact, concurrency, work):
        calls.append((artifact.name, concurrency))
        if artifact.name == "b":
            return {**_figures(None, None), "output_throughput": None, "error": "ValueError: no memory"}
        return _figures(100.0, 2048)

    monkeypatch.setattr(compare_serving, "measure", fake)
    caplog.set_level("INFO", logger="pipeline.compare_serving")
    got = compare_serving.measure_all([(_Recipe("a", (1, 8)), tmp_path / "a"), (_Recipe("b"), tmp_path / "b")],
                                      [tmp_path / "peer"])
    assert calls == [("a", 8), ("b", 32)]
    assert got[str(tmp_path / "a")]["kv_cache_tokens"] == 2048 and got[str(tmp_path / "b")]["error"]
    assert got[str(tmp_path / "peer")] == {"skipped": compare_serving.NOT_OURS}
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "serving 1/2 a: vLLM's server, then its serving benchmark at concurrency 8 (32 requests)"
    assert lines[1].startswith("serving a: 100.0 output tok/s, TTFT p95 318 ms, KV cache 2,048 tokens")
    assert lines[3] == "serving b: FAILED: ValueError: no memory"


def test_measure_names_the_missing_4bit_kernel_and_reads_the_log(tmp_path, monkeypatch):
    """A benchmark that failed on the CPU build's missing kernel says so; the start-up figures are read either way."""
    def fake_side(model_dir, extra, levels, n, input_len, output_len, work, label, timeout):
        (work / f"{label}-server.log").write_text(
            "INFO Explicitly set (1.0/23.54) GiB for KV cache on node 0.\nINFO CPU KV cache size: 4,096 tokens, x\n"
            "ERROR torch.ops._C.cpu_gemm_wna16 not found\n")
        assert (levels, n, input_len, output_len) == ([8], 32, serving.INPUT_LEN, serving.OUTPUT_LEN)
        return {"served_name": "t", "load_s": 3.0, "levels": {8: {"error": "RuntimeError: request failed"}}}

    monkeypatch.setattr(serving, "run_side", fake_side)
    monkeypatch.setattr(serving, "cuda_build", lambda: False)
    r = serving.measure(tmp_path / "t", 8, tmp_path)
    assert r["error"].startswith("RuntimeError: request failed\n") and serving.INT4_MISSING in r["error"]
    assert (r["kv_cache_gib"], r["kv_cache_tokens"], r["weights_gib"], r["output_throughput"]) == (1.0, 4096, None,
                                                                                                   None)
    assert json.dumps(r)  # the record goes into compare-<name>.json as it is

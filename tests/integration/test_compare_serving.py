"""`python -m pipeline compare --serving` on this host's vLLM: a two-variant group-size sweep, each variant behind
vLLM's server in turn and measured by vLLM's serving benchmark at its recipe's highest serve.concurrency; the
figures land in compare-<name>.json and .md, progress is told per variant, and no server is left behind.

Where vLLM cannot serve 4-bit weights (not installed, or an AVX2-only CPU) the conftest skips it, saying why (the
refusal of --serving there is tests/unit/test_compare_serving.py's)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eval.vllm_run import cuda_build
from tests.conftest import tiny_recipe
from tests.integration.test_serve import _api_servers

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[2]


def test_compare_with_serving_columns(tiny_llama, tmp_path):
    recipe = tiny_recipe(tmp_path, tiny_llama, name="tiny-sv", method="rtn", sweep={"q_group_size": [32, 64]},
                         eval=dict(perplexity=dict(dataset="wikitext2", seq_len=128, max_windows=2),
                                   vllm=dict(enabled=False)),
                         serve=dict(concurrency=[1, 8]))
    out = tmp_path / "a"
    before = _api_servers()
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "pipeline", "compare", str(recipe), "--serving", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=1500)
    wall = time.perf_counter() - t0
    assert p.returncode == 0, p.stderr[-4000:]
    doc = json.loads((out / "compare-tiny-sv.json").read_text())
    assert doc["serving"]["skipped"] is None and doc["serving_failed"] == []
    md = (out / "compare-tiny-sv.md").read_text()
    assert "| output tok/s | TTFT p95 ms | weights GiB | KV cache tokens |" in md
    for r in doc["rows"]:
        s = r["serving"]
        print(f"{r['variant']}: {json.dumps(s)}")
        assert s["error"] is None and s["concurrency"] == 8 and s["num_prompts"] == 32
        assert s["completed"] == 32 and s["failed"] == 0
        for k in ("output_throughput", "p50_ttft_ms", "p95_ttft_ms", "kv_cache_gib", "kv_cache_tokens", "load_s"):
            assert s[k] > 0, (r["variant"], k, s[k])
        assert s["p95_ttft_ms"] >= s["p50_ttft_ms"]
        if cuda_build():
            assert s["weights_gib"] > 0
        else:
            assert s["weights_gib"] is None  # the CPU build logs no weights figure
        line = next(ln for ln in md.splitlines() if ln.startswith(f"| {r['variant']} | rtn |"))
        assert line.endswith(f"| {s['output_throughput']:.1f} | {s['p95_ttft_ms']:.1f} | "
                             f"{'n/a' if s['weights_gib'] is None else format(s['weights_gib'], '.2f')} | "
                             f"{s['kv_cache_tokens']:,} |")
        assert f"serving {r['variant']}: {s['output_throughput']:.1f} output tok/s" in p.stderr
    assert "serving 1/2 tiny-sv-g32: vLLM's server, then its serving benchmark at concurrency 8" in p.stderr
    assert doc["timings_s"]["serving_all"] > 0
    assert (out / "compare-tiny-sv.png").stat().st_size > 1000
    assert _api_servers() <= before  # every server stopped, with its workers
    print(f"compare --serving took {wall:.0f} s (serving {doc['timings_s']['serving_all']:.0f} s)")

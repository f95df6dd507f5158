"""bench/kernel_profile.py: kernel kinds, the busy-time union, and bench_ours' --profile on a tiny CPU run."""

from __future__ import annotations

import json

import pytest

from bench.kernel_profile import busy_seconds, kind_of


@pytest.mark.parametrize("name,kind", [
    ("nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", "attention"),
    ("sweep_block", "triton_ours"),
    ("fake_quant_kernel", "triton_ours"),
    ("void potrf_lower_cta_kernel<float>", "solver"),
    ("Memcpy HtoD (Pageable -> Device)", "copy"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::AbsFunctor<float>>", "elementwise_reduce"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>", "elementwise_reduce"),
    ("some_unknown_kernel", "other"),
])
def test_kind_of(name, kind):
    assert kind_of(name) == kind


def test_busy_counts_overlap_once():
    assert busy_seconds([]) == 0
    assert busy_seconds([(0, 2), (1, 3)]) == 3  # overlapping streams
    assert busy_seconds([(5, 6), (0, 1), (0.5, 0.7)]) == 2  # unsorted, nested
    assert busy_seconds([(0, 1), (2, 4)]) == 3  # a gap is not busy


def test_bench_ours_profile(tiny_qwen2, tmp_path):
    from bench import bench_ours
    from tests.conftest import tiny_recipe

    recipe = tiny_recipe(tmp_path, tiny_qwen2, name="bench-tiny-awq", method="awq")
    rec = bench_ours.main([str(recipe), "--out-root", str(tmp_path / "a"), "--json", str(tmp_path / "r.json"),
                           "--profile", str(tmp_path / "p.json")])
    summary = json.loads((tmp_path / "p.json").read_text())
    assert summary["wall_s"] == pytest.approx(rec["stages_s"]["quantize"], abs=1e-3)
    # a CPU run launches no device kernels: the summary says so rather than inventing any
    assert summary["kernels"] == 0 and summary["busy_s"] == 0 and summary["top"] == []
    assert rec["profile"]["busy_s"] == 0

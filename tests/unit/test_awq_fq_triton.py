"""The Triton fake-quantization of AWQ's scale-search candidates gives torch's values bit for bit.

On a CUDA host the kernel runs compiled; elsewhere under Triton's CPU interpreter (TRITON_INTERPRET=1, in a
subprocess, see `tests.conftest.triton_compare`). Every case compares the kernel's candidate (and its ΔW) with
`awq_search._scaled_fake_quant` on the same device, for both dtypes a GPU run computes in, asymmetric and
symmetric grids, several bit widths and group sizes, and row counts that are not a multiple of the kernel's tile.
"""

import pytest
import torch

from tests.conftest import triton_compare

pytest.importorskip("triton")

# (w_bit, group, symmetric, out rows, dtype)
CASES = [(4, 128, False, 70, "bfloat16"), (4, 64, False, 64, "float16"), (4, 32, True, 40, "bfloat16"),
         (8, 128, False, 33, "float16"), (3, 64, True, 48, "bfloat16"), (4, 16, False, 17, "float32")]


def compare(device: str) -> list[dict]:
    """Every case by both implementations on `device` -> per case: elements that differ (candidate and ΔW)."""
    from quantize.methods import kernels
    from quantize.methods import awq_search as awq

    fq = kernels.awq_fake_quant("triton", torch.device(device))
    out = []
    for seed, (w_bit, g, symmetric, rows, dtype) in enumerate(CASES):
        gen = torch.Generator().manual_seed(seed)
        in_f = 4 * g
        # heavy-tailed weights, a group of zeros (a zero range), and scales spanning decades like AWQ's s(α)
        w = torch.randn(rows, in_f, generator=gen) * torch.rand(rows, in_f, generator=gen).pow(4) * 3
        w[0, :g] = 0
        w = w.to(getattr(torch, dtype)).to(device)
        s = torch.exp(torch.randn(in_f, generator=gen) * 1.5).float().to(device)
        spec = awq.QSpec(w_bit, g, symmetric=symmetric)
        want = awq.TORCH_FQ.candidate(w, s, spec)
        got = fq.candidate(w, s, spec)
        stacked = torch.full((2, rows, in_f), float("nan"), device=device)  # a candidate's slice of a stack
        fq.delta(w, s, spec, stacked[1])
        want_d = awq.TORCH_FQ.delta(w, s, spec, torch.empty(rows, in_f, device=device))
        out.append({"case": str(CASES[seed]), "dtype": str(got.dtype) == f"torch.{dtype}",
                    "candidate_differ": int((got.view(torch.int16 if got.element_size() == 2 else torch.int32)
                                             != want.view(torch.int16 if want.element_size() == 2 else torch.int32))
                                            .sum()),
                    "delta_differ": int((stacked[1].view(torch.int32) != want_d.view(torch.int32)).sum()),
                    "untouched": bool(stacked[0].isnan().all())})
    return out


def test_triton_fake_quant_is_torchs_bit_for_bit():
    results = triton_compare("tests.unit.test_awq_fq_triton")
    assert len(results) == len(CASES)
    for r in results:
        assert r["dtype"] and r["untouched"], r
        assert r["candidate_differ"] == 0 and r["delta_differ"] == 0, r


def end_to_end(tmp: str) -> dict:
    """A tiny Llama quantized with AWQ twice, the search's candidates by torch and by the kernel (compiled on CUDA,
    else interpreted) -> each artifact's weights sha256, keyed by the kernel setting."""
    from pathlib import Path

    from quantize import manifest, runner
    from tests.conftest import build_tiny_model, tiny_recipe

    root = Path(tmp)
    model = build_tiny_model(root / "m", "llama", hidden=128, intermediate=256)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = {}
    for kernel in ("torch", "triton"):
        recipe = tiny_recipe(root, model, name=f"fq-{kernel}", device=device, eval={"enabled": False},
                             advanced={"awq": {"search_kernel": kernel}})
        art = runner.run(str(recipe), out_root=root / "a", force=True)
        out[kernel] = manifest.read(art).files["model.safetensors"].sha256
    return out


def test_search_with_the_kernel_writes_the_same_artifact(tmp_path):
    """The search wired to the kernel picks what it picks with torch's: the artifact is the same, byte for byte."""
    import json
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    if torch.cuda.is_available():
        shas = end_to_end(str(tmp_path))
    else:
        env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        code = ("import json; from tests.unit.test_awq_fq_triton import end_to_end; "
                f"print(json.dumps(end_to_end({str(tmp_path)!r})))")
        p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=900)
        assert p.returncode == 0, p.stderr[-3000:]
        shas = json.loads(p.stdout.strip().splitlines()[-1])
    assert shas["torch"] == shas["triton"]

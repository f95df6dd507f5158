"""The Triton clip search picks what the torch search picks, up to float32 ties in the error it minimises.

On a CUDA host the kernel runs compiled; elsewhere under Triton's CPU interpreter (TRITON_INTERPRET=1, set in a
subprocess because triton reads it when the kernel is defined). Both searches' picks are scored by one reference
(the torch search's own error, `awq_grid._group_err`): where the picks differ, the two errors must agree to
float32 rounding, i.e. the two sums of Δ G Δᵀ ordered two candidates of equal error differently.
"""

import pytest
import torch

from tests.conftest import triton_compare

pytest.importorskip("triton")

# (w_bit, group, symmetric, per_side, out rows): rows not a multiple of the kernel's row tile on purpose
CASES = [(4, 128, False, True, 70), (4, 64, False, False, 64), (4, 32, True, False, 40), (8, 128, False, True, 33),
         (3, 64, True, True, 48)]


def _err(w: torch.Tensor, gram: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, spec) -> torch.Tensor:
    """The torch search's error [out, n_group] of the grid that the clip range (lo, hi) [out, n_group] sets."""
    from quantize.methods import awq_grid

    out_f, in_f = w.shape
    wg = w.float().reshape(out_f, in_f // spec.group, spec.group)
    s, z = awq_grid.clip_grid(w, lo, hi, spec)
    q = torch.clamp(torch.round(torch.clamp(wg, lo.unsqueeze(-1), hi.unsqueeze(-1)) / s.unsqueeze(-1))
                    + z.unsqueeze(-1), 0, 2**spec.w_bit - 1)
    return awq_grid._group_err((q - z.unsqueeze(-1)) * s.unsqueeze(-1) - wg, gram)


def compare(device: str) -> list[dict]:
    """Every case searched by both implementations on `device` -> per case: the share of groups whose pick
    differs, and the largest relative gap between the two picks' errors."""
    from quantize.methods import kernels
    from quantize.methods import awq_grid, awq_search as awq

    out = []
    for seed, (w_bit, g, symmetric, per_side, rows) in enumerate(CASES):
        gen = torch.Generator().manual_seed(seed)
        in_f = 4 * g
        # heavy-tailed weights (so clipping pays) and correlated inputs (so G is not diagonal)
        w = (torch.randn(rows, in_f, generator=gen) * torch.rand(rows, in_f, generator=gen).pow(4) * 3).to(device)
        x = torch.randn(512, in_f, generator=gen) @ (torch.eye(in_f) + 0.3 * torch.randn(in_f, in_f, generator=gen))
        gram = awq_grid.group_gram(x.to(device), g)
        spec = awq.QSpec(w_bit, g, symmetric=symmetric)
        picks = [kernels.awq_clip(kernel, w.device)(w, gram, spec, 20, 0.5, per_side) for kernel in ("torch", "triton")]
        (lo_a, hi_a), (lo_b, hi_b) = picks
        differ = (lo_a != lo_b) | (hi_a != hi_b)
        err_a, err_b = _err(w, gram, lo_a, hi_a, spec), _err(w, gram, lo_b, hi_b, spec)
        gap = ((err_b - err_a).abs() / err_a.clamp(min=1e-30))[differ]
        out.append({"case": str(CASES[seed]), "differ": differ.float().mean().item(),
                    "gap": gap.max().item() if gap.numel() else 0.0,
                    "shape": list(lo_b.shape) == [rows, in_f // g]})
    return out


def test_triton_clip_search_picks_the_torch_search():
    results = triton_compare("tests.unit.test_awq_clip_triton")
    for r in results:
        assert r["shape"], r
        assert r["differ"] <= 0.02 and r["gap"] < 1e-5, r  # ties in float32, nothing more


@pytest.mark.parametrize("chooser,module,torchs,setting", [
    ("awq_clip", "awq_grid", "search_clip", "advanced.awq.clip_kernel"),
    ("awq_fake_quant", "awq_search", "TORCH_FQ", "advanced.awq.search_kernel")])
def test_awq_kernel_choice(chooser, module, torchs, setting):
    """Each AWQ kernel setting (the clip search; the scale search's fake-quantization, test_awq_fq_triton.py): torch's
    on the CPU unless triton is asked for; asked for where it cannot run, the setting is named."""
    import importlib

    from quantize.methods import kernels

    choose = getattr(kernels, chooser)
    reference = getattr(importlib.import_module(f"quantize.methods.{module}"), torchs)
    assert choose("torch", torch.device("cpu")) is reference
    if not torch.cuda.is_available():
        assert choose("auto", torch.device("cpu")) is reference
        with pytest.raises(kernels.KernelUnavailable, match=setting):
            choose("triton", torch.device("cpu"))
    with pytest.raises(ValueError, match=setting):
        choose("fast", torch.device("cpu"))

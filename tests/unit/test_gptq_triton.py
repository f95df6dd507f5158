"""The Triton column sweep gives exactly the torch sweep's codes, scales and zeros.

On a CUDA host the kernel runs compiled; elsewhere it runs under Triton's CPU interpreter
(TRITON_INTERPRET=1, set in a subprocess because triton reads it when the kernel is defined).
"""

import pytest
import torch

from tests.conftest import triton_compare

pytest.importorskip("triton")


def compare(device: str) -> list[dict]:
    """Every sweep case, quantized by both kernels on `device` -> per case: which fields are equal."""
    from quantize.methods import kernels
    from quantize.methods import gptq_sweep as gptq
    from tests.unit.test_gptq import SWEEP_CASES, _case_data

    out = []
    for case in SWEEP_CASES:
        w, H, spec = _case_data(case, in_f=128)
        w, H = w.to(device), H.to(device)
        a = gptq.gptq_quantize(w, H, spec, sweep=kernels.gptq_sweep("torch", w.device))
        b = gptq.gptq_quantize(w, H, spec, sweep=kernels.gptq_sweep("triton", w.device))
        out.append({"case": str(case), "kernel": b.kernel, "codes": torch.equal(a.codes, b.codes),
                    "scales": torch.equal(a.scales, b.scales), "zeros": torch.equal(a.zeros, b.zeros),
                    "loss_rel": abs(a.loss - b.loss) / a.loss})
    return out


def test_triton_sweep_equals_torch_sweep():
    results = triton_compare("tests.unit.test_gptq_triton")
    for r in results:
        assert r["kernel"] == "triton" and r["codes"] and r["scales"] and r["zeros"], r
        assert r["loss_rel"] < 1e-4, r  # the loss is summed in another order

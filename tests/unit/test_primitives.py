import pytest
import torch

from quantize.methods.primitives import dequantize, fake_quant, qparams, quantize, quantize_for_export


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_fake_quant_properties(symmetric, group):
    torch.manual_seed(0)
    w = torch.randn(64, 256)
    wq = fake_quant(w, 4, group, symmetric=symmetric)
    assert wq.shape == w.shape and wq.dtype == w.dtype
    # idempotent: quantizing a quantized weight changes (almost) nothing
    assert torch.allclose(fake_quant(wq, 4, group, symmetric=symmetric), wq, atol=1e-5)
    # at most 16 distinct values per group
    for row in wq.reshape(-1, group)[:20]:
        assert row.unique().numel() <= 16
    # error bounded by half a step (plus clamping at the edges for symmetric)
    scales, _ = qparams(w, 4, group, symmetric=symmetric)
    step = scales.abs().repeat_interleave(group, dim=1)  # symmetric scales are signed
    bound = 1.0 if symmetric else 0.5
    assert ((w - wq).abs() <= bound * step + 1e-6).all()


def test_codes_range_and_symmetric_zero():
    torch.manual_seed(1)
    w = torch.randn(16, 128) * 3
    s, z = qparams(w, 4, 64, symmetric=True)
    assert (z == 8).all()
    codes = quantize(w, s, z, 4)
    assert codes.dtype == torch.uint8 and codes.min() >= 0 and codes.max() <= 15
    s, z = qparams(w, 4, 64, symmetric=False)
    assert z.min() >= 0 and z.max() <= 15


def test_symmetric_grid_uses_every_code():
    # the extreme of larger magnitude lands exactly on the lowest code, whichever its sign (a negative scale where
    # it is positive), so a group spanning [-1, 1] reaches all 16 codes, not the 15 an absmax / 7 scale reaches
    w = torch.stack([torch.linspace(-1, 1, 64), torch.linspace(-1, 0.5, 64), torch.linspace(-0.5, 2, 64)])
    s, z = qparams(w, 4, 64, symmetric=True)
    assert torch.equal(s[:, 0], torch.tensor([-1 / 8, 1 / 8, -2 / 8]))
    codes = quantize(w, s, z, 4)
    assert codes[0].unique().numel() == 16
    w_hat = dequantize(codes, s, z)
    assert w_hat[0, -1] == 1 and w_hat[1, 0] == -1 and w_hat[2, -1] == 2  # each extreme exact
    assert ((w - w_hat).abs() <= s.abs() + 1e-6).all()  # the other side clips by at most one step


def test_zero_point_exact_on_grid():
    # a weight already on a 4-bit asymmetric grid is reproduced exactly
    torch.manual_seed(2)
    scales = torch.rand(8, 2) + 0.1
    zeros = torch.randint(0, 16, (8, 2), dtype=torch.int32)
    codes = torch.randint(0, 16, (8, 128), dtype=torch.uint8)
    codes[:, 0], codes[:, 64] = 0, 0
    codes[:, 1], codes[:, 65] = 15, 15
    w = dequantize(codes, scales, zeros)
    assert torch.allclose(fake_quant(w, 4, 64, symmetric=False), w, atol=1e-5)


def test_export_scales_rounded_before_codes():
    torch.manual_seed(3)
    w = torch.randn(32, 128)
    codes, scales, zeros = quantize_for_export(w, 4, 64, symmetric=False, scale_dtype=torch.float16)
    assert scales.dtype == torch.float16
    # decoding the stored tensors gives the weight the codes were chosen for, within half a step
    w_hat = dequantize(codes, scales, zeros)
    step = scales.float().repeat_interleave(64, dim=1)
    assert ((w - w_hat).abs() <= 0.5 * step + 1e-4).all()

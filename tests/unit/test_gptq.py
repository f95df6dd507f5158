import pytest
import torch

from quantize import gptq
from quantize.primitives import dequantize, fake_quant


def _data(out_f=32, in_f=128, t=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, in_f, generator=g)
    x = x @ (torch.eye(in_f) + 0.3 * torch.randn(in_f, in_f, generator=g))  # correlated inputs
    x[:, :3] *= 10
    w = torch.randn(out_f, in_f, generator=g)
    acc = gptq.HessianAccumulator(in_f)
    for chunk in x.split(100):
        acc.add(chunk)
    return w, x, acc


def test_hessian_accumulator_matches_formula():
    w, x, acc = _data()
    assert torch.allclose(acc.H, 2 * x.t() @ x / x.shape[0], rtol=1e-4, atol=1e-3)
    assert acc.n == 512


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("group", [32, -1])
def test_gptq_beats_rtn_on_output_error(act_order, sym, group):
    w, x, acc = _data()
    spec = gptq.GptqSpec(4, group, sym, block_size=64, act_order=act_order)
    r = gptq.gptq_quantize(w, acc.H, spec)
    n_group = 1 if group == -1 else 128 // group
    assert r.codes.shape == w.shape and r.scales.shape == (32, n_group) and r.zeros.shape == (32, n_group)
    assert r.codes.max() <= 15
    if sym:
        assert (r.zeros == 8).all()
    w_q = dequantize(r.codes, r.scales, r.zeros)
    g = 128 if group == -1 else group
    w_rtn = fake_quant(w, 4, g, not sym)
    err_gptq = (x @ (w_q - w).t()).pow(2).mean()
    err_rtn = (x @ (w_rtn - w).t()).pow(2).mean()
    assert err_gptq < 0.8 * err_rtn, (err_gptq, err_rtn)


def test_static_act_order_groups_stay_contiguous():
    # with act-order, each group's scale comes from its own contiguous original columns
    w, _, acc = _data()
    r = gptq.gptq_quantize(w, acc.H, gptq.GptqSpec(4, 32, True, act_order=True))
    for j in range(4):
        expect = w[:, j * 32:(j + 1) * 32].abs().amax(dim=1).clamp(min=1e-5) / 7
        assert torch.allclose(r.scales[:, j], expect, rtol=1e-6)


def test_dead_columns_and_damp_raise(caplog):
    w, _, acc = _data(in_f=64)
    H = acc.H.clone()
    H[5, :] = 0
    H[:, 5] = 0
    r = gptq.gptq_quantize(w, H, gptq.GptqSpec(4, 32, True))
    assert r.dead_columns == 1
    assert (dequantize(r.codes, r.scales, r.zeros)[:, 5] == 0).all()
    # a Hessian that is not positive definite: dampening is raised, with a warning
    a = torch.randn(64, 4, generator=torch.Generator().manual_seed(1))
    bad = a @ a.t()  # rank 4
    bad -= 0.05 * torch.diag(bad).mean() * torch.eye(64)  # slightly indefinite, as rounding can make it
    r = gptq.gptq_quantize(w, bad, gptq.GptqSpec(4, 32, True, damp=0.01))
    assert r.damp_used > 0.01
    assert "not positive definite" in caplog.text


def test_scale_dtype_rounding():
    w, _, acc = _data()
    r = gptq.gptq_quantize(w, acc.H, gptq.GptqSpec(4, 32, True, scale_dtype=torch.float16))
    assert torch.equal(r.scales, r.scales.half().float())

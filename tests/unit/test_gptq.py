import pytest
import torch

from quantize.methods import gptq_hessian, gptq_sweep as gptq
from quantize.methods.primitives import dequantize, fake_quant


def _data(out_f=32, in_f=128, t=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, in_f, generator=g)
    x = x @ (torch.eye(in_f) + 0.3 * torch.randn(in_f, in_f, generator=g))  # correlated inputs
    x[:, :3] *= 10
    w = torch.randn(out_f, in_f, generator=g)
    acc = gptq_hessian.HessianAccumulator(in_f)
    for chunk in x.split(100):
        acc.add(chunk)
    return w, x, acc


def test_hessian_accumulator_matches_formula():
    w, x, acc = _data()
    assert torch.allclose(acc.H, 2 * x.t() @ x / x.shape[0], rtol=1e-4, atol=1e-3)
    assert acc.n == 512


def test_hessian_upper_blocks_mirrored(monkeypatch):
    # wide inputs: only the upper block triangle of XᵀX is computed; H as read is the full symmetric matrix
    monkeypatch.setattr(gptq_hessian.HessianAccumulator, "symmetric_min", 64)
    monkeypatch.setattr(gptq_hessian.HessianAccumulator, "symmetric_block", 48)  # 130 = 48 + 48 + 34: ragged last
    g = torch.Generator().manual_seed(3)
    x = torch.randn(300, 130, generator=g, dtype=torch.float64).float()
    acc = gptq_hessian.HessianAccumulator(130)
    for chunk in x.split(70):
        acc.add(chunk)
    assert acc._upper
    H = acc.H
    assert torch.equal(H, H.t())
    assert torch.allclose(H, 2 * x.t() @ x / 300, rtol=1e-4, atol=1e-4)
    assert torch.equal(acc.H, H)  # reading again changes nothing


def test_tf32_update_is_close_but_not_float32():
    g = torch.Generator().manual_seed(4)
    assert gptq._tf32(torch.tensor([1 + 2**-11, 1 + 2**-12, 1 + 2**-10, -3.0])).tolist() == [1 + 2**-10, 1.0,
                                                                                              1 + 2**-10, -3.0]
    W, D1, A = (torch.randn(*s, generator=g) for s in ((16, 96), (16, 32), (32, 96)))
    exact, approx = W.clone(), W.clone()
    gptq.lazy_update(exact, 40, D1, A, gptq.GptqSpec(4, 32, True))
    gptq.lazy_update(approx, 40, D1, A, gptq.GptqSpec(4, 32, True, update="tf32"))
    assert torch.equal(exact[:, :40], W[:, :40]) and torch.allclose(exact[:, 40:], W[:, 40:] + D1 @ A[:, 40:],
                                                                    atol=1e-5)
    err = (approx - exact).abs().max().item()
    assert 0 < err < 3e-2  # operands carry 11 significant bits: |D1 @ A| ~ 6, relative 2^-11 per product
    with pytest.raises(ValueError, match="update 'bf16' is unknown"):
        gptq.lazy_update(W, 40, D1, A, gptq.GptqSpec(4, 32, True, update="bf16"))


def test_tf32_update_keeps_gptq_loss():
    # the approximation moves a few codes and GPTQ's loss by far less than GPTQ gains over round-to-nearest
    w, x, acc = _data(out_f=128, in_f=256)
    spec = gptq.GptqSpec(4, 32, True, block_size=32, act_order=True)
    exact = gptq.gptq_quantize(w, acc.H, spec)
    approx = gptq.gptq_quantize(w, acc.H, gptq.GptqSpec(4, 32, True, block_size=32, act_order=True, update="tf32"))
    changed = (approx.codes != exact.codes).float().mean().item()
    assert 0 < changed < 0.02
    assert approx.loss == pytest.approx(exact.loss, rel=0.01)


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group", [32, -1])
def test_gptq_beats_rtn_on_output_error(act_order, symmetric, group):
    w, x, acc = _data()
    spec = gptq.GptqSpec(4, group, symmetric, block_size=64, act_order=act_order)
    r = gptq.gptq_quantize(w, acc.H, spec)
    n_group = 1 if group == -1 else 128 // group
    assert r.codes.shape == w.shape and r.scales.shape == (32, n_group) and r.zeros.shape == (32, n_group)
    assert r.codes.max() <= 15
    if symmetric:
        assert (r.zeros == 8).all()
    w_q = dequantize(r.codes, r.scales, r.zeros)
    g = 128 if group == -1 else group
    w_rtn = fake_quant(w, 4, g, symmetric=symmetric)
    err_gptq = (x @ (w_q - w).t()).pow(2).mean()
    err_rtn = (x @ (w_rtn - w).t()).pow(2).mean()
    assert err_gptq < 0.8 * err_rtn, (err_gptq, err_rtn)


def test_static_act_order_groups_stay_contiguous():
    # with act-order, each group's scale comes from its own contiguous original columns
    w, _, acc = _data()
    r = gptq.gptq_quantize(w, acc.H, gptq.GptqSpec(4, 32, True, act_order=True))
    for j in range(4):
        wj = w[:, j * 32:(j + 1) * 32]
        m = wj.abs().amax(dim=1).clamp(min=1e-5)
        expect = torch.where(wj.amax(dim=1).abs() >= wj.amin(dim=1).abs(), -m, m) / 8  # full-range symmetric
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


def _reference_gptq(W, H, spec):
    """The textbook per-column GPTQ sweep (Frantar et al.: upper Cholesky factor of H⁻¹, errors divided by its
    diagonal), in float64, kept as the oracle for `gptq_quantize`'s inverse-free (LDLQ) form of the same update."""
    W, H = W.double().clone(), H.double().clone()
    out_f, in_f = W.shape
    g = in_f if spec.group == -1 else spec.group
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    scales = torch.zeros(out_f, in_f // g)
    zeros = torch.zeros(out_f, in_f // g, dtype=torch.int32)
    if spec.act_order:
        for j in range(in_f // g):
            scales[:, j], zeros[:, j] = gptq._qp(W[:, j * g:(j + 1) * g], spec)
        perm = torch.argsort(torch.diag(H), descending=True)
    else:
        perm = torch.arange(in_f)
    W, H = W[:, perm], H[perm][:, perm]
    H += spec.damp * torch.mean(torch.diag(H)) * torch.eye(in_f, dtype=H.dtype)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    codes = torch.zeros(out_f, in_f, dtype=torch.uint8)
    loss = torch.zeros(out_f, dtype=torch.float64)
    for i1 in range(0, in_f, spec.block_size):
        i2 = min(i1 + spec.block_size, in_f)
        W1, Err1, Hinv1 = W[:, i1:i2].clone(), torch.zeros(out_f, i2 - i1, dtype=W.dtype), Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            j = int(perm[i1 + i]) // g
            if not spec.act_order and (i1 + i) % g == 0:
                span = W1[:, i:i + g] if i + g <= W1.shape[1] else W[:, i1 + i:i1 + i + g]
                scales[:, j], zeros[:, j] = gptq._qp(span, spec)
            w = W1[:, i]
            q = torch.clamp(torch.round(w / scales[:, j]) + zeros[:, j], 0, 2**spec.w_bit - 1)
            codes[:, i1 + i] = q.to(torch.uint8)
            err = (w - (q - zeros[:, j]) * scales[:, j]) / Hinv1[i, i]
            W1[:, i:] -= err.unsqueeze(1) @ Hinv1[i, i:].unsqueeze(0)
            Err1[:, i] = err
        loss += Err1.pow(2).sum(dim=1) / 2
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    return codes[:, torch.argsort(perm)], scales, zeros, loss


# (act_order, symmetric, group, block_size, scale_dtype): groups inside, equal to, and wider than a block, per-channel
SWEEP_CASES = [
    (False, True, 32, 64, torch.float32), (False, False, 32, 64, torch.bfloat16), (False, True, 64, 64, torch.float16),
    (False, False, 128, 64, torch.float16), (False, True, -1, 64, torch.float32), (False, False, -1, 64, torch.float16),
    (True, True, 32, 64, torch.float16), (True, False, 64, 64, torch.bfloat16), (True, True, -1, 64, torch.float32),
    (False, False, 16, 48, torch.float16),  # block not a power of two, partial last block
]


def _case_data(case, out_f=12, in_f=256, seed=0):
    w, _, acc = _data(out_f=out_f, in_f=in_f, seed=seed)
    H = acc.H.clone()
    H[7, :] = 0  # one dead input
    H[:, 7] = 0
    act_order, symmetric, group, block, scale_dtype = case
    return w, H, gptq.GptqSpec(4, group, symmetric, block, act_order=act_order, scale_dtype=scale_dtype)


@pytest.mark.parametrize("case", SWEEP_CASES)
def test_sweep_equals_textbook_gptq(case):
    # in float64 the inverse-free update makes exactly the textbook's choices (same maths, rounding far from
    # any tie); in float32 (what runs) they differ only where rounding lands on a tie: a handful of codes
    w, H, spec = _case_data(case)
    codes, scales, zeros, loss = _reference_gptq(w, H, spec)
    r64 = gptq.gptq_quantize(w.double(), H.double(), spec)
    assert r64.kernel == "torch"
    assert torch.equal(r64.codes, codes) and torch.equal(r64.scales, scales) and torch.equal(r64.zeros, zeros)
    assert torch.allclose(r64.row_loss, loss, rtol=1e-9)
    r = gptq.gptq_quantize(w, H, spec)
    assert (r.codes != codes).float().mean() < 0.01
    assert r.loss == pytest.approx(loss.sum().item(), rel=1e-3)
    assert r.loss == pytest.approx(r.row_loss.sum().item()) and r.row_loss.shape == (12,)


@pytest.mark.parametrize("case", [c for c in SWEEP_CASES if c[3] == 64 and c[2] in (32, -1)])
def test_row_concatenation_equals_separate_calls(case):
    # linears sharing a Hessian (q/k/v, gate/up) are quantized in one call over their stacked rows
    w, H, spec = _case_data(case, out_f=20)
    parts = w.split([8, 4, 8])
    together = gptq.gptq_quantize(w, H, spec)
    rows = 0
    for p in parts:
        alone = gptq.gptq_quantize(p, H, spec)
        sl = slice(rows, rows + p.shape[0])
        assert torch.equal(together.codes[sl], alone.codes)
        assert torch.equal(together.scales[sl], alone.scales) and torch.equal(together.zeros[sl], alone.zeros)
        assert torch.allclose(together.row_loss[sl], alone.row_loss, rtol=1e-5)
        rows += p.shape[0]


def test_kernel_choice_on_cpu(monkeypatch):
    from quantize.methods import kernels

    cpu = torch.device("cpu")
    w, H, spec = _case_data(SWEEP_CASES[0])
    assert gptq.gptq_quantize(w, H, spec).kernel == "torch"  # the reference sweep by default
    assert kernels.gptq_sweep("auto", cpu) is gptq.TORCH_SWEEP
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="needs CUDA.*advanced.gptq.kernel: torch"):
        kernels.gptq_sweep("triton", cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setitem(__import__("sys").modules, "quantize.methods.gptq_triton", None)  # as if triton were missing
    monkeypatch.delattr(__import__("quantize"), "gptq_triton", raising=False)  # imported earlier on a CUDA host
    with pytest.raises(RuntimeError, match="triton does not import"):
        kernels.gptq_sweep("triton", cpu)
    with pytest.raises(ValueError, match="unknown"):
        kernels.gptq_sweep("cuda", cpu)


def test_quantize_many_equals_separate_calls():
    # several independent problems (a layer's linears with one-pass Hessians) -> exactly the separate results
    cases = [_case_data(SWEEP_CASES[6], seed=s) for s in (1, 2)]
    spec = cases[0][2]
    many = gptq.gptq_quantize_many([(w, H) for w, H, _ in cases], spec)
    for (w, H, _), r in zip(cases, many):
        alone = gptq.gptq_quantize(w, H, spec)
        assert torch.equal(r.codes, alone.codes) and torch.equal(r.scales, alone.scales)
        assert torch.equal(r.zeros, alone.zeros) and r.loss == alone.loss


def test_one_side_stream_per_device(monkeypatch):
    # the caching allocator pools blocks per stream: a fresh stream per layer would strand each layer's blocks
    from quantize.capture import device

    made = []
    monkeypatch.setattr(device, "_SIDE_STREAMS", {})
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: made.append(device) or object())
    a, b = (device.side_stream(torch.device("cuda", 0)) for _ in range(2))
    c = device.side_stream(torch.device("cuda", 1))
    assert a is b and c is not a and len(made) == 2
    assert device.side_stream(torch.device("cpu")) is None


def test_partial_hessian_sums_reduce_to_the_running_mean():
    """Two processes' `add_sum` partials, added (as all_reduce would) and scaled once, give the one-process H;
    a process that saw no tokens ends with the same H. Wide inputs use the upper blocks and are mirrored."""
    torch.manual_seed(0)
    batches = [torch.randn(2, 5, 12) for _ in range(4)]
    for wide in (False, True):
        accs = [gptq_hessian.HessianAccumulator(12) for _ in range(4)]  # one process; two sharing; one with no tokens
        for a in accs:
            if wide:
                a.symmetric_min, a.symmetric_block = 8, 4
        for b in batches:
            accs[0].add(b)
        for b in batches[:2]:
            accs[1].add_sum(b)
        for b in batches[2:]:
            accs[2].add_sum(b)
        total = accs[1]._H + accs[2]._H + accs[3]._H

        def all_sum(t, total=total):
            return t.copy_(total)
        got = [a.reduced(all_sum, 40) for a in accs[1:]]
        for h in got:
            torch.testing.assert_close(h, accs[0].H, rtol=1e-5, atol=1e-6)
            assert torch.equal(h, h.t())
        assert torch.equal(got[0], got[2])


def test_toward_fp_is_the_least_squares_fit_of_the_fp_outputs():
    """GPTAQ's target: on quantized inputs X̃ the moved weights reproduce the FP outputs W·X as well as any
    weights can (alpha 1, no dampening: the least-squares solution); alpha 0 leaves W as it is."""
    from quantize.methods.gptq_layer import _FpCross, toward_fp

    w, x, acc = _data()
    g = torch.Generator().manual_seed(7)
    xq = x + 0.2 * torch.randn(x.shape, generator=g)  # what the quantized chain feeds the linear
    qacc, cross = gptq_hessian.HessianAccumulator(x.shape[1]), _FpCross(x)
    for chunk in xq.split(100):  # the batches arrive in order; _FpCross reads the FP rows alongside
        qacc.add(chunk)
        cross.add(chunk)
    C = cross.mean(xq.shape[0])
    assert torch.allclose(C, 2 * (x - xq).t() @ xq / x.shape[0], rtol=1e-4, atol=1e-3)
    assert torch.equal(toward_fp(w, qacc.H, C, 0.0, 0.01), w)
    fit = toward_fp(w, qacc.H, C, 1.0, 1e-9)
    best = torch.linalg.lstsq(xq, x @ w.t()).solution.t()
    assert torch.allclose(fit, best, rtol=1e-3, atol=1e-3)
    err = lambda m: float(torch.linalg.norm(xq @ m.t() - x @ w.t()))  # noqa: E731
    half = toward_fp(w, qacc.H, C, 0.5, 0.01)
    assert err(fit) < err(half) < err(w)

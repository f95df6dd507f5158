import pytest
import torch
import torch.nn as nn

from quantize.methods import awq_grid, awq_search as awq, gptq_sweep as gptq
from quantize.methods.layer import screen_split
from quantize.methods.primitives import dequantize, fake_quant, quantize

SPEC = awq.QSpec(4, 32, symmetric=False)


def _x(t=300, n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, n, generator=g)
    x[:, :4] *= 20  # outlier channels
    return x


def test_apply_scales_preserves_function():
    torch.manual_seed(0)
    norm = nn.RMSNorm(64)
    norm.weight.data = torch.rand(64) + 0.5
    fc1, fc2 = nn.Linear(64, 16, bias=False), nn.Linear(64, 8, bias=False)
    x = torch.randn(10, 64)
    before = (fc1(norm(x)), fc2(norm(x)))
    awq.apply_scales(norm, [fc1, fc2], torch.rand(64) + 0.1)
    assert torch.allclose(fc1(norm(x)), before[0], atol=1e-5) and torch.allclose(fc2(norm(x)), before[1], atol=1e-5)
    # a linear as prev: its rows (outputs) are divided
    prev, nxt = nn.Linear(32, 64), nn.Linear(64, 8)
    y = nxt(prev(x[:, :32]))
    awq.apply_scales(prev, [nxt], torch.rand(64) + 0.1)
    assert torch.allclose(nxt(prev(x[:, :32])), y, atol=1e-5)


class _OffsetNorm(nn.Module):
    """Gemma's RMSNorm: x̂ · (1 + weight)."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(n) - 0.5)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + self.weight)


def test_apply_scales_into_an_offset_norm_preserves_function():
    torch.manual_seed(0)
    norm, fc = _OffsetNorm(64), nn.Linear(64, 16, bias=False)
    x = torch.randn(10, 64)
    before = fc(norm(x))
    awq.apply_scales(norm, [fc], torch.rand(64) + 0.1, norm_offset=1.0)
    assert torch.allclose(fc(norm(x)), before, atol=1e-5)


def test_linear_losses_gram_and_direct_equal_token_mse():
    x = _x()
    fc = nn.Linear(64, 16, bias=False)
    deltas = torch.stack([fake_quant(fc.weight.data * c, 4, 32, symmetric=False) - fc.weight.data for c in (1.0, 0.5, 2.0)])
    direct = [(x @ d.t()).pow(2).mean().item() for d in deltas]
    via_gram = awq._linear_losses(deltas, x, awq._gram(x, chunk=128))  # chunked: 300 = 128 + 128 + 44 rows
    via_x = awq._linear_losses(deltas, x, None)
    assert torch.allclose(torch.tensor(via_gram), torch.tensor(direct), rtol=1e-4)
    assert torch.allclose(torch.tensor(via_x), torch.tensor(direct), rtol=1e-4)


def test_search_scales_beats_rtn_and_restores_weights():
    x = _x()
    fc = nn.Linear(64, 32, bias=False)
    w0 = fc.weight.data.clone()
    r = awq.search_scales(x, [fc], [True], lambda: [fc(x)], SPEC, n_grid=10)
    assert torch.equal(fc.weight.data, w0)
    assert len(r.losses) == 10 and r.losses[r.ratio] == min(r.losses.values())
    assert r.losses[r.ratio] < 0.9 * r.losses[0.0]  # outliers make scaling pay
    # the single-linear loss (Gram form: 300 tokens >= 64 inputs) gives the same losses as running the linear
    r2 = awq.search_scales(x, [fc], [True], None, SPEC, n_grid=10, grid_batch=3)
    assert torch.allclose(torch.tensor(list(r.losses.values())), torch.tensor(list(r2.losses.values())), rtol=1e-3)
    assert torch.allclose(r.scales, r2.scales) and r.ratio == r2.ratio
    # and so does the direct form (32 tokens < 64 inputs), batched or not
    for batch in (1, 4):
        r3 = awq.search_scales(x, [fc], [True], None, SPEC, n_grid=10, x_loss=x[:32], grid_batch=batch)
        r4 = awq.search_scales(x, [fc], [True], lambda: [fc(x[:32])], SPEC, n_grid=10, x_loss=x[:32])
        assert torch.allclose(torch.tensor(list(r3.losses.values())), torch.tensor(list(r4.losses.values())),
                              rtol=1e-3)


def test_grid_order_coarse_to_fine_visits_each_point_once():
    g = awq.grid_order(20, 4)
    first = next(g)
    assert first == [0, 4, 8, 12, 16]
    assert g.send(8) == [6, 10]
    assert g.send(10) == [9, 11]
    with pytest.raises(StopIteration):
        g.send(10)
    assert next(awq.grid_order(20, 1)) == list(range(20))


def _mlp_problem(seed, n=256, hidden=512, t=1024):
    """A gated MLP with outlier input channels, like the block AWQ inspects for gate/up (8 groups per row:
    with fewer, the search loss over α is too rough to say anything about real layers' thousands)."""
    torch.manual_seed(seed)
    x = _x(t=t, n=n, seed=seed)
    gate, up = nn.Linear(n, hidden, bias=False), nn.Linear(n, hidden, bias=False)
    down = nn.Linear(hidden, n, bias=False)
    return x, [gate, up], lambda xi: down(torch.nn.functional.silu(gate(xi)) * up(xi))


def test_coarse_to_fine_finds_the_exhaustive_minimum():
    """9 of 20 points find the ratio the whole grid finds (or one within 1% of its loss)."""
    for seed in range(4):
        x, linears, mlp = _mlp_problem(seed)
        full = awq.search_scales(x, linears, [True, True], lambda: [mlp(x)], SPEC, n_grid=20)
        fast = awq.search_scales(x, linears, [True, True], lambda: [mlp(x)], SPEC, n_grid=20, coarse_step=4)
        assert len(fast.losses) <= 9
        assert all(fast.losses[a] == pytest.approx(full.losses[a], rel=1e-6) for a in fast.losses)
        assert full.losses[fast.ratio] <= 1.01 * full.losses[full.ratio], (seed, fast.ratio, full.ratio)


def test_pruned_search_picks_what_the_whole_search_picks_with_fewer_block_forwards():
    """A candidate stopped once its running loss passes the best whole loss cannot be the pick: same ratio and
    scales, the same loss for every candidate run to its end, fewer batches run."""
    stopped = 0
    for seed in range(4):
        x, linears, mlp = _mlp_problem(seed)
        xb = x.split(128)  # 8 batches
        runs = {True: 0, False: 0}

        def inspect(prune):
            def run():
                for xi in xb:
                    runs[prune] += 1
                    yield mlp(xi)
            return run

        full = awq.search_scales(x, linears, [True, True], inspect(False), SPEC, n_grid=20, prune=False)
        fast = awq.search_scales(x, linears, [True, True], inspect(True), SPEC, n_grid=20)
        assert fast.ratio == full.ratio and torch.equal(fast.scales, full.scales)
        assert fast.losses == {a: full.losses[a] for a in fast.losses} and full.ratio in fast.losses
        assert len(fast.losses) + fast.pruned == len(full.losses) == 20 and full.pruned == 0
        assert runs[True] < runs[False] == 8 * 21  # the reference, then 20 candidates
        stopped += fast.pruned
    assert stopped > 0


def _counted_inspect(mlp, xb, counter):
    """run_inspect over batches xb from `start` on, counting the block forwards it runs."""
    def run(start=0):
        for xi in xb[start:]:
            counter[0] += 1
            yield mlp(xi)
    return run


@pytest.mark.parametrize("keep", [19, 3])
def test_screened_search_continues_the_least_screening_losses_and_forms_the_exhaustive_sums(keep):
    """Every ratio runs on the screening batches; α = 0 and the `keep` least there run on, each to the loss the
    exhaustive search forms (equal bit for bit); the pick is the least of those; no batch beyond is run."""
    for seed in range(4):
        x, linears, mlp = _mlp_problem(seed)
        xb, screen = list(x.split(128)), 3  # 8 batches, the first 3 screen
        full = awq.search_scales(x, linears, [True, True], _counted_inspect(mlp, xb, [0]), SPEC, n_grid=20,
                                 prune=False)
        sums = []
        for i in range(20):  # each ratio's squared error on the screening batches, as the search forms it
            s = awq._duo_scales(x.abs().mean(0), _w_mean(linears), i / 20, True)
            saved = [fc.weight.data for fc in linears]
            for fc in linears:
                fc.weight.data = awq._scaled_fake_quant(fc.weight.data, s, SPEC)
            sums.append(sum((mlp(xi).float() - mlp_ref).pow(2).sum() for xi, mlp_ref in
                            zip(xb[:screen], _refs(mlp, xb[:screen], linears, saved))).item())
            for fc, w in zip(linears, saved):
                fc.weight.data = w
        kept = {0} | set(sorted(range(1, 20), key=lambda i: (sums[i], i))[:keep])
        runs = [0]
        fast = awq.search_scales(x, linears, [True, True], _counted_inspect(mlp, xb, runs), SPEC, n_grid=20,
                                 prune=False, screen_batches=screen, screen_keep=keep)
        assert {round(a * 20) for a in fast.losses} == kept and fast.screened == 20 - len(kept)
        assert fast.losses == {a: full.losses[a] for a in fast.losses}
        assert fast.ratio == min(fast.losses, key=lambda a: (fast.losses[a], a))
        assert torch.equal(fast.scales, awq._duo_scales(x.abs().mean(0), _w_mean(linears), fast.ratio, True))
        assert runs[0] == 8 + 20 * screen + len(kept) * (8 - screen)  # the reference, screening, the rest
        if keep == 19:
            assert fast.ratio == full.ratio and fast.screened == 0


def _w_mean(linears):
    w = torch.cat([fc.weight.detach() for fc in linears])
    wg = w.abs().float().reshape(-1, SPEC.group)
    return (wg / (wg.amax(dim=1, keepdim=True) + 1e-6)).reshape(w.shape).mean(dim=0)


def _refs(mlp, xb, linears, saved):
    """The block's outputs on xb with the weights `saved` (the search's reference)."""
    now = [fc.weight.data for fc in linears]
    for fc, w in zip(linears, saved):
        fc.weight.data = w
    out = [mlp(xi) for xi in xb]
    for fc, w in zip(linears, now):
        fc.weight.data = w
    return out


def test_screened_search_prunes_and_spreads_to_the_same_pick():
    """Stopping candidates whose running loss passes the best whole one, or computing each round's losses in
    shares (as ranks do), changes neither the pick nor any loss run to its end."""
    stopped = 0
    for seed in range(4):
        x, linears, mlp = _mlp_problem(seed)
        xb = list(x.split(128))
        kw = dict(n_grid=20, screen_batches=4, screen_keep=15)  # many kept: some lose on the way
        plain = awq.search_scales(x, linears, [True, True], _counted_inspect(mlp, xb, [0]), SPEC, prune=False, **kw)
        runs = [0]
        pruned = awq.search_scales(x, linears, [True, True], _counted_inspect(mlp, xb, runs), SPEC, **kw)

        def spread(fn, items, chunk):  # two "ranks", each its share, gathered in order
            half = len(items) // 2
            return fn(items[:half]) + fn(items[half:])

        shared = awq.search_scales(x, linears, [True, True], _counted_inspect(mlp, xb, [0]), SPEC, spread=spread,
                                   **kw)
        assert pruned.ratio == plain.ratio == shared.ratio and shared.losses == plain.losses
        assert pruned.losses == {a: plain.losses[a] for a in pruned.losses}
        assert len(pruned.losses) + pruned.pruned == len(plain.losses) == 16 and plain.pruned == 0
        whole = 8 + 20 * 4 + 16 * 4  # the reference, screening, the rest of the 16 kept
        assert runs[0] <= whole - pruned.pruned  # a stopped candidate skips at least its last batch
        stopped += pruned.pruned
    assert stopped > 0


def test_screen_split_halves_the_batches_or_cuts_one_whose_arguments_are_shared():
    """Two or more batches: the first half screen. One batch: cut into halves only when no keyword argument has a
    row per sequence (a per-sequence mask would no longer match its half); one sequence: nothing to cut."""
    xs = [torch.randn(4, 8, 16) for _ in range(3)]
    assert screen_split(xs, [None] * 3)[2] == 1 and screen_split(xs[:2], [None] * 2)[0] == xs[:2]
    shared = {"position_embeddings": (torch.randn(1, 8, 4), torch.randn(1, 8, 4)), "attention_mask": None}
    halves, kw, screen = screen_split(xs[:1], [shared])
    assert screen == 1 and [h.shape[0] for h in halves] == [2, 2] and torch.equal(torch.cat(halves), xs[0])
    assert kw == [shared, shared]
    per_row = {"attention_mask": torch.ones(4, 1, 8, 8), "position_ids": torch.arange(8)[None]}
    assert screen_split(xs[:1], [per_row]) == (xs[:1], [per_row], 0)
    assert screen_split([torch.randn(1, 8, 16)], [None])[2] == 0


def test_token_subset_picks_near_exhaustive_scales():
    """Loss on a quarter of the tokens: the chosen ratio is within two grid steps, its full loss within 2%."""
    for seed in range(4):
        x, linears, mlp = _mlp_problem(seed)
        sub = x[torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(seed))[:256]]
        full = awq.search_scales(x, linears, [True, True], lambda: [mlp(x)], SPEC, n_grid=20)
        fast = awq.search_scales(x, linears, [True, True], lambda: [mlp(sub)], SPEC, n_grid=20, x_loss=sub)
        assert abs(fast.ratio - full.ratio) <= 0.1 + 1e-9, (seed, fast.ratio, full.ratio)
        assert full.losses[fast.ratio] <= 1.02 * full.losses[full.ratio]


def test_search_clip_gram_matches_token_loop():
    x = _x(t=200)
    w = torch.randn(16, 64)
    gram = awq_grid.group_gram(x, 32)
    lo, hi = awq_grid.search_clip(w, gram, SPEC, n_grid=10, max_shrink=0.5)
    # brute force on tokens, per (out, group)
    wg, xg = w.reshape(16, 2, 32), x.reshape(200, 2, 32)
    org = wg.abs().amax(-1)
    for o in range(16):
        for n in range(2):
            errs = []
            for i in range(5):
                m = org[o, n] * (1 - i / 10)
                cur = wg.clone()
                cur[o, n] = wg[o, n].clamp(-m, m)
                q = fake_quant(cur.reshape(16, 64), 4, 32, symmetric=False).reshape(16, 2, 32)
                errs.append(((xg[:, n] @ q[o, n]) - (xg[:, n] @ wg[o, n])).pow(2).mean().item())
            m = org[o, n] * (1 - min(range(5), key=errs.__getitem__) / 10)
            assert torch.isclose(hi[o, n], torch.minimum(m, wg[o, n].max()), rtol=1e-5)
            assert torch.isclose(lo[o, n], torch.maximum(-m, wg[o, n].min()), rtol=1e-5)


def _clip_problem(seed=0):
    """Weights whose groups have one long tail on a random side; inputs with outlier channels."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(32, 128, generator=g) * 0.02
    tails = torch.randint(0, 128, (32,), generator=g)
    w[torch.arange(32), tails] = 0.15 * torch.sign(torch.randn(32, generator=g))
    return _x(t=400, n=128, seed=seed), w


def _out_err(x, w, w_hat):
    return (x @ (w_hat - w).t()).pow(2).mean().item()


def _rtn_on(w, lo, hi, spec, scales=None):
    s, z = awq_grid.clip_grid(w, lo, hi, spec)
    s = s if scales is None else scales
    return dequantize(quantize(w, s, z, spec.w_bit), s, z)


def test_per_side_clip_lowers_output_error_and_never_loses():
    x, w = _clip_problem()
    spec = awq.QSpec(4, 64, symmetric=False)
    gram = awq_grid.group_gram(x, 64)
    sym = _rtn_on(w, *awq_grid.search_clip(w, gram, spec, 20, 0.5), spec)
    per = _rtn_on(w, *awq_grid.search_clip(w, gram, spec, 20, 0.5, per_side=True), spec)
    # per group, never worse than the symmetric search; overall clearly better with one-sided tails
    eg = lambda wh: awq_grid._group_err((wh - w).reshape(32, 2, 64), gram)  # noqa: E731
    assert (eg(per) <= eg(sym) * (1 + 1e-5) + 1e-12).all()
    assert _out_err(x, w, per) < 0.9 * _out_err(x, w, sym)
    # a symmetric grid (no zero point) is set by max|w|: per_side is the same search there
    sspec = awq.QSpec(4, 64, symmetric=True)
    a, b = awq_grid.search_clip(w, gram, sspec, 20, 0.5), awq_grid.search_clip(w, gram, sspec, 20, 0.5, per_side=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_refit_scales_lowers_group_error_and_never_loses():
    x, w = _clip_problem(1)
    spec = awq.QSpec(4, 64, symmetric=False)
    gram = awq_grid.group_gram(x, 64)
    lo, hi = awq_grid.search_clip(w, gram, spec, 20, 0.5)
    s0, z = awq_grid.clip_grid(w, lo, hi, spec)
    s1 = awq_grid.refit_scales(w, gram, s0, z, spec, iters=3)
    before = awq_grid._group_err((_rtn_on(w, lo, hi, spec) - w).reshape(32, 2, 64), gram)
    after = awq_grid._group_err((_rtn_on(w, lo, hi, spec, s1) - w).reshape(32, 2, 64), gram)
    assert (after <= before * (1 + 1e-5)).all()
    assert after.sum() < 0.97 * before.sum()
    assert not torch.equal(s1, s0)
    # zero iterations: the grid's own scales
    assert torch.equal(awq_grid.refit_scales(w, gram, s0, z, spec, iters=0), s0)


def test_search_batches_seeded_subset_of_whole_batches():
    from quantize.methods.layer import rows_of as _rows, search_batches

    sizes = [4096] * 15 + [2048]  # 128 x 512 tokens in batches of 8, last one short
    picked = search_batches(sizes, 16384, seed=0)
    assert picked == sorted(set(picked)) and sum(sizes[i] for i in picked) >= 16384
    assert sum(sizes[i] for i in picked) - max(sizes[i] for i in picked) < 16384  # no batch more than needed
    assert picked == search_batches(sizes, 16384, seed=0) and picked != search_batches(sizes, 16384, seed=1)
    assert search_batches(sizes, None, seed=0) == list(range(16)) == search_batches(sizes, 10**6, seed=0)
    x = torch.arange(sum(sizes)).unsqueeze(1)  # [tokens, 1]: row i holds i
    rows = _rows(x, sizes, [1, 15]).squeeze(1)
    assert torch.equal(rows, torch.cat([torch.arange(4096, 8192), torch.arange(15 * 4096, 15 * 4096 + 2048)]))


def test_single_linear_loss_in_half_precision_picks_the_fp32_ratio():
    """bf16 inputs take the direct X ΔWᵀ form; it chooses the same ratio as the fp32 Gram form."""
    x = _x(t=1024, n=256)
    fc = nn.Linear(256, 64, bias=False)
    ref = awq.search_scales(x, [fc], [True], None, SPEC, n_grid=20)
    fc_bf = nn.Linear(256, 64, bias=False, dtype=torch.bfloat16)
    fc_bf.weight.data = fc.weight.data.to(torch.bfloat16)
    bf = awq.search_scales(x.to(torch.bfloat16), [fc_bf], [True], None, SPEC, n_grid=20, grid_batch=4)
    assert abs(bf.ratio - ref.ratio) <= 0.05 + 1e-9 and ref.losses[bf.ratio] <= 1.01 * ref.losses[ref.ratio]


def test_gptq_rounding_on_the_awq_grid_beats_rtn_on_it():
    """AWQ's clip grid with GPTQ's rounding: same scales and zeros (the format is unchanged), lower output error."""
    x, w = _clip_problem(2)
    spec = awq.QSpec(4, 64, symmetric=False)
    lo, hi = awq_grid.search_clip(w, awq_grid.group_gram(x, 64), spec, 20, 0.5, per_side=True)
    s, z = awq_grid.clip_grid(w, lo, hi, spec)
    H = 2 * x.t() @ x / x.shape[0]
    gspec = gptq.GptqSpec(4, 64, symmetric=False, act_order=True, scale_dtype=torch.float16)
    r = gptq.gptq_quantize(w, H, gspec, grid=(s, z))
    assert torch.equal(r.scales, s.half().float()) and torch.equal(r.zeros, z)
    rtn = dequantize(quantize(w, s.half().float(), z, 4), s.half().float(), z)
    assert _out_err(x, w, dequantize(r.codes, r.scales, r.zeros)) < 0.8 * _out_err(x, w, rtn)
    with pytest.raises(ValueError, match="act_order"):
        gptq.gptq_quantize(w, H, gptq.GptqSpec(4, 64, symmetric=False, act_order=False), grid=(s, z))

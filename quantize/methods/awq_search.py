"""Activation-aware Weight Quantization (Lin et al. 2023): the scale search, separated from apply.

Pure maths on tensors and nn.Linear weights: no transformers import, no model-type branches. The caller
says which linears share an input, what feeds them (`prev`) and how to run the inspected module.

Scale search, for one group of linears sharing input X [tokens, in] and an inspected block f:
    s(α) = mean|X|^α / mean|Ŵ|^(1-α)      (duo scaling; Ŵ = |W| normalised per quantization group)
    s ← s / sqrt(max(s) · min(s))
    α* = argmin_α  ‖ f(X; W) − f(X; Q(W · diag(s)) · diag(s)^-1) ‖²   over α ∈ {0, 1/n, …, (n-1)/n}
α = 0 gives s ≈ 1, i.e. round-to-nearest, so the chosen scales never lose to RTN on the search loss.
Applied: W ← W · diag(s), prev ← prev / s (norm weight, or the rows of a preceding linear).
For a group whose inspected block is the linear itself, the loss is ‖X ΔWᵀ‖² = tr(ΔW XᵀX ΔWᵀ): no forward
pass per grid point. The clip search and the grid it gives, which run once the scales are folded: `awq_grid.py`.

Cheaper searches (recipe options, see docs/BENCHMARKS.md for what each costs in quality):
- the loss may be measured on a subset of the calibration tokens (`x_loss`; the caller picks it), while
  the statistic mean|X| always uses every token;
- screening (`screen_batches`, `screen_keep`), for an inspected block: every ratio runs on the leading batches
  only, and just the `screen_keep` best there (and α = 0) go on over the rest; each whole loss is the sum the
  exhaustive search forms, so the pick is the exhaustive one whenever it is among those kept;
- coarse-to-fine over α (`coarse_step`): a coarse grid, then halving steps around its best point;
- single-linear groups evaluate several candidates in one matmul (`grid_batch`), exact.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from .primitives import fake_quant_, qparams


@dataclass(frozen=True)
class QSpec:
    w_bit: int
    group: int
    symmetric: bool = field(kw_only=True)  # by name only: a bare True must never be read as "has zero points"


def _duo_scales(x_mean: torch.Tensor, w_mean: torch.Tensor, ratio: float, duo_scaling: bool) -> torch.Tensor:
    """x_mean, w_mean: [in] -> s(α) [in], normalised so that max(s) · min(s) = 1."""
    if duo_scaling:
        s = (x_mean.pow(ratio) / (w_mean.pow(1 - ratio) + 1e-4)).clamp(min=1e-4)
    else:
        s = x_mean.pow(ratio).clamp(min=1e-4)
    return s / (s.max() * s.min()).sqrt()  # [in]


def _scaled_fake_quant(w: torch.Tensor, s: torch.Tensor, spec: QSpec) -> torch.Tensor:
    """w: [out, in], s: [in] -> Q(w · diag(s)) · diag(s)^-1 [out, in] in w's dtype."""
    buf = w.float() * s.view(1, -1)  # [out, in] W·s, then in place: its fake-quant, then that / s
    scales, zeros = qparams(buf, spec.w_bit, spec.group, symmetric=spec.symmetric)  # [out, in // g]
    fake_quant_(buf.view(w.shape[0], -1, spec.group), scales, zeros.float(), spec.w_bit)
    return buf.div_(s.view(1, -1)).to(w.dtype)


def _scaled_delta(w: torch.Tensor, s: torch.Tensor, spec: QSpec, out: torch.Tensor) -> torch.Tensor:
    """-> out [out, in] (float32) = _scaled_fake_quant(w, s, spec) - w, formed in float32."""
    return torch.sub(_scaled_fake_quant(w, s, spec).float(), w.float(), out=out)


@dataclass(frozen=True)
class FakeQuant:
    """How the scale search fake-quantizes a candidate: torch's functions, or a kernel that gives their values
    (`kernels.awq_fake_quant`)."""

    name: str
    candidate: Callable[[torch.Tensor, torch.Tensor, QSpec], torch.Tensor]  # (w, s, spec) -> Q(w·s)/s, w's dtype
    delta: Callable[[torch.Tensor, torch.Tensor, QSpec, torch.Tensor], torch.Tensor]  # (w, s, spec, out) -> out


TORCH_FQ = FakeQuant("torch", _scaled_fake_quant, _scaled_delta)


def grid_order(n_grid: int, coarse_step: int) -> Iterator[list[int]]:
    """Rounds of grid indices i (ratio α = i / n_grid) to evaluate; the caller sends back the best so far.

    coarse_step <= 1: one round, the whole grid 0 .. n_grid-1 (AutoAWQ's search).
    coarse_step = k > 1: every k-th index first, then around the best index b: b ± k/2, b ± k/4, ..., b ± 1
    (halving, integer steps), skipping indices already evaluated. n_grid=20, k=4 evaluates 9 of 20 points
    and finds the grid minimum whenever the loss is unimodal in α.
    """
    if coarse_step <= 1:
        yield list(range(n_grid))
        return
    seen = set(range(0, n_grid, coarse_step))
    best = yield sorted(seen)
    h = coarse_step // 2
    while h >= 1:
        nxt = [i for i in (best - h, best + h) if 0 <= i < n_grid and i not in seen]
        seen.update(nxt)
        if nxt:
            best = yield nxt
        h //= 2


@dataclass
class ScaleSearch:
    """Result of one scale search: scales [in] (fp32), the chosen ratio, and the loss per evaluated ratio."""

    scales: torch.Tensor
    ratio: float
    losses: dict[float, float]  # α -> loss, in evaluation order; α = 0 (round-to-nearest) is always present
    pruned: int = 0  # candidates stopped before their last batch: their loss had passed the best whole one
    screened: int = 0  # candidates a screened search did not continue past its screening batches


def _linear_losses(deltas: torch.Tensor, x: torch.Tensor, gram: torch.Tensor | None) -> list[float]:
    """deltas: [k, out, in] candidates Ŵ - W -> per candidate, mean over tokens and outputs of (x · Δw)².

    gram = XᵀX [in, in] (fp32) when given, else the loss comes from x [tokens, in] directly, in x's dtype
    (cheaper when tokens < in). All k candidates share one matmul.
    """
    k, out_f, in_f = deltas.shape
    d = deltas.reshape(k * out_f, in_f)  # [k * out, in]
    if gram is not None:
        df = d.float()
        per = ((df @ gram) * df).reshape(k, -1).sum(dim=1)  # [k]
    else:
        per = (x @ d.to(x.dtype).t()).float().pow(2).reshape(x.shape[0], k, out_f).sum(dim=(0, 2))  # [k]
    return (per / (x.shape[0] * out_f)).tolist()


def search_scales(
    x: torch.Tensor,
    linears: Sequence[nn.Linear],
    quantized: Sequence[bool],
    run_inspect: Callable[[], list[torch.Tensor]] | None,
    spec: QSpec,
    n_grid: int = 20,
    duo_scaling: bool = True,
    coarse_step: int = 1,
    x_loss: torch.Tensor | None = None,
    grid_batch: int = 1,
    spread: Callable[[Callable[[list], list[float]], list, int], list[float]] | None = None,
    reference: list[torch.Tensor] | None = None,
    gram: torch.Tensor | None = None,
    prune: bool = True,
    fq: FakeQuant = TORCH_FQ,
    screen_batches: int = 0,
    screen_keep: int = 0,
) -> ScaleSearch:
    """x: [tokens, in] shared input of `linears` -> best scales [in] (fp32), ratio and losses.

    The statistics mean|X| use every row of x. The loss is measured on `x_loss` [tokens', in] (default x),
    the rows `run_inspect` must run on when given. `run_inspect()` runs the inspected module with the
    linears' *current* weights and returns its outputs (a list of per-batch tensors); its reference output
    is computed once. None means the inspected block is the single linear itself: the loss then comes from
    Δw XᵀX Δwᵀ (fp32) when x is fp32 and tokens' >= in, else from X Δwᵀ directly in x's dtype (half precision
    runs ~15x faster than fp32 on a GPU), `grid_batch` candidates per matmul.
    `coarse_step` (see grid_order) > 1 evaluates a coarse grid and refines around its best point.
    spread(losses_of, candidates, chunk) -> losses of every candidate, in order: how a round's candidates are
    evaluated (default: all here). Several processes may each take a share of whole chunks of `chunk`
    candidates (the batches one matmul evaluates), so every loss is computed as it would be here.
    reference: run_inspect()'s output with the weights as they are, gram: `loss_gram(x_loss)`, when the caller
    has them (several searches on the same inputs and weights need them once).
    prune: with an inspected block, stop a candidate's batches once its running loss passes the best whole loss
    so far (`_block_loss`): the same pick, fewer block forwards; its loss is then not in `losses`. run_inspect may
    return a generator, so that a stopped candidate's remaining batches are never run.
    fq: how each candidate is fake-quantized (the same values either way).
    screen_batches, screen_keep (> 0, with an inspected block, coarse_step <= 1 and more batches than
    screen_batches): every ratio's squared error on the first screen_batches batches, then α = 0 and the
    screen_keep ratios with the least of it (ties: the lower ratio) continued over the rest, from the same running
    sum; `run_inspect(start=b)` must then run the batches from b on. The others count in `screened`.
    Weights are restored before returning.
    """
    if screen_keep and coarse_step > 1:
        raise ValueError("a screened search evaluates the whole grid: coarse_step must be 1")
    x_loss = x if x_loss is None else x_loss
    x_mean = x.abs().mean(dim=0, dtype=torch.float32)  # [in]
    w = torch.cat([fc.weight.detach() for fc in linears], dim=0)  # [sum_out, in]
    wg = w.abs().float().reshape(-1, spec.group)  # [sum_out * in / g, g]
    w_mean = (wg / (wg.amax(dim=1, keepdim=True) + 1e-6)).reshape(w.shape).mean(dim=0)  # [in]
    del w, wg
    originals = [fc.weight.detach().clone() for fc in linears]
    if run_inspect is None:
        assert len(linears) == 1, "the single-linear loss needs a single linear"
        gram = loss_gram(x_loss) if gram is None else gram  # [in, in] or None

        def losses_of(cands: list[torch.Tensor]) -> list[float]:
            out, w0 = [], originals[0]
            for start in range(0, len(cands), grid_batch):
                chunk = cands[start : start + grid_batch]
                deltas = torch.empty(len(chunk), *w0.shape, dtype=torch.float32, device=w0.device)  # [k, out, in]
                for j, s in enumerate(chunk):
                    fq.delta(w0, s, spec, deltas[j])
                out += _linear_losses(deltas, x_loss, gram)
            return out
    else:
        reference = list(run_inspect()) if reference is None else reference
        n_out = sum(r.numel() for r in reference)

        def set_candidate(s: torch.Tensor) -> None:
            for fc, orig, q in zip(linears, originals, quantized):
                if q:
                    fc.weight.data = fq.candidate(orig, s, spec)

        def losses_of(cands: list[torch.Tensor]) -> list[float | None]:
            out: list[float | None] = []
            bound = best_loss if prune else float("inf")
            for s in cands:
                set_candidate(s)
                out.append(_block_loss(run_inspect(), reference, n_out, bound))
                if prune and out[-1] is not None and out[-1] < bound:
                    bound = out[-1]
            return out

    evaluate = spread or (lambda fn, cands, chunk: fn(cands))
    prune = prune and spread is None  # ranks evaluating shares of a round would each know only their own best
    if run_inspect is not None and screen_keep > 0 and 0 < screen_batches < len(reference):
        return _screened(x_mean, w_mean, n_grid, duo_scaling, set_candidate, run_inspect, reference, screen_batches,
                         screen_keep, evaluate, prune, linears, originals)
    chunk = grid_batch if run_inspect is None else 1
    losses: dict[float, float] = {}
    best_i, best_loss, pruned = None, float("inf"), 0
    rounds = grid_order(n_grid, coarse_step)
    try:
        idx = next(rounds)
        while True:
            cands = [_duo_scales(x_mean, w_mean, i / n_grid, duo_scaling) for i in idx]
            for i, loss in zip(idx, evaluate(losses_of, cands, chunk)):
                if loss is None:  # stopped once its partial loss passed a candidate's whole one
                    pruned += 1
                    continue
                losses[i / n_grid] = loss
                if loss < best_loss:
                    best_i, best_loss = i, loss
            idx = rounds.send(0 if best_i is None else best_i)
    except StopIteration:
        pass
    finally:
        for fc, orig in zip(linears, originals):
            fc.weight.data = orig
    if best_i is None:  # every loss was NaN/inf
        raise FloatingPointError("AWQ scale search produced no finite loss (NaN/inf in activations or weights)")
    return ScaleSearch(_duo_scales(x_mean, w_mean, best_i / n_grid, duo_scaling), best_i / n_grid, losses, pruned)


def _screened(x_mean: torch.Tensor, w_mean: torch.Tensor, n_grid: int, duo_scaling: bool,
              set_candidate: Callable[[torch.Tensor], None], run_inspect: Callable[..., Iterable[torch.Tensor]],
              reference: list[torch.Tensor], screen: int, keep: int,
              evaluate: Callable[[Callable[[list], list], list, int], list], prune: bool,
              linears: Sequence[nn.Linear], originals: list[torch.Tensor]) -> ScaleSearch:
    """`search_scales`'s screened form: every ratio's squared-error sum over the first `screen` batches of
    `reference`, then α = 0 and the `keep` ratios least there continued over the rest (α = 0 first, the others
    in screening order, each stopped once its running loss passes the best whole one when `prune`)."""
    n_out = sum(r.numel() for r in reference)
    device = reference[0].device

    def screen_sums(cands: list[torch.Tensor]) -> list[float]:
        out = []
        for s in cands:
            set_candidate(s)
            out.append(_error_sum(run_inspect(), reference[:screen], n_out, float("inf")))
        return out

    best_loss = float("inf")

    def whole_losses(items: list[tuple[torch.Tensor, float]]) -> list[float | None]:
        nonlocal best_loss
        out: list[float | None] = []
        for s, partial in items:
            if prune and partial / n_out > best_loss:  # its screening batches alone already lose
                out.append(None)
                continue
            set_candidate(s)
            start = torch.tensor(partial, dtype=torch.float32, device=device)  # the screen's sum, bit for bit
            total = _error_sum(run_inspect(start=screen), reference[screen:], n_out,
                               best_loss if prune else float("inf"), start)
            out.append(None if total is None else total / n_out)
            if prune and out[-1] is not None and out[-1] < best_loss:
                best_loss = out[-1]
        return out

    try:
        cands = [_duo_scales(x_mean, w_mean, i / n_grid, duo_scaling) for i in range(n_grid)]
        sums = evaluate(screen_sums, cands, 1)
        rank = sorted(range(1, n_grid), key=lambda i: (sums[i] if math.isfinite(sums[i]) else math.inf, i))
        kept = [0] + rank[:keep]  # α = 0 first: never stopped, so round-to-nearest's loss is always recorded
        whole = evaluate(whole_losses, [(cands[i], sums[i]) for i in kept], 1)
    finally:
        for fc, orig in zip(linears, originals):
            fc.weight.data = orig
    losses = {i / n_grid: loss for i, loss in zip(kept, whole) if loss is not None}
    finite = [(loss, i) for i, loss in zip(kept, whole) if loss is not None and math.isfinite(loss)]
    if not finite:
        raise FloatingPointError("AWQ scale search produced no finite loss (NaN/inf in activations or weights)")
    best_i = min(finite)[1]  # the least loss; between equal ones the lower ratio, as the exhaustive search picks
    return ScaleSearch(cands[best_i], best_i / n_grid, losses, pruned=sum(loss is None for loss in whole),
                       screened=n_grid - len(kept))


def _error_sum(outputs: Iterable[torch.Tensor], reference: list[torch.Tensor], n_out: int, bound: float,
               start: torch.Tensor | None = None) -> float | None:
    """Squared difference of a candidate's per-batch block outputs from the reference, summed batch by batch in
    order and added to `start` (a sum over earlier batches) when given -> the sum, or None as soon as sum / n_out
    passes `bound` (the best whole loss so far) before the last batch: the batches' squared errors are >= 0 and
    float addition of non-negative terms never decreases, so such a candidate's whole loss is above `bound` too
    and it cannot be the search's pick; stopping skips its remaining block forwards, the pick is the same."""
    err, last = start, len(reference) - 1
    for b, (r, o) in enumerate(zip(reference, outputs)):  # reference first: zip never asks for a batch more
        e = (o.float() - r.float()).pow(2).sum()
        err = e if err is None else err + e
        if b < last and bound != float("inf") and err.item() / n_out > bound:  # after the last: nothing to skip
            return None
    return err.item()


def _block_loss(outputs: Iterable[torch.Tensor], reference: list[torch.Tensor], n_out: int,
                bound: float) -> float | None:
    """Mean squared difference of a candidate's block outputs from the reference -> the loss, or None once its
    running sum passes `bound` (`_error_sum`)."""
    total = _error_sum(outputs, reference, n_out, bound)
    return None if total is None else total / n_out


def loss_gram(x_loss: torch.Tensor) -> torch.Tensor | None:
    """x_loss: [tokens, in] -> XᵀX [in, in] (fp32) for a single linear's search loss, or None where the direct
    product X Δwᵀ is used (`input_gram`)."""
    return input_gram(x_loss)


def input_gram(x: torch.Tensor) -> torch.Tensor | None:
    """x: [tokens, in] -> XᵀX [in, in] (fp32), or None where a squared error over x's rows is better taken from
    the products with x themselves: the Gram form pays only where those would also run in fp32 (the CPU)."""
    if x.dtype == torch.float32 and x.shape[0] >= x.shape[1]:
        return _gram(x)
    return None


def apply_scales(prev: nn.Module, linears: Sequence[nn.Linear], s: torch.Tensor, norm_offset: float = 0.0) -> None:
    """Fold s [in] into the model: prev's output / s (norm weight or linear rows), each linear's input columns · s.

    A norm computes x̂ · (norm_offset + weight) (+ bias): its weight becomes (norm_offset + weight) / s - norm_offset,
    computed in fp32 (float64 for a float64 model). A linear prev with more output rows than s (a fused projection: [gate; up] feeding down)
    has its last len(s) rows divided, the slice the linears read.
    """
    s = s.to(prev.weight.device)
    with torch.no_grad():
        if isinstance(prev, nn.Linear):
            prev.weight[-s.numel():].div_(s.view(-1, 1).to(prev.weight.dtype))  # [len(s), in_prev] rows
        else:  # a norm: y = norm(x) * (offset + weight) (+ bias)
            wide = torch.promote_types(prev.weight.dtype, torch.float32)  # fp32, or a float64 model's own
            w = (prev.weight.to(wide) + norm_offset) / s.to(wide) - norm_offset
            prev.weight.copy_(w.to(prev.weight.dtype))
        if getattr(prev, "bias", None) is not None:
            prev.bias[-s.numel():].div_(s.to(prev.bias.dtype))
        for fc in linears:
            fc.weight.mul_(s.view(1, -1).to(fc.weight.dtype))


def _gram(x: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
    """x: [tokens, in] -> XᵀX [in, in] (fp32), accumulated over token chunks (no fp32 copy of all of x)."""
    gram = torch.zeros(x.shape[1], x.shape[1], device=x.device, dtype=torch.float32)
    for start in range(0, x.shape[0], chunk):
        xf = x[start : start + chunk].float()  # [c, in]
        gram.addmm_(xf.t(), xf)
    return gram

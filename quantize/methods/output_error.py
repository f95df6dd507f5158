"""Each quantized linear's relative output error on its calibration inputs: where a model's error comes from.

    e = ||X (W - Q)ᵀ||_F / ||X Wᵀ||_F        X [tokens, in]: the linear's calibration inputs

the quantity AWQ and GPTQ minimise, measured on data the method already holds, once per linear as it runs:
GPTQ has H = 2 XᵀX / n, so e² = tr(ΔW H ΔWᵀ) / tr(W H Wᵀ) (no pass over X); AWQ has its (scaled) inputs and
measures on the token subset its scale search scores (`awq.search_tokens`), in the scaled space where W and Q live
(folding the scales into the previous op leaves X Wᵀ unchanged). Values stay on the device until the layer is
done (one read-back per layer).
"""

from __future__ import annotations

import torch


def from_hessian(w: torch.Tensor, q: torch.Tensor, H: torch.Tensor, den: torch.Tensor | None = None) -> torch.Tensor:
    """w, q: [out, in], H: [in, in] (2 XᵀX / n) -> e (0-dim float32 tensor, on w's device). den: this w's
    `norm_from_hessian` where already computed.

    On CUDA the two products [out, in] @ [in, in] run in bfloat16 on tensor cores, the sums in float32, a small
    share of a layer's time (docs/BENCHMARKS.md, "Where a 7B GPTQ layer's time goes"); bfloat16's rounding is far
    below the differences it shows between linears. Elsewhere the products run in float32."""
    dt = _product_dtype(w)
    d = w.float() - q.float()  # [out, in]
    num = ((d.to(dt) @ H.to(dt)).float() * d).sum()
    return _ratio(num, norm_from_hessian(w, H) if den is None else den)


def norm_from_hessian(w: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
    """e's denominator tr(W H Wᵀ), as `from_hessian` computes it (0-dim float32): a value of w and H alone."""
    dt, w32 = _product_dtype(w), w.float()
    return ((w32.to(dt) @ H.to(dt)).float() * w32).sum()


def from_inputs(w: torch.Tensor, q: torch.Tensor, x: torch.Tensor, den: torch.Tensor | None = None) -> torch.Tensor:
    """w, q: [out, in], x: [tokens, in] -> e (0-dim float32 tensor). The products run in x's dtype (half
    precision on a GPU: tensor cores), the norms in float32. den: this w's `norm_from_inputs` where already
    computed (a comparison's variants that share W and X compute it once)."""
    err = x @ (w.float() - q.float()).to(x.dtype).t()  # [tokens, out]
    return _ratio(err.float().square().sum(), norm_from_inputs(w, x) if den is None else den)


def norm_from_inputs(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """e's denominator ||X Wᵀ||², as `from_inputs` computes it (0-dim float32): a value of w and x alone."""
    return (x @ w.to(x.dtype).t()).float().square().sum()  # [tokens, out] -> ()


def _product_dtype(w: torch.Tensor) -> torch.dtype:
    return torch.bfloat16 if w.is_cuda else torch.float32


def _ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    return (num / den.clamp(min=torch.finfo(torch.float32).tiny)).clamp(min=0).sqrt()


def worst(errors: dict, n: int = 10) -> list[dict]:
    """The manifest's {layer: {linear: e}} -> the n largest, as [{layer, linear, error}], largest first."""
    flat = [{"layer": int(i), "linear": name, "error": e} for i, per in errors.items() for name, e in per.items()]
    return sorted(flat, key=lambda r: -r["error"])[:n]


def by_depth(errors: dict) -> dict[str, list[tuple[int, float]]]:
    """{layer: {linear: e}} -> {linear: [(layer, e)] in layer order}: one curve per linear over depth."""
    out: dict[str, list[tuple[int, float]]] = {}
    for i in sorted(errors, key=int):
        for name, e in errors[i].items():
            out.setdefault(name, []).append((int(i), e))
    return out

"""Turn quantization results into the tensors and config block of the recipe's on-disk format."""

from __future__ import annotations

import torch

from .formats import awq_gemm, compressed_tensors, gptq


def pack_all(results: dict, recipe, skipped: list[str], dtype: torch.dtype) -> tuple[dict[str, dict], dict]:
    """results: module -> QuantResult -> ({module: {suffix: tensor}}, quantization_config).

    skipped: full names of quantizable linears left in 16-bit by the plan (they must be named where the
    format needs it: AWQ's modules_to_not_convert, compressed-tensors' ignore).
    """
    fmt, bits, g = recipe.out_format, recipe.w_bit, recipe.q_group_size
    sym = not recipe.zero_point
    if fmt == "awq":
        packed = {m: awq_gemm.pack(r.codes, r.scales.to(dtype), r.zeros) for m, r in results.items()}
        extra = [s for s in skipped if not any(x in s for x in recipe.modules_to_not_convert)]
        return packed, awq_gemm.quantization_config(bits, g, recipe.zero_point,
                                                    list(recipe.modules_to_not_convert) + extra)
    if fmt == "gptq":
        packed = {m: gptq.pack(r.codes, r.scales.to(dtype), r.zeros, bits) for m, r in results.items()}
        o = recipe.gptq
        act = recipe.method == "gptq" and o.act_order
        return packed, gptq.quantization_config(bits, g, sym, act, o.true_sequential, o.damp_percent)
    if fmt == "compressed-tensors":
        packed = {m: compressed_tensors.pack(r.codes, r.scales.to(dtype), r.zeros, bits, sym)
                  for m, r in results.items()}
        act = recipe.method == "gptq" and recipe.gptq.act_order
        ignore = ["lm_head", *skipped]
        return packed, compressed_tensors.quantization_config(bits, g, sym, act, ignore)
    raise ValueError(f"unknown format {fmt!r}")

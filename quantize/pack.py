"""Turn quantization results into the tensors and config block of the recipe's on-disk format."""

from __future__ import annotations

import torch

from .formats import awq_gemm, compressed_tensors, gptq


def _on(device: torch.device, fn):
    """Run a pack function with its inputs on `device` (integer bit-twiddling is ~10x faster on a GPU than
    on a few CPU cores for a 7B model) and bring the packed tensors back to the CPU; results are identical."""
    def run(codes, scales, zeros, *args):
        out = fn(codes.to(device), scales.to(device), zeros.to(device), *args)
        return {k: v.cpu() for k, v in out.items()}
    return run


def pack_all(results: dict, recipe, skipped: list[str], dtype: torch.dtype,
             device: torch.device | str = "cpu") -> tuple[dict[str, dict], dict]:
    """results: module -> QuantResult -> ({module: {suffix: tensor}} on the CPU, quantization_config).

    skipped: full names of every quantizable linear the plan leaves in 16-bit, for modules_to_not_convert or an
    indivisible shape (the format must name each one where it needs to: AWQ's modules_to_not_convert,
    compressed-tensors' ignore, or vLLM expects packed tensors for it). device: where to pack.
    """
    fmt, bits, g = recipe.out_format, recipe.w_bit, recipe.q_group_size
    sym = not recipe.zero_point
    device = torch.device(device)
    if fmt == "awq":
        pack = _on(device, awq_gemm.pack)
        packed = {m: pack(r.codes, r.scales.to(dtype), r.zeros) for m, r in results.items()}
        extra = [s for s in skipped if not any(x in s for x in recipe.modules_to_not_convert)]
        return packed, awq_gemm.quantization_config(bits, g, recipe.zero_point,
                                                    list(recipe.modules_to_not_convert) + extra)
    if fmt == "gptq":
        pack = _on(device, gptq.pack)
        packed = {m: pack(r.codes, r.scales.to(dtype), r.zeros, bits) for m, r in results.items()}
        o = recipe.gptq
        act = recipe.method == "gptq" and o.act_order
        return packed, gptq.quantization_config(bits, g, sym, act, o.true_sequential, o.damp_percent)
    if fmt == "compressed-tensors":
        pack = _on(device, compressed_tensors.pack)
        packed = {m: pack(r.codes, r.scales.to(dtype), r.zeros, bits, sym) for m, r in results.items()}
        act = recipe.method == "gptq" and recipe.gptq.act_order
        ignore = ["lm_head", *skipped]
        return packed, compressed_tensors.quantization_config(bits, g, sym, act, ignore)
    raise ValueError(f"unknown format {fmt!r}")

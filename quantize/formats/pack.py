"""Turn quantization results into the tensors and config block of the recipe's on-disk format."""

from __future__ import annotations

import torch

from .. import formats


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
    fmt = formats.get(recipe.out_format)
    pack = _on(torch.device(device), fmt.pack)
    packed = {m: pack(r.codes, r.scales.to(dtype), r.zeros, recipe.w_bit, recipe.symmetric)
              for m, r in results.items()}
    return packed, fmt.quantization_config(recipe, skipped)

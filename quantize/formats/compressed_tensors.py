"""compressed-tensors `pack-quantized` W4A16 / W8A16 (`quant_method: compressed-tensors`), as vLLM reads it.

- weight_packed int32 [out, in * b / 32]: signed code + 2^(b-1) packed along `in` (low bits first)
- weight_scale [out, n_group]; weight_shape [2]
- actorder "group" adds weight_g_idx int32 [in]: input column i belongs to group weight_g_idx[i]
- asymmetric adds weight_zero_point int32 [ceil(out * b / 32), n_group]: signed zero + 2^(b-1), packed along `out`
Our codes are unsigned in [0, 2^b) with zero z, so signed code = code - 2^(b-1) and signed zero = z - 2^(b-1):
the stored values are our codes and zeros unchanged, packed low bits first by `packing.pack_int32` (the
`compressed_tensors` package's own packer gives the same bits: tests/unit/test_formats_gptq_ct.py). The config
block is built with that package's schema classes.
"""

from __future__ import annotations

import torch

from ..methods.primitives import symmetric_zero
from .checks import check_g_idx, contiguous, expect, groups_divide, integer, need
from .packing import pack_int32, unpack_int32


def pack(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, symmetric: bool) -> dict:
    """codes [out, in] uint8, scales/zeros [out, n_group] -> compressed-tensors tensors of one linear."""
    out = {
        "weight_packed": pack_int32(codes, bits),  # [out, in*b/32]
        "weight_scale": scales.contiguous(),  # [out, n_group]
        "weight_shape": torch.tensor(list(codes.shape), dtype=torch.int64),
    }
    if not symmetric:
        out["weight_zero_point"] = pack_int32(zeros.t(), bits).t().contiguous()  # [out*b/32, n_group]
    return out


def unpack(tensors: dict[str, torch.Tensor], bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> codes [out, in] uint8, scales [out, n_group], zeros [out, n_group] int32 (2^(b-1) when symmetric)."""
    packed, scales, shape = need(tensors, "weight_packed"), need(tensors, "weight_scale"), need(tensors, "weight_shape")
    integer(tensors, "weight_packed")
    expect(tensors, "weight_shape", (2,), "the layout's [out, in]")
    out_f, in_f = shape.tolist()
    expect(tensors, "weight_packed", (out_f, -(-in_f * bits // 32)), f"weight_shape [{out_f}, {in_f}] at {bits} bits")
    n_group = scales.shape[-1]
    expect(tensors, "weight_scale", (out_f, n_group), f"weight_shape [{out_f}, {in_f}]")
    codes = unpack_int32(packed, bits, cols=in_f).to(torch.uint8)  # [out, in]
    if "weight_zero_point" in tensors:
        integer(tensors, "weight_zero_point")
        expect(tensors, "weight_zero_point", (-(-out_f * bits // 32), n_group),
               f"weight_shape [{out_f}, {in_f}] and weight_scale {list(scales.shape)}")
        zeros = unpack_int32(tensors["weight_zero_point"].t(), bits, cols=out_f).t().to(torch.int32)  # [out, n_group]
    else:
        zeros = torch.full(scales.shape, symmetric_zero(bits), dtype=torch.int32, device=scales.device)
    return codes, scales, zeros


def group_index(tensors: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """weight_g_idx [in] where the groups are not runs of group_size columns (actorder: group), else None."""
    out_f, in_f = tensors["weight_shape"].tolist()
    n_group = tensors["weight_scale"].shape[-1]
    g_idx = check_g_idx(tensors, "weight_g_idx", in_f, n_group, f"weight_shape [{out_f}, {in_f}]")
    if contiguous(g_idx, in_f, n_group):
        groups_divide("weight_scale", in_f, n_group)
        return None
    return g_idx


def quantization_config(bits: int, group: int, symmetric: bool, act_order: bool, ignore: list[str],
                        targets: dict[int, list[str]] | None = None) -> dict:
    """config.json `quantization_config`, built with compressed_tensors' own schema classes. targets: group size
    -> the checkpoint names of the linears quantized at it (several sizes: one config group each), else one group
    for every Linear at `group`."""
    # imported here: compressed_tensors takes seconds to import (it pulls in transformers' loaders), and runs
    # writing the AWQ or GPTQ format never need it
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    def weights(g: int) -> QuantizationArgs:
        return QuantizationArgs(
            num_bits=bits, type="int", symmetric=symmetric, dynamic=False,
            strategy="channel" if g == -1 else "group", group_size=None if g == -1 else g,
            actorder="static" if act_order else None, observer="minmax",
        )

    sizes = targets or {group: ["Linear"]}
    cfg = QuantizationConfig(
        config_groups={f"group_{i}": QuantizationScheme(targets=list(names), weights=weights(g))
                       for i, (g, names) in enumerate(sorted(sizes.items(), reverse=True))},
        quant_method="compressed-tensors", format="pack-quantized", quantization_status="compressed",
        ignore=list(ignore),
    )
    return cfg.model_dump(exclude_none=False, mode="json")

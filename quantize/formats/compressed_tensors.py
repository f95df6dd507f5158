"""compressed-tensors `pack-quantized` W4A16 / W8A16 (`quant_method: compressed-tensors`), as vLLM reads it.

- weight_packed int32 [out, in * b / 32]: signed code + 2^(b-1) packed along `in` (low bits first)
- weight_scale [out, n_group]; weight_shape [2]
- asymmetric adds weight_zero_point int32 [ceil(out * b / 32), n_group]: signed zero + 2^(b-1), packed along `out`
Our codes are unsigned in [0, 2^b) with zero z, so signed code = code - 2^(b-1) and signed zero = z - 2^(b-1):
the stored values are our codes and zeros unchanged, packed low bits first by `packing.pack_int32` (the
`compressed_tensors` package's own packer gives the same bits: tests/unit/test_formats_gptq_ct.py). The config
block is built with that package's schema classes.
"""

from __future__ import annotations

import torch

from ..methods.primitives import symmetric_zero
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
    out_f, in_f = tensors["weight_shape"].tolist()
    scales = tensors["weight_scale"]
    codes = unpack_int32(tensors["weight_packed"], bits, cols=in_f).to(torch.uint8)  # [out, in]
    if "weight_zero_point" in tensors:
        zeros = unpack_int32(tensors["weight_zero_point"].t(), bits, cols=out_f).t().to(torch.int32)  # [out, n_group]
    else:
        zeros = torch.full(scales.shape, symmetric_zero(bits), dtype=torch.int32, device=scales.device)
    return codes, scales, zeros


def quantization_config(bits: int, group: int, symmetric: bool, act_order: bool, ignore: list[str]) -> dict:
    """config.json `quantization_config`, built with compressed_tensors' own schema classes."""
    # imported here: compressed_tensors takes seconds to import (it pulls in transformers' loaders), and runs
    # writing the AWQ or GPTQ format never need it
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    weights = QuantizationArgs(
        num_bits=bits, type="int", symmetric=symmetric, dynamic=False,
        strategy="channel" if group == -1 else "group", group_size=None if group == -1 else group,
        actorder="static" if act_order else None, observer="minmax",
    )
    cfg = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
        quant_method="compressed-tensors", format="pack-quantized", quantization_status="compressed",
        ignore=list(ignore),
    )
    return cfg.model_dump(exclude_none=False, mode="json")

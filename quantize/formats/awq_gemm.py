"""AutoAWQ GEMM layout (`quant_method: awq`, `version: gemm`), as vLLM 0.32 reads it.

- qweight int32 [in, out / 8], qzeros int32 [in / g, out / 8], scales fp16 [in / g, out]
- within each int32, nibble i holds output column 8c + AWQ_ORDER[i] (qweight and qzeros alike)
- qzeros hold the real zero point; dequantized weight = (q - z) * s
"""

from __future__ import annotations

import torch

from .checks import expect, groups_divide, integer, need
from .packing import pack_int32, unpack_int32

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i <- column 8c + AWQ_ORDER[i]; the one source of truth


def pack(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> dict[str, torch.Tensor]:
    """codes [out, in] uint8, scales/zeros [out, in / g] -> {qweight, qzeros, scales} in the GEMM layout."""
    return {
        "qweight": pack_int32(codes.t(), 4, AWQ_ORDER),  # [in, out/8]
        "qzeros": pack_int32(zeros.t(), 4, AWQ_ORDER),  # [in/g, out/8]
        "scales": scales.t().contiguous(),  # [in/g, out]
    }


def unpack(tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """{qweight, qzeros, scales} -> codes [out, in] uint8, scales [out, in / g], zeros [out, in / g] int32."""
    qweight, scales = need(tensors, "qweight"), need(tensors, "scales")
    need(tensors, "qzeros")
    integer(tensors, "qweight")
    integer(tensors, "qzeros")
    in_f, words = qweight.shape
    n_group = scales.shape[0]
    expect(tensors, "scales", (n_group, words * 8), f"qweight {list(qweight.shape)} (8 outputs per int32)")
    expect(tensors, "qzeros", (n_group, words), f"qweight {list(qweight.shape)} and scales {list(scales.shape)}")
    groups_divide("qweight", in_f, n_group)
    codes = unpack_int32(qweight, 4, AWQ_ORDER).t().contiguous().to(torch.uint8)  # [out, in]
    zeros = unpack_int32(tensors["qzeros"], 4, AWQ_ORDER).t().contiguous().to(torch.int32)  # [out, in/g]
    return codes, scales.t().contiguous(), zeros  # scales [in/g, out] -> [out, in/g]


def quantization_config(w_bit: int, group: int, symmetric: bool, modules_to_not_convert: list[str]) -> dict:
    """The `quantization_config` block of config.json that vLLM and transformers read."""
    return {
        "quant_method": "awq",
        "bits": w_bit,
        "group_size": group,
        "zero_point": not symmetric,  # AutoAWQ's name: zero points stored (asymmetric)
        "version": "gemm",
        "modules_to_not_convert": list(modules_to_not_convert),
    }

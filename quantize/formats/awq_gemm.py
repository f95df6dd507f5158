"""AutoAWQ GEMM layout (`quant_method: awq`, `version: gemm`), as vLLM 0.32 reads it.

- qweight int32 [in, out / 8], qzeros int32 [in / g, out / 8], scales fp16 [in / g, out]
- within each int32, nibble i holds output column 8c + AWQ_ORDER[i] (qweight and qzeros alike)
- qzeros hold the real zero point; dequantized weight = (q - z) * s
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i <- column 8c + AWQ_ORDER[i]; the one source of truth
PACK = 8  # 4-bit values per int32


def pack_int4_cols(x: torch.Tensor) -> torch.Tensor:
    """x: [rows, cols] ints in [0, 15] -> int32 [rows, cols / 8] in AWQ nibble order."""
    rows, cols = x.shape
    assert cols % PACK == 0, f"cols={cols} not divisible by {PACK}"
    x = x.to(torch.int64).reshape(rows, cols // PACK, PACK)[..., list(AWQ_ORDER)]  # [rows, cols/8, 8]
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=x.device)  # nibble i at bits 4i..4i+3
    packed = (x << shifts).sum(dim=-1)  # [rows, cols/8], values < 2^32
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_int4_cols(p: torch.Tensor) -> torch.Tensor:
    """int32 [rows, cols / 8] in AWQ nibble order -> uint8 [rows, cols]."""
    rows, n = p.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=p.device)
    nibbles = (p.to(torch.int64).unsqueeze(-1) >> shifts) & 0xF  # [rows, n, 8], nibble i
    out = torch.empty_like(nibbles)
    out[..., list(AWQ_ORDER)] = nibbles  # column AWQ_ORDER[i] <- nibble i
    return out.reshape(rows, n * PACK).to(torch.uint8)


def pack(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> dict[str, torch.Tensor]:
    """codes [out, in] uint8, scales/zeros [out, in / g] -> {qweight, qzeros, scales} in the GEMM layout."""
    return {
        "qweight": pack_int4_cols(codes.t().contiguous()),  # [in, out/8]
        "qzeros": pack_int4_cols(zeros.t().contiguous()),  # [in/g, out/8]
        "scales": scales.t().contiguous(),  # [in/g, out]
    }


def unpack(tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """{qweight, qzeros, scales} -> codes [out, in] uint8, scales [out, in / g], zeros [out, in / g] int32."""
    codes = unpack_int4_cols(tensors["qweight"]).t().contiguous()  # [out, in]
    zeros = unpack_int4_cols(tensors["qzeros"]).t().contiguous().to(torch.int32)  # [out, in/g]
    scales = tensors["scales"].t().contiguous()  # [out, in/g]
    return codes, scales, zeros


def quantization_config(w_bit: int, group: int, zero_point: bool, modules_to_not_convert: list[str]) -> dict:
    """The `quantization_config` block of config.json that vLLM and transformers read."""
    return {
        "quant_method": "awq",
        "bits": w_bit,
        "group_size": group,
        "zero_point": zero_point,
        "version": "gemm",
        "modules_to_not_convert": list(modules_to_not_convert),
    }

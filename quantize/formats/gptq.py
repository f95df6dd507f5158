"""GPTQ v1 layout (`quant_method: gptq`), as vLLM 0.32 reads it (symmetric only).

- qweight int32 [in * b / 32, out]: int32 r holds input rows (32/b)·r + j at bits b·j (j = 0 .. 32/b - 1)
- scales fp16 [n_group, out]; qzeros int32 [n_group, out * b / 32] packed the same way along out, holding
  zero - 1 (the v1 convention; with sym vLLM ignores it and uses 2^(b-1), so it is 0x77777777 for 4 bits)
- g_idx int32 [in] = i // g: groups are contiguous even with (static) act-order, because vLLM 0.32
  rejects desc_act: true, and a permuted g_idx written with desc_act: false loads silently and is wrong.
"""

from __future__ import annotations

import torch

from .packing import pack_int32, unpack_int32


def pack(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int) -> dict[str, torch.Tensor]:
    """codes [out, in] uint8, scales/zeros [out, n_group] -> {qweight, qzeros, scales, g_idx}."""
    out_f, in_f = codes.shape
    n_group = scales.shape[1]
    g = in_f // n_group
    return {
        "qweight": pack_int32(codes, bits).t().contiguous(),  # [out, in*b/32] -> [in*b/32, out]
        "qzeros": pack_int32(zeros.t().to(torch.int64) - 1, bits),  # [n_group, out*b/32], v1: z - 1
        "scales": scales.t().contiguous(),  # [n_group, out]
        "g_idx": (torch.arange(in_f) // g).to(torch.int32),  # [in]
    }


def unpack(tensors: dict[str, torch.Tensor], bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """{qweight, qzeros, scales, g_idx} -> codes [out, in] uint8, scales [out, n_group], zeros [out, n_group]."""
    g_idx = tensors.get("g_idx")
    n_group = tensors["scales"].shape[0]
    in_f = tensors["qweight"].shape[0] * 32 // bits
    if g_idx is not None and not torch.equal(g_idx.to(torch.int64), torch.arange(in_f, device=g_idx.device) // (in_f // n_group)):
        raise ValueError("g_idx is not contiguous (i // group_size): a permuted g_idx needs desc_act, "
                         "which vLLM 0.32 rejects")
    codes = unpack_int32(tensors["qweight"].t(), bits).to(torch.uint8)  # [out, in]
    zeros = (unpack_int32(tensors["qzeros"], bits) + 1).to(torch.int32)  # [n_group, out]
    return codes, tensors["scales"].t().contiguous(), zeros.t().contiguous()


def quantization_config(bits: int, group: int, symmetric: bool, act_order: bool, true_sequential: bool,
                        damp: float) -> dict:
    """config.json `quantization_config` for vLLM's gptq / gptq_marlin (desc_act always false: see above).

    Linears left in 16-bit need no key: vLLM infers the quantized ones from the checkpoint's int32 tensors.
    """
    return {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group,
        "sym": symmetric,
        "desc_act": False,
        "static_groups": act_order,
        "true_sequential": true_sequential,
        "damp_percent": damp,
        "checkpoint_format": "gptq",
    }

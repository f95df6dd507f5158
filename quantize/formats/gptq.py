"""GPTQ v1 layout (`quant_method: gptq`), as vLLM 0.32 reads it (symmetric only).

- qweight int32 [in * b / 32, out]: int32 r holds input rows (32/b)·r + j at bits b·j (j = 0 .. 32/b - 1)
- scales fp16 [n_group, out]; qzeros int32 [n_group, out * b / 32] packed the same way along out, holding
  zero - 1 (the v1 convention; with sym vLLM ignores it and uses 2^(b-1), so it is 0x77777777 for 4 bits)
- g_idx int32 [in] = i // g: groups are contiguous even with (static) act-order, because vLLM 0.32
  rejects desc_act: true, and a permuted g_idx written with desc_act: false loads silently and is wrong.
  Other tools write desc_act: true with a permuted g_idx (row i in group g_idx[i]); the eval decodes those.
"""

from __future__ import annotations

import torch

from .checks import TensorError, check_g_idx, contiguous, expect, groups_divide, integer, need
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
    """{qweight, qzeros, scales} -> codes [out, in] uint8, scales [out, n_group], zeros [out, n_group] (v1: the
    stored zero + 1). Which group each input row belongs to is g_idx's to say (`decode`)."""
    qweight, scales = need(tensors, "qweight"), need(tensors, "scales")
    need(tensors, "qzeros")
    integer(tensors, "qweight")
    integer(tensors, "qzeros")
    words, out_f = qweight.shape
    n_group = scales.shape[0]
    expect(tensors, "scales", (n_group, out_f), f"qweight {list(qweight.shape)} ({out_f} outputs)")
    expect(tensors, "qzeros", (n_group, -(-out_f * bits // 32)),
           f"scales {list(scales.shape)} ({32 // bits} zero points per int32 along the outputs)")
    codes = unpack_int32(qweight.t(), bits).to(torch.uint8)  # [out, in]
    zeros = (unpack_int32(tensors["qzeros"], bits, cols=out_f) + 1).to(torch.int32)  # [n_group, out]
    return codes, scales.t().contiguous(), zeros.t().contiguous()


def group_index(tensors: dict[str, torch.Tensor], bits: int, desc_act: bool) -> torch.Tensor | None:
    """The linear's g_idx when its groups are not runs of group_size rows (act-order with desc_act), else None;
    TensorError for a permuted g_idx under desc_act: false, which vLLM would read as contiguous groups."""
    in_f, n_group = tensors["qweight"].shape[0] * 32 // bits, tensors["scales"].shape[0]
    g_idx = check_g_idx(tensors, "g_idx", in_f, n_group, f"qweight {list(tensors['qweight'].shape)} at {bits} bits")
    if contiguous(g_idx, in_f, n_group):
        groups_divide("scales", in_f, n_group)
        return None
    if not desc_act:
        raise TensorError("g_idx", "puts input rows in groups out of order (activation order), but "
                                   "quantization_config says desc_act: false, so vLLM would compute with the wrong "
                                   "scales; set desc_act: true if the tool quantized in activation order")
    return g_idx


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

"""Integer codes packed into int32 words: the one packer every format, and the per-layer checkpoint, use.

Word c of a row holds the values of columns (32/b)·c + order[j] at bits b·j (j = 0 .. 32/b - 1, low bits
first). `order` is the identity for GPTQ and compressed-tensors; AutoAWQ's GEMM layout interleaves
(`awq_gemm.AWQ_ORDER`). A row whose length 32/b does not divide is padded with zeros (compressed-tensors
packs zero points along out_features, which need not divide), and `unpack_int32(..., cols=)` drops the padding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, 32, bits, dtype=torch.int64, device=device)  # value j at bits b·j


def pack_int32(x: torch.Tensor, bits: int, order: Sequence[int] | None = None) -> torch.Tensor:
    """x: [rows, cols] ints in [0, 2^b) -> int32 [rows, ceil(cols·b / 32)]."""
    per = 32 // bits
    rows, cols = x.shape
    x = x.to(torch.int64) & (2**bits - 1)
    if cols % per:
        x = torch.nn.functional.pad(x, (0, per - cols % per))
    x = x.reshape(rows, -1, per)  # [rows, words, per]
    if order is not None:
        x = x[..., list(order)]  # value j of a word <- column order[j]
    packed = (x << _shifts(bits, x.device)).sum(dim=-1)  # [rows, words], values < 2^32
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_int32(p: torch.Tensor, bits: int, order: Sequence[int] | None = None,
                 cols: int | None = None) -> torch.Tensor:
    """int32 [rows, words] -> int64 [rows, cols] (default words·32/b): the inverse of pack_int32."""
    rows, words = p.shape
    values = (p.to(torch.int64).unsqueeze(-1) >> _shifts(bits, p.device)) & (2**bits - 1)  # [rows, words, per]
    if order is not None:
        out = torch.empty_like(values)
        out[..., list(order)] = values  # column order[j] <- value j
        values = out
    return values.reshape(rows, -1)[:, :cols]  # [rows, words·per] -> [rows, cols]

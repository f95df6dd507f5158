"""GPTQ's Hessian H = 2/n Σ x xᵀ of one linear's calibration inputs x [tokens, in], accumulated batch by batch.

Pure maths on tensors, as `gptq_sweep.py`, which factorises H and sweeps the columns with it. The products run
in float32 (half-precision inputs on CUDA through GEMMs with a float32 result); with several processes each
adds its own batches' sum and the sums are added once (`add_sum`, `reduced`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class HessianAccumulator:
    """Running H = 2/n Σ x xᵀ over batches of inputs x [..., in], in float32.

    fp16/bf16 inputs on CUDA: one half-precision GEMM per batch with a float32 result (`torch.mm(...,
    out_dtype=float32)`): the products of half-precision values are exact in float32 and the sums run in
    float32, so this is the float32 product at the half-precision tensor-core rate, faster than TF32 on a
    float32 copy (docs/BENCHMARKS.md). The raw sum is kept and scaled once.

    Inputs at least `symmetric_min` wide (down_proj's): XᵀX is symmetric, so only the blocks on and above the
    diagonal (`symmetric_block` square) are computed, ~0.6 of the GEMM work, and mirrored when H is read.
    """

    symmetric_min = 8192
    symmetric_block = 4096

    def __init__(self, in_features: int, device: torch.device | str = "cpu"):
        self._H = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)
        self.n = 0
        self._raw = False  # _H holds Σ x xᵀ (scaled when read), not the running mean
        self._upper = False  # only the upper block triangle of _H is current (mirrored when read)

    @property
    def H(self) -> torch.Tensor:
        if self._raw:
            self._H.mul_(2.0 / self.n)
            self._raw = False
        if self._upper:
            b = self.symmetric_block
            for i in range(0, self._H.shape[0], b):
                for j in range(i + b, self._H.shape[0], b):
                    self._H[j : j + b, i : i + b] = self._H[i : i + b, j : j + b].t()
            self._upper = False
        return self._H

    def _add_gram(self, x: torch.Tensor, gram) -> None:
        """_H += gram(a, b) = aᵀb over x's column blocks: one product, or the upper block triangle only."""
        n = x.shape[1]
        if n < self.symmetric_min:
            self._H.add_(gram(x, x))
            return
        b = self.symmetric_block
        for i in range(0, n, b):
            for j in range(i, n, b):
                self._H[i : i + b, j : j + b].add_(gram(x[:, i : i + b], x[:, j : j + b]))
        self._upper = True

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1])  # [tokens, in]
        t = x.shape[0]
        if x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and (self._raw or self.n == 0):
            self._raw = True
            self.n += t
            self._add_gram(x, lambda a, b: torch.mm(a.t(), b, out_dtype=torch.float32))
            return
        if self._raw:
            self.H  # noqa: B018 - scale the raw sum into the running mean before mixing in another dtype
        x = x.float()
        self._H.mul_(self.n / (self.n + t))
        self.n += t
        x = x * (2.0 / self.n) ** 0.5
        self._add_gram(x, lambda a, b: a.t() @ b)


    def add_sum(self, x: torch.Tensor) -> None:
        """Σ x xᵀ over x [..., in] added unscaled (never mixed with `add`): a partial sum for `reduced`. Half-precision
        CUDA inputs through float32-accumulating products, others in float32; wide inputs by the upper blocks."""
        x = x.reshape(-1, x.shape[-1])  # [tokens, in]
        self._raw = True
        self.n += x.shape[0]
        if x.is_cuda and x.dtype in (torch.float16, torch.bfloat16):
            self._add_gram(x, lambda a, b: torch.mm(a.t(), b, out_dtype=torch.float32))
        else:
            xf = x.float()
            self._add_gram(xf, lambda a, b: a.t() @ b)

    def reduced(self, all_sum: Callable[[torch.Tensor], torch.Tensor], tokens: int) -> torch.Tensor:
        """H = 2/tokens Σ x xᵀ over every process's partial sum (`add_sum`): all_sum adds the others' sums to this
        one in place (the same result on each); tokens: their total count. A process that saw no tokens joins too."""
        all_sum(self._H)
        self.n, self._raw = tokens, True
        self._upper = self._H.shape[0] >= self.symmetric_min  # as every process that saw tokens filled it
        return self.H

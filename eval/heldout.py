"""Several artifacts of one base model scored against it on the same token blocks: the mean KL divergence of their
next-token distributions from the unquantized model's, as the eval measures it on the perplexity windows
(`distribution`), here on blocks the caller holds out of calibration (`method: auto`, `pipeline.auto`)."""

from __future__ import annotations

import gc
import logging
import math
import time
from pathlib import Path

import torch

from quantize.source import ModelSource, load as source

from . import distribution
from .artifact import load_dequantized
from .perplexity import batch_windows, perplexity

log = logging.getLogger(__name__)


def reference(src: ModelSource, samples: torch.Tensor, dtype: torch.dtype, device: torch.device,
              trust_remote_code: bool = False) -> tuple[dict, float]:
    """The unquantized model's top-k next-token log-probabilities on samples [n, seq] -> (the record `score`
    compares against, seconds to load and score it). The model is dropped before this returns: the device then
    holds one decoded candidate at a time."""
    t0 = time.perf_counter()
    model = source.load_model(src, dtype, trust_remote_code, device=device)
    fp = perplexity(model, samples, batch_windows(device, samples.shape[1]), "held-out reference (FP)",
                    keep_topk=distribution.TOPK)
    del model
    _free(device)
    return fp["topk"], round(time.perf_counter() - t0, 3)


def score(artifact: Path, samples: torch.Tensor, ref: dict, dtype: torch.dtype, device: torch.device,
          label: str) -> dict:
    """One artifact's decoded weights (what vLLM computes with) against `reference`'s record on the same samples
    -> {kl_mean, top1, seconds, problem}; problem: why its figure cannot rank it (None when it can)."""
    t0 = time.perf_counter()
    model = load_dequantized(artifact, dtype, device)
    res = perplexity(model, samples, batch_windows(device, samples.shape[1]), label, reference=ref)
    del model
    _free(device)
    d = res["distribution"]
    kl = d["kl_mean"]
    problem = None if math.isfinite(kl) else f"its held-out KL is {kl} (the decoded weights overflow or are NaN)"
    return {"kl_mean": kl if problem is None else None, "top1": d["top1"],
            "seconds": round(time.perf_counter() - t0, 3), "problem": problem}


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

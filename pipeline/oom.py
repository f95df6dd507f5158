"""A run that does not fit in memory: how it is recognised, and the one message that says what to turn."""

from __future__ import annotations


def is_out_of_memory(e: BaseException) -> bool:
    """torch's CUDA OOM, or a RuntimeError saying so (older torch, other allocators, the CPU allocator)."""
    import torch

    if isinstance(e, torch.cuda.OutOfMemoryError):
        return True
    msg = str(e).lower()
    return isinstance(e, RuntimeError) and ("out of memory" in msg or "not enough memory" in msg)


def oom_message(e: BaseException, recipe_name: str, during_eval: bool = False, recipe=None) -> str:
    """What to turn when a run does not fit in memory, with the values of `recipe` (the run's parsed recipe, where
    the command got as far as parsing it)."""
    first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
    if during_eval:
        return (f"out of memory during eval: {first}\nThe artifact was written; lower the recipe's "
                f"`eval.perplexity.seq_len`, then rerun `make eval` (or `quantize eval {recipe_name}`).")
    now = "" if recipe is None else (
        f" (now: batch_size {recipe.batch_size}, calibration.n_samples {recipe.calibration.n_samples}, "
        f"calibration.seq_len {recipe.calibration.seq_len}, device {recipe.device})")
    return (f"out of memory: {first}\nThe run does not fit in this device's memory. In the recipe, lower "
            f"`batch_size` (calibration samples per forward), then `calibration.n_samples` or "
            f"`calibration.seq_len`{now}; or set `device: cpu` to quantize in host memory (slower).")

"""A run that does not fit in memory: how it is recognised, and the one message that says what to turn."""

from __future__ import annotations

from quantize.recipe import RecipeError, load_recipe


def is_out_of_memory(e: BaseException) -> bool:
    """torch's CUDA OOM, or a RuntimeError saying so (older torch, other allocators, the CPU allocator)."""
    import torch

    if isinstance(e, torch.cuda.OutOfMemoryError):
        return True
    msg = str(e).lower()
    return isinstance(e, RuntimeError) and ("out of memory" in msg or "not enough memory" in msg)


def oom_message(e: BaseException, recipe_name: str, during_eval: bool = False) -> str:
    """What to turn when a run does not fit in memory, with the recipe's current values when it loads."""
    first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
    if during_eval:
        return (f"out of memory during eval: {first}\nThe artifact was written; lower the recipe's "
                f"`eval.perplexity.seq_len`, then rerun `make eval` (or `quantize eval {recipe_name}`).")
    try:
        r = load_recipe(recipe_name)
        now = (f" (now: batch_size {r.batch_size}, calibration.n_samples {r.calibration.n_samples}, "
               f"calibration.seq_len {r.calibration.seq_len}, device {r.device})")
    except RecipeError:
        now = ""
    return (f"out of memory: {first}\nThe run does not fit in this device's memory. In the recipe, lower "
            f"`batch_size` (calibration samples per forward), then `calibration.n_samples` or "
            f"`calibration.seq_len`{now}; or set `device: cpu` to quantize in host memory (slower).")

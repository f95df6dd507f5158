"""The pre-flight stage of a run: every check that needs no weights, in order and timed, then the calibration set.

The checks themselves are `checks.py`'s (the plan, the device, the disk), `targets.py`'s (the GPUs a recipe must
serve on), the source's (custom code, weight files, tensors against config.json) and the methods' (kernels);
this module runs them for the recipes that share one pass and hands the runner what they established
(`Checked`): the resolved model, its config and table entry, each recipe's plan, the device and compute dtype,
the calibration samples. `python -m pipeline preflight` shows the same without a run (`runner.preflight_only`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import calib, methods
from ..capture.device import configure_allocator
from ..files import human_bytes
from ..formats import is_skipped
from ..methods.job import DTYPES
from ..methods.kernels import check_kernels
from ..recipe import Recipe
from ..runlog import Timings
from ..source import ModelSource, integrity, load as source
from ..source.arch import Arch, UnsupportedArchitecture, arch_for
from .checks import (NO_TARGETS, ROUTER_KEPT, Plan, check_free_disk, check_targets, cpu_moe_refusal, once_per_layer,
                     plan)
from .unsupported import table_lacks

log = logging.getLogger(__name__)


# before_weights(recipes, tokenizer, src, device): the caller's own checks of what follows the run, given what
# pre-flight has established by then (the resolved model, the device)
BeforeWeights = Callable[[list[Recipe], Any, ModelSource, torch.device], None]


@dataclass
class Checked:
    """What pre-flight established for a set of recipes sharing one model, before any weight is loaded."""

    src: ModelSource
    config: Any
    arch: Arch
    plans: list[Plan]
    device: torch.device
    compute_dtype: torch.dtype
    free_bytes: int  # on the disk that will hold the artifacts
    samples: torch.Tensor | None = None  # calibration input_ids [n_samples, seq_len] (awq, gptq)
    calib_record: dict | None = None
    cuda_allocator: str | None = None  # the CUDA allocator settings the run used (`device.configure_allocator`)


def preflight(recipes: list[Recipe], outs: list[Path], timings: Timings, device: torch.device, run: bool = False,
              before_weights: BeforeWeights | None = None) -> Checked:
    """Every check of the model, the recipes and the machine that needs no weights, in timed stages `preflight`
    and `calibrate` -> Checked. recipes: those sharing one pass (the runner has checked that they can, and that no
    output is in the way); outs: their artifact directories, in order; device: where the pass computes (the
    runner decides it once, `checks.pick_device`, before the warm-up that needs it too).

    Untrusted custom code or pickle-only weights, unsupported architecture, shapes the format or vLLM's kernels
    cannot take, too little free disk for all outputs, too little calibration text: each raises its own error
    with what to change, before the model is loaded.
    run: a run follows (not `preflight_only`): the CUDA allocator is configured once the checks have passed.
    before_weights(recipes, tokenizer, src, device): the caller's own checks of what follows the run (the eval's
    inputs), and what it starts ahead of the run with the model resolved here (the eval's hash of its files).
    """
    first = recipes[0]
    with timings.stage("preflight"):
        lap = timings.laps("preflight")  # its first read of a config imports transformers' model code
        src = source.resolve(first.model)
        config = source.read_config(src, first.trust_remote_code)
        try:
            arch = arch_for(config)
        except UnsupportedArchitecture as e:
            raise UnsupportedArchitecture(f"{e}; to add it, the table in quantize/source/arch.py needs: "
                                          f"{table_lacks(config, first.trust_remote_code)}") from None
        lap("config")
        for r in recipes:  # the GPUs the recipe must serve on: from the config alone, before the weight files
            check_targets(r, config, arch, is_skipped)
        source.check_weights(src)
        integrity.check_tensors(src, config, arch, first.trust_remote_code)
        if not any(methods.get(r.method).calibrates for r in recipes):  # calibration loads it otherwise
            source.load_tokenizer(src, first.trust_remote_code)  # an artifact without a usable tokenizer is refused
        lap("checkpoint")
        plans = [_plan_and_log(r, config, arch, table=run) for r in recipes]
        lap("plan")
        if before_weights is not None:
            before_weights(recipes, source.load_tokenizer(src, first.trust_remote_code), src, device)
            lap("eval inputs")
        for r in recipes:
            check_kernels(r, device)
        compute_dtype = pick_compute_dtype(first, device)
        lap("device")
    samples = calib_record = None
    if any(methods.get(r.method).calibrates for r in recipes):
        # before the disk estimate, which grows with n_samples: an absurd sample count is refused as one
        with timings.stage("calibrate"):
            samples, calib_record = _calibration(first, src)
    copied = sum((src.path / f).stat().st_size for f in source.TOKENIZER_FILES if (src.path / f).is_file())
    free = check_free_disk(outs[0], sum(p.tensor_bytes + copied for p in plans) + _checkpoint_bytes(recipes, config, plans))
    log.info("pre-flight: %s free on the output's disk; computing on %s in %s", human_bytes(free), device,
             str(compute_dtype).removeprefix("torch."))
    checked = Checked(src, config, arch, plans, device, compute_dtype, free, samples, calib_record)
    if run:
        checked.cuda_allocator = configure_allocator(device)  # before the run's first CUDA allocation
    return checked


def _checkpoint_bytes(recipes: list[Recipe], config, plans: list[Plan]) -> int:
    """Estimate of a checkpoint's peak size: carried activations (float32, per chain) + the codes, scales and
    zeros so far (at most about the artifacts' own size); it lives until the artifacts are written."""
    r = recipes[0]
    if r.checkpoint_every_s is None or all(_propagation(x) == "none" for x in recipes):
        return 0
    chains = 1 + sum(_propagation(x) == "quantized" for x in recipes)
    return r.calibration.n_samples * r.calibration.seq_len * config.hidden_size * 4 * chains + \
        sum(p.tensor_bytes for p in plans)


def _propagation(recipe: Recipe) -> str:
    return methods.get(recipe.method).propagation(recipe)


def pick_compute_dtype(recipe: Recipe, device: torch.device) -> torch.dtype:
    """auto: float32 on the CPU (half-precision matmuls there are slow and less exact), else the recipe dtype."""
    if recipe.compute_dtype != "auto":
        return DTYPES[recipe.compute_dtype]
    return torch.float32 if device.type == "cpu" else DTYPES[recipe.dtype]


def _plan_and_log(recipe: Recipe, config, arch, table: bool = True):
    """The recipe's plan, logged (the kernel table too unless `table` is False: `preflight_only` prints it)."""
    the_plan = plan(config, arch, recipe, is_skipped)
    log.info("recipe %s: %s w%d g%d symmetric=%s format %s", recipe.name, recipe.method, recipe.w_bit,
             recipe.q_group_size, recipe.symmetric, recipe.out_format)
    log.info("pre-flight: %s" + ("\n%s" if table else "%s"), the_plan.summary(), the_plan.table() if table else "")
    for line in once_per_layer([f"{name}: stays 16-bit: {why}" for name, why in the_plan.skipped.items()
                                if why not in ("modules_to_not_convert", ROUTER_KEPT)]):
        log.warning("pre-flight: %s", line)
    refused = cpu_moe_refusal(the_plan)
    if refused:
        log.warning("pre-flight: %s", refused)
    if not recipe.serve.targets:
        log.warning("pre-flight: %s", NO_TARGETS)
    return the_plan


def _calibration(recipe: Recipe, src: ModelSource) -> tuple[torch.Tensor, dict]:
    """Tokenizer + calibration text -> (input_ids [n_samples, seq_len], manifest record); no weights needed.

    CalibrationError (tokens available vs needed, and which key to change) when the text is too short.
    """
    tokenizer = source.load_tokenizer(src, recipe.trust_remote_code)
    c = recipe.calibration
    text = calib.load_text(c.dataset, c.split, c.subset, c.text_column)
    samples = calib.make_samples(text.documents, tokenizer, c.n_samples, c.seq_len, c.seed)
    log.info("calibration: %d x %d tokens from %s", c.n_samples, c.seq_len, text.source)
    return samples, {"dataset": c.dataset, "source": text.source, "sha256": text.sha256,
                     "n_samples": c.n_samples, "seq_len": c.seq_len, "seed": c.seed, "tokens": int(samples.numel()),
                     "samples_sha256": calib.samples_sha256(samples)}

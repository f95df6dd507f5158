"""One artifact of a run: its job's results packed, its directory written atomically with the manifest, the
serve config and the model card (`write` holds the file primitives)."""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..files import usable_cores
from .. import formats
from ..methods.job import Job
from ..preflight import deploy
from ..records import Manifest
from ..source import load as source
from . import capacity, card_plots, cpu_serve, modelcard, serve_config, write as export
from .stream import WeightStream

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunRecord:
    """What every artifact of one run shares: its source, devices and dtypes, calibration, the pass's record."""

    src: source.ModelSource
    config: Any
    tied: bool  # lm_head shares the input embedding
    device: torch.device
    compute_dtype: torch.dtype
    storage_dtype: torch.dtype  # the model's parameters as loaded
    dtype: torch.dtype  # the artifact's 16-bit dtype
    calib_record: dict | None
    shared: dict | None  # the shared pass of several recipes (None: one recipe)
    numerics: list[str]  # where the pass switched to float32
    pass_seconds: dict[str, float]
    provenance: dict  # versions, git, cuda_allocator
    stage_parts: dict[str, dict[str, float]]  # the parts of the stages that keep a stopwatch (pre-flight's)


def write_artifact(job: Job, the_plan, weights: WeightStream, model, stages: dict, run: RunRecord) -> dict[str, float]:
    """Finish one job's artifact directory (`weights.directory`, its weights written by `weights` during the pass
    or now) and commit it atomically (timed into its manifest) -> the seconds of export's parts: weights (what
    was left of packing and writing them, NaN/inf refused), files (config, tokenizer), card (plots, model card,
    manifest record), seal (hashes, fsync, rename), and replaced (removing the previous artifact that --force
    replaced, where there was one)."""
    recipe = job.recipe
    t0 = time.perf_counter()
    job.settle()  # before anything reads its results (a mixed job's are chosen here)
    errors = {str(k): v for k, v in job.errors.items()}
    # The error plot needs only the errors: drawn in a thread from here, it is ready by the time the card is
    # written (H200 host: importing matplotlib took 1.2 s there, warm, and its first use on a fresh machine builds
    # a font cache). On a host of fewer cores it waits for the weights: beside the packing threads of a 2-core
    # host it slowed export (3.2 -> 4.3 s, default recipe).
    drawing = ThreadPoolExecutor(1, thread_name_prefix="plot") if errors and usable_cores() >= PLOT_THREAD_CORES else None
    plot = drawing.submit(card_plots.error_plot, recipe.name, errors) if drawing else None
    try:
        return _write(job, the_plan, weights, model, stages, run, t0, errors, plot)
    finally:
        if drawing is not None:
            drawing.shutdown(wait=True)


PLOT_THREAD_CORES = 4  # the error plot is drawn beside the weights' packing on hosts with at least this many cores


def _write(job: Job, the_plan, weights: WeightStream, model, stages: dict, run: RunRecord, t0: float,
           errors: dict, plot: Future | None) -> dict[str, float]:
    recipe, directory = job.recipe, weights.directory
    parts: dict[str, float] = {}
    weights.finish()
    qcfg = formats.get(recipe.out_format).quantization_config(recipe, list(the_plan.skipped), job.groups)
    parts["weights"] = time.perf_counter() - t0

    def fill(tmp: Path) -> Manifest:
        t2 = time.perf_counter()
        copied = export.write_model_dir(tmp, model, qcfg, run.dtype, run.src.path, source.TOKENIZER_FILES,
                                        recipe.to_dict())
        t3 = time.perf_counter()
        parts["files"] = t3 - t2
        (tmp / "preflight.json").write_text(the_plan.to_json() + "\n")
        serve = serve_config.build(recipe, the_plan)
        (tmp / serve_config.SERVE_CONFIG).write_text(serve_config.render(serve))
        extras = Manifest.model_validate({  # the keys in the order manifest.json has always listed them
            "artifact": recipe.name,
            "format": {"name": recipe.out_format, "quant_method": qcfg["quant_method"]},
            "recipe": recipe.to_dict(),
            "model": {"spec": run.src.spec, "resolved": str(run.src.path), "kind": run.src.kind,
                      "gguf_sha256": run.src.origin_sha256, "architecture": run.config.architectures,
                      "tie_word_embeddings": run.tied, "license": modelcard.source_license(run.src.path)},
            "calibration": run.calib_record,
            "quantized_modules": len(job.results),
            "unconverted": sorted(weights.unconverted),
            "copied_unchanged": copied,
            "notes": notes(run.tied, run.storage_dtype, run.dtype) + run.numerics,
            "skipped_linears": the_plan.skipped,
            "tensor_parallel_sizes": the_plan.tp_sizes,
            "deploy": deploy.compact(the_plan.deploy, recipe.dtype) if the_plan.deploy else None,
            "serve": serve,
            "serve_endpoint": serve_config.endpoint(tmp),  # chat, or completions for a tokenizer without a template
            "capacity": capacity_facts(tmp, model, serve),
            job.method.stats_key: {str(k): v for k, v in job.stats.items()},
            **({"output_error": errors} if errors else {}),
            **({"mixed": job.mixed} if job.mixed else {}),
            "shared_pass": run.shared,
            "device": str(run.device), "compute_dtype": str(run.compute_dtype).removeprefix("torch."),
            "cuda_allocator": run.provenance["cuda_allocator"],
            "versions": run.provenance["versions"], "cpu": cpu_serve.facts(), "git": run.provenance["git"],
            "timings_s": {**stages, "export": round(time.perf_counter() - t0, 3)},
            **({"stage_parts_s": run.stage_parts} if run.stage_parts else {}),
            "pass_seconds": run.pass_seconds,  # the quantize stage's time: device upload, FP forwards, jobs
            **({"distributed": run.provenance["distributed"]} if "distributed" in run.provenance else {}),
        })
        if card_plots.plot_experts(extras, tmp / card_plots.EXPERT_PLOT) is not None:
            extras.expert_plot = card_plots.EXPERT_PLOT
        png = plot.result() if plot is not None else card_plots.error_plot(recipe.name, errors)
        if png is not None:
            (tmp / card_plots.ERROR_PLOT).write_bytes(png)
            extras.error_plot = card_plots.ERROR_PLOT
        (tmp / "README.md").write_text(modelcard.render(extras))
        parts["card"] = time.perf_counter() - t3
        return extras

    directory.commit(fill(directory.tmp))
    parts["seal"] = time.perf_counter() - t0 - sum(parts.values()) - directory.replaced_s
    if directory.replaced_s:
        parts["replaced"] = directory.replaced_s
    parts = {k: round(v, 3) for k, v in parts.items()}
    log.info("wrote %s (%s); export: %s", directory.out, ", ".join(f"{k} {v:.1f}s" for k, v in stages.items()),
             ", ".join(f"{k} {v:.1f} s" for k, v in parts.items()))
    return parts


def notes(tied: bool, storage: torch.dtype, dtype: torch.dtype) -> list[str]:
    notes = []
    if tied:
        notes.append("tie_word_embeddings: lm_head shares the input embedding; kept tied and unquantized "
                     "(lm_head.weight is not written, as in the source)")
    if storage != dtype:
        notes.append(f"computed in {storage} on the CPU; unquantized tensors and scales written as {dtype}")
    return notes


def capacity_facts(artifact: Path, model, serve: dict) -> dict | None:
    """`capacity.facts` for a written artifact directory (its config.json and safetensors files); None when the
    served length is unknown."""
    if not serve.get("max-model-len"):
        return None
    weights = sum(f.stat().st_size for f in artifact.glob("*.safetensors"))
    params = sum(p.numel() for p in model.parameters())  # tied embeddings counted once
    return capacity.facts(json.loads((artifact / "config.json").read_text()), serve["max-model-len"], weights,
                          params)

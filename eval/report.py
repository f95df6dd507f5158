"""The eval stage: perplexity FP16 vs quantized, vLLM smoke-load, optional lm-eval -> the report (a
`quantize.records.Report`); its gates are `gates`', its markdown `report_md`'s. The pipeline writes both into the
artifact.

Works on any vLLM-loadable directory (ours or another tool's): the quantized model is decoded from the
artifact's packed tensors; the FP16 reference is the base model (from our manifest, or given).
"""

from __future__ import annotations

import gc
import json
import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import torch

from quantize.export import serve_config
from quantize.methods import output_error
from quantize.source import ModelSource, load as source
from quantize import manifest as manifest_file
from quantize.records import Manifest, Report

from . import distribution, gates as eval_gates, lmeval, refcache
from .artifact import load_dequantized
from .readable import machine
from .perplexity import EvalInputError, Protocol, batch_windows, load_eval_text, perplexity, protocol_record, windows
from .smoke import decode_check, smoke, vllm_unavailable

log = logging.getLogger(__name__)


def _lm_eval_tasks(opts) -> dict | None:
    """The recipe's lm-eval tasks loaded (or each one's reason for not running) -> plan; None without tasks."""
    if not opts.tasks:
        return None
    why = lmeval.unavailable()
    if why:
        return {"skipped": why}
    t0 = time.perf_counter()
    loaded, not_run = lmeval.load_tasks(tuple(opts.tasks))
    return {"tasks": loaded, "not_run": not_run, "load_s": round(time.perf_counter() - t0, 2),
            "samples": lmeval.subset_samples(loaded, opts.subset)}


def _lm_eval_reference(plan: dict | None, opts, key: dict, load_reference, tokenizer, batch: int,
                       timings: dict) -> dict | None:
    """The reference's lm-eval scores from the reference cache (same key, plus tasks and limit) or scored now on
    the reference model (loaded only if the perplexity pass did not load it already)."""
    if not plan or not plan.get("tasks"):
        return None
    # a task's documents change only with its version (eval/tasks/*.yaml metadata), which keys the cache too
    spec = {"tasks": sorted(plan["tasks"]), "limit": opts.limit, "subset": opts.subset,
            "versions": {t: (task.config.metadata or {}).get("version") for t, task in sorted(plan["tasks"].items())}}
    cached = refcache.lookup_extra(key, "lm_eval", spec)
    if cached is not None:
        return {**cached, "cached": True}
    res = lmeval.run_on_model(load_reference(), tokenizer, plan["tasks"], opts.limit, batch, plan["samples"])
    timings["lm_eval_reference"] = res["seconds"]
    refcache.store_extra(key, "lm_eval", spec, res)
    return {**res, "cached": False}


def _lm_eval_report(plan: dict | None, ref: dict | None, quant: dict | None, artifact: Path, opts, served: str,
                    timings: dict) -> dict:
    """The report's lm-eval record: both models' scores and their difference, the vLLM backend's scores of the
    artifact where vLLM can serve it, and a line per task that did not run."""
    if plan is None:
        return {"skipped": "no eval.lm_eval.tasks in the recipe"}
    if "skipped" in plan:
        return plan
    out = {"tasks": list(opts.tasks), "limit": opts.limit, "subset": opts.subset, "not_run": plan["not_run"],
           "load_s": plan["load_s"]}
    if ref is not None and quant is not None:
        out.update(reference=ref, quantized=quant, difference=lmeval.difference(ref, quant),
                   paired=lmeval.paired(ref, quant))
    why_not = "eval.lm_eval.vllm is false" if not opts.vllm else vllm_unavailable()
    if why_not or not plan["tasks"]:
        out["vllm"] = {"skipped": why_not or "no task loaded"}
    else:
        out["vllm"] = lmeval.run_vllm(artifact, sorted(plan["tasks"]), opts.limit, served, opts.timeout_s,
                                      plan["samples"])
        if out["vllm"].get("seconds") is not None:
            timings["lm_eval_vllm"] = out["vllm"]["seconds"]
    return out


def eval_device(manifest: Manifest | None) -> torch.device:
    """Where the eval computes: where the artifact was quantized (the manifest's `device`) when that device is
    here; an artifact with no manifest, on CUDA when torch sees it, else on the CPU."""
    want = manifest.device if manifest is not None else None
    if want is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if want.startswith("cuda") and not torch.cuda.is_available():
        log.warning("the artifact was quantized on %s but no CUDA device is visible: evaluating on the CPU", want)
        return torch.device("cpu")
    return torch.device(want)


def served_dtype(artifact: Path, manifest: Manifest | None) -> str:
    """The artifact's 16-bit dtype (the recipe's `dtype`; else config.json's): what vLLM and a GPU eval use."""
    dtype = manifest.recipe.dtype if manifest is not None else None
    if dtype is None:
        config = json.loads((artifact / "config.json").read_text())
        dtype = str(config.get("dtype") or config.get("torch_dtype") or "float16")
    return dtype if dtype in ("float16", "bfloat16") else "float16"


def eval_dtype(device: torch.device, served: str) -> torch.dtype:
    """float32 on the CPU (the recorded CPU protocol; half precision there is slow and less exact), else the
    artifact's own 16-bit dtype."""
    return torch.float32 if device.type == "cpu" else getattr(torch, served)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _reset_host_peak() -> bool:
    """Restart the kernel's peak-RSS counter (VmHWM) for this process; False where that is not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _host_peak_bytes() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reference_ppl(ctx: dict, key: dict, load_reference, wins: torch.Tensor, timings: dict,
                   background: ThreadPoolExecutor) -> tuple[dict, dict, Future | None]:
    """The reference's perplexity and top-k distributions from the cache (verified by its key) or scored now
    -> (result, cache info, the entry's write). An entry without the distributions is scored again and rewritten.
    A scored reference is written to the cache on `background` (its distributions are ~150 MB for a whole
    WikiText-2; hashing and writing them overlap the artifact's load); the caller waits for it and records
    where it went as the cache info's "stored"."""
    shared = ctx["shared"]
    info = {"key_sha256": refcache.entry_path(key).stem, "model_sha256": shared["model_sha256"]}
    fp = refcache.lookup(key)
    if fp is not None and fp.get("topk") is not None and fp["topk"]["k"] == distribution.TOPK:
        return fp, {**info, "hit": True}, None
    if fp is not None:
        log.info("the cached reference entry holds no top-%d distributions: scoring the reference once more",
                 distribution.TOPK)
        info["rewritten"] = "the entry held no reference distributions"
    fp = perplexity(load_reference(), wins, ctx["batch"], "reference", keep_topk=distribution.TOPK)
    timings["perplexity_reference"] = fp["seconds"]
    return fp, {**info, "hit": False, "stored": None}, background.submit(_store_reference, key, fp, timings)


def _store_reference(key: dict, fp: dict, timings: dict) -> str | None:
    t0 = time.perf_counter()
    stored = refcache.store(key, fp)
    timings["reference_store"] = round(time.perf_counter() - t0, 2)
    return str(stored) if stored else None


def _hash_reference(shared: dict, timings: dict, ahead: Sequence[refcache.HashAhead] = ()) -> None:
    """The reference model's files' sha256 (the cache key's first part), once per base model; from the run's hash
    of them during its quantize stage (`ahead`, one per base model) where that is of these files as they stand."""
    if "model_sha256" not in shared:
        t0 = time.perf_counter()
        sha = None
        for h in ahead:  # each answers None at once for another base model's files
            if (sha := h.result(shared["src"].path)) is not None:
                timings["reference_hash_ahead"] = h.seconds
                timings["reference_hash_wait"] = round(time.perf_counter() - t0, 2)
                break
        else:
            sha = refcache.model_sha256(shared["src"].path)
            timings["reference_hash"] = round(time.perf_counter() - t0, 2)
        shared["model_sha256"] = sha
        refcache.remember_model_sha256(shared["src"].path, sha)


class _Reference:
    """The unquantized model on the eval's device, loaded at its first use; or, after `start`, loading in a thread
    of its own while the eval hashes files and tokenizes its text (the load reads the base model's files and
    fills the device; the hashing and tokenizing are CPU work). `release` drops it, first waiting for a load
    still under way, so the device never holds the reference and the decoded artifact at once."""

    def __init__(self, src, dtype: torch.dtype, device: torch.device, timings: dict):
        self.src, self.dtype, self.device, self.timings = src, dtype, device, timings
        self.model = None
        self.loading: Future | None = None

    def start(self) -> None:
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reference-load")
        self.loading = pool.submit(self._load)
        pool.shutdown(wait=False)  # its one thread ends with the load

    def _load(self):
        t0 = time.perf_counter()
        model = source.load_model(self.src, self.dtype, device=self.device)
        self.timings["load_reference"] = round(time.perf_counter() - t0, 2)
        return model

    def __call__(self):
        if self.model is None:
            if self.loading is not None:
                t0 = time.perf_counter()
                loading, self.loading = self.loading, None
                self.model = loading.result()  # a failed load raises here, as it would have loaded in line
                self.timings["load_reference_wait"] = round(time.perf_counter() - t0, 2)
            else:
                self.model = self._load()
        return self.model

    def release(self) -> None:
        if self.loading is not None:  # loaded ahead but never asked for (the cache held the reference)
            loading, self.loading = self.loading, None
            try:
                loading.result()
                log.info("the reference loaded ahead was not needed: the cache held its perplexity")
            except Exception as e:  # nothing needed it, so its failure changes no result
                log.info("the reference loaded ahead was not needed (its load failed: %s)", e)
        self.model = None


def _context(artifact: Path, base_spec: str, manifest: Manifest | None, compute_dtype, cache: dict | None,
             resolved: Sequence[ModelSource] = ()) -> dict:
    """What every step of one eval shares (and a comparison's variants of one base model reuse): the base
    model's source (the one in `resolved` of this spec, else resolved now), tokenizer and files' sha256, the
    device, dtype and batch."""
    device = eval_device(manifest)
    served = served_dtype(artifact, manifest)
    dtype = compute_dtype or eval_dtype(device, served)
    shared = cache.setdefault((base_spec, str(device), str(dtype)), {}) if cache is not None else {}
    if "src" not in shared:
        shared["src"] = next((s for s in resolved if s.spec == base_spec), None) or source.resolve(base_spec)
        shared["tokenizer"] = source.load_tokenizer(shared["src"])
    return {**shared, "device": device, "dtype": dtype, "served": served, "shared": shared}


def evaluate(artifact: Path, base_spec: str | None, eopts, compute_dtype: torch.dtype | None = None,
             cache: dict | None = None, base_hashes: Sequence[refcache.HashAhead] = (),
             resolved: Sequence[ModelSource] = ()) -> Report:
    """Run the whole eval stage on `artifact` -> the report (`pipeline.stages.evaluate` writes it into the artifact).

    On the device that quantized it (CUDA: the artifact's 16-bit dtype; CPU: float32), one model on the device
    at a time: vLLM's smoke-load first (a child process), then the reference (only if the smoke test needs it
    or its perplexity is not cached), then the decoded artifact.
    cache: pass one dict to several calls on artifacts of the same base model (a comparison) so the base
    model's files are resolved and hashed once.
    base_hashes: base models' files hashed ahead (`refcache.HashAhead`); the one of this base model is used where
    its files are as they were hashed.
    resolved: base models a run's pre-flight resolved already (`pipeline.stages.BaseHashes.sources`); the one of
    this base model is read as it was quantized from, not resolved again.
    """
    artifact = Path(artifact)
    manifest = manifest_file.read(artifact)
    base_spec = base_spec or (manifest.model.spec if manifest is not None else None)
    if not base_spec:
        raise EvalInputError(f"{artifact}: no manifest names its base model; pass --base <model spec>")
    peak_reset = _reset_host_peak()
    timings: dict[str, float] = {}
    ctx = _context(artifact, base_spec, manifest, compute_dtype, cache, resolved)
    device, dtype = ctx["device"], ctx["dtype"]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    popts = eopts.perplexity
    proto = Protocol(dataset=popts.dataset, seq_len=popts.seq_len, max_windows=popts.max_windows)
    smoke_skipped = (vllm_unavailable() or None) if eopts.vllm.enabled else "eval.vllm.enabled is false"
    reference = _Reference(ctx["src"], dtype, device, timings)
    background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reference-store")
    try:
        return _evaluate(artifact, base_spec, eopts, manifest, ctx, proto, smoke_skipped, reference, timings,
                         peak_reset, background, base_hashes)
    finally:
        reference.release()
        background.shutdown(wait=True)  # a cache entry being written is finished, whatever happened


def _evaluate(artifact: Path, base_spec: str, eopts, manifest: Manifest | None, ctx: dict, proto: Protocol,
              smoke_skipped: str | None, load_reference: _Reference, timings: dict, peak_reset: bool,
              background: ThreadPoolExecutor, base_hashes: Sequence[refcache.HashAhead]) -> Report:
    device, dtype, popts = ctx["device"], ctx["dtype"], eopts.perplexity
    # The reference loads ahead, beside the waits below, when it will surely be scored: the cache probably
    # lacks it, and no vLLM smoke test first needs a device this process holds nothing on.
    if smoke_skipped is not None and not refcache.probably_cached(ctx["src"].path, dtype, device, distribution.TOPK):
        load_reference.start()
    # three independent waits side by side: hashing the artifact's shards (verify), the reference's files (the
    # cache key) and tokenizing the eval text; nothing reads the artifact's weights before verify succeeds
    with ThreadPoolExecutor(max_workers=2) as pool:
        verifying = pool.submit(manifest_file.verify, artifact)  # refuses a tampered artifact, naming the file
        hashing = pool.submit(_hash_reference, ctx["shared"], timings, base_hashes)
        text, where = load_eval_text(popts.dataset)
        wins = windows(ctx["tokenizer"], text, proto)
        verified = verifying.result()
        hashing.result()
    if verified:  # the manifest as verified, for the fingerprint of the files this eval scores
        manifest = manifest_file.read(artifact)
    record = protocol_record(proto, text, where, wins)
    ctx["batch"] = batch_windows(device, proto.seq_len)
    ctx["lm_batch"] = 8 if device.type == "cpu" else 32  # lm-eval requests per forward (short multiple-choice texts)
    log.info("eval on %s in %s: %d windows of %d tokens from %s, %d per forward", refcache.device_kind(device),
             str(dtype).removeprefix("torch."), wins.shape[0], proto.seq_len, where, ctx["batch"])
    smoke_res: dict = {"skipped": smoke_skipped}
    if eopts.vllm.enabled:
        # the endpoint it would have asked on is recorded all the same (chat, or completions for a base model)
        smoke_res = {"skipped": smoke_skipped, "endpoint": serve_config.endpoint(artifact)} if smoke_skipped else None
        if smoke_res is None:
            t0 = time.perf_counter()
            smoke_res = smoke(artifact, load_reference, ctx["tokenizer"], ctx["served"], eopts.vllm.max_tokens,
                              eopts.vllm.min_token_agreement, eopts.vllm.timeout_s,
                              manifest.deploy.kernels if manifest is not None and manifest.deploy else None)
            timings["vllm_smoke"] = round(time.perf_counter() - t0, 2)
    key = refcache.make_key(ctx["shared"]["model_sha256"], record, ctx["dtype"], ctx["device"])
    lm_plan = _lm_eval_tasks(eopts.lm_eval)  # before any model is scored: a subset larger than a task stops here
    fp, cache_info, storing = _reference_ppl(ctx, key, load_reference, wins, timings, background)
    lm_ref = _lm_eval_reference(lm_plan, eopts.lm_eval, key, load_reference, ctx["tokenizer"], ctx["lm_batch"],
                                timings)
    load_reference.release()
    _free(device)
    t0 = time.perf_counter()
    quantized = load_dequantized(artifact, dtype, device)
    timings["load_quantized"] = round(time.perf_counter() - t0, 2)
    if smoke_res.get("token_ids"):
        decode_check(smoke_res, quantized, eopts.vllm.min_decode_agreement)
    q = perplexity(quantized, wins, ctx["batch"], "quantized", reference=fp["topk"])
    timings["perplexity_quantized"] = q["seconds"]
    if storing is not None:
        cache_info["stored"] = storing.result()
    lm_q = None
    if lm_ref is not None:
        lm_q = lmeval.run_on_model(quantized, ctx["tokenizer"], lm_plan["tasks"], eopts.lm_eval.limit, ctx["lm_batch"],
                                   lm_plan["samples"])
        timings["lm_eval_quantized"] = lm_q["seconds"]
    del quantized
    _free(device)
    delta = q["ppl"] - fp["ppl"]
    ppl = {"protocol": record, "fp16": {k: fp[k] for k in ("ppl", "tokens", "seconds")},
           "quantized": {k: q[k] for k in ("ppl", "tokens", "seconds")},
           "delta": delta, "delta_pct": 100 * delta / fp["ppl"]}
    lm = _lm_eval_report(lm_plan, lm_ref, lm_q, artifact, eopts.lm_eval, ctx["served"], timings)
    dist = q["distribution"]
    gates = eval_gates.check(ppl, eopts, dist)
    passed = gates["passed"] and smoke_res.get("passed", True)
    scored = {"device": refcache.device_kind(device), "dtype": str(dtype).removeprefix("torch."),
              "windows_per_forward": ctx["batch"], "reference_cache": cache_info,
              "host_rss_peak_bytes": _host_peak_bytes(),
              "host_rss_peak_scope": "eval stage" if peak_reset else "process lifetime",
              "device_peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}
    report = Report.model_validate({  # the keys in the order report.json has always listed them
        "artifact": str(artifact), "manifest_verified": verified, "files_scored": manifest_file.files_fingerprint(manifest),
        "base_model": base_spec,
        "reference_dtype": scored["dtype"], "scored_on": scored,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
        "perplexity": ppl, "distribution": dist, "gates": gates,
        "output_error_worst": output_error.worst((manifest.output_error if manifest else None) or {}),
        **({"auto": manifest.auto.to_json()} if manifest is not None and manifest.auto is not None else {}),
        "vllm_smoke": smoke_res, "lm_eval": lm,
        "quantize_timings_s": manifest.timings_s if manifest else None, "eval_timings_s": timings, "passed": passed,
    })
    return report.written()

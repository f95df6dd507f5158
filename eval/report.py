"""The eval stage: perplexity FP16 vs quantized, vLLM smoke-load, optional lm-eval -> the report (a dict) and
its markdown. The pipeline writes them into the artifact.

Works on any vLLM-loadable directory (ours or another tool's): the quantized model is decoded from the
artifact's packed tensors; the FP16 reference is the base model (from our manifest, or given).
"""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import torch

from quantize import modelcard, serve_config, source
from quantize.calib import hub_offline
from quantize import manifest as manifest_file

from . import refcache
from .artifact import load_dequantized
from .perplexity import Protocol, batch_windows, load_eval_text, perplexity, protocol_record, windows
from .smoke import smoke, vllm_unavailable

log = logging.getLogger(__name__)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{platform.machine()} {cpu}, {os.cpu_count()} cores, {gpu}"


def _lm_eval(artifact: Path, opts, dtype: str) -> dict:
    """Run the lm-evaluation-harness (its vLLM backend) when its task data can be reached; else say why not."""
    if not opts.tasks:
        return {"skipped": "no eval.lm_eval.tasks in the recipe"}
    if hub_offline():
        return {"skipped": f"HF_HUB_OFFLINE=1: task data for {list(opts.tasks)} cannot be fetched"}
    if shutil.which("lm_eval") is None and subprocess.run([sys.executable, "-c", "import lm_eval"],
                                                          capture_output=True).returncode:
        return {"skipped": "lm-eval is not installed (pip install lm-eval)"}
    with tempfile.TemporaryDirectory() as work:
        cmd = [sys.executable, "-m", "lm_eval", "--model", "vllm", "--model_args",
               f"pretrained={artifact},dtype={dtype},enforce_eager=True", "--tasks", ",".join(opts.tasks),
               "--output_path", work] + (["--limit", str(opts.limit)] if opts.limit else [])
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            return {"error": proc.stderr.strip().splitlines()[-5:], "exit_code": proc.returncode}
        found = sorted(Path(work).rglob("results*.json"))
        return json.loads(found[-1].read_text())["results"] if found else {"error": "no results file written"}


def eval_device(manifest: dict) -> torch.device:
    """Where the eval computes: where the artifact was quantized (the manifest's `device`) when that device is
    here; an artifact with no manifest, on CUDA when torch sees it, else on the CPU."""
    want = manifest.get("device")
    if want is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if want.startswith("cuda") and not torch.cuda.is_available():
        log.warning("the artifact was quantized on %s but no CUDA device is visible: evaluating on the CPU", want)
        return torch.device("cpu")
    return torch.device(want)


def served_dtype(artifact: Path, manifest: dict) -> str:
    """The artifact's 16-bit dtype (the recipe's `dtype`; else config.json's): what vLLM and a GPU eval use."""
    dtype = (manifest.get("recipe") or {}).get("dtype")
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


def _reference_ppl(ctx: dict, load_reference, wins: torch.Tensor, record: dict, timings: dict) -> tuple[dict, dict]:
    """The reference's perplexity from the cache (verified by its key) or scored now -> (result, cache info)."""
    shared = ctx["shared"]
    key = refcache.make_key(shared["model_sha256"], record, ctx["dtype"], ctx["device"])
    info = {"key_sha256": refcache.entry_path(key).stem, "model_sha256": shared["model_sha256"]}
    fp = refcache.lookup(key)
    if fp is not None:
        return fp, {**info, "hit": True}
    fp = perplexity(load_reference(), wins, ctx["batch"], "reference")
    timings["perplexity_reference"] = fp["seconds"]
    stored = refcache.store(key, fp)
    return fp, {**info, "hit": False, "stored": str(stored) if stored else None}


def _hash_reference(shared: dict, timings: dict) -> None:
    """The reference model's files' sha256 (the cache key's first part), once per base model."""
    if "model_sha256" not in shared:
        t0 = time.perf_counter()
        shared["model_sha256"] = refcache.model_sha256(shared["src"].path)
        timings["reference_hash"] = round(time.perf_counter() - t0, 2)


def _gates(ppl: dict | None, eopts) -> dict:
    failures = []
    if ppl is not None:
        broken = [f"{name} {ppl[k]['ppl']}" for k, name in (("fp16", "reference"), ("quantized", "quantized"))
                  if not math.isfinite(ppl[k]["ppl"])]
        if broken:
            failures.append(f"perplexity is not finite ({', '.join(broken)}): the model computes NaN or infinite "
                            f"logits, so no gate can pass")
        elif eopts.max_ppl_delta is not None and ppl["delta"] > eopts.max_ppl_delta:
            failures.append(f"perplexity delta {ppl['delta']:.4f} > eval.max_ppl_delta {eopts.max_ppl_delta}")
        if not broken and eopts.max_ppl_delta_pct is not None and ppl["delta_pct"] > eopts.max_ppl_delta_pct:
            failures.append(f"perplexity delta {ppl['delta_pct']:.2f}% > eval.max_ppl_delta_pct "
                            f"{eopts.max_ppl_delta_pct}%")
    return {"max_ppl_delta": eopts.max_ppl_delta, "max_ppl_delta_pct": eopts.max_ppl_delta_pct,
            "failures": failures, "passed": not failures}


def _context(artifact: Path, base_spec: str, manifest: dict, compute_dtype, cache: dict | None) -> dict:
    """What every step of one eval shares (and a comparison's variants of one base model reuse): the base
    model's source, tokenizer and files' sha256, the device, dtype and batch."""
    device = eval_device(manifest)
    served = served_dtype(artifact, manifest)
    dtype = compute_dtype or eval_dtype(device, served)
    shared = cache.setdefault((base_spec, str(device), str(dtype)), {}) if cache is not None else {}
    if "src" not in shared:
        shared["src"] = source.resolve(base_spec)
        shared["tokenizer"] = source.load_tokenizer(shared["src"])
    return {**shared, "device": device, "dtype": dtype, "served": served, "shared": shared}


def evaluate(artifact: Path, base_spec: str | None, eopts, compute_dtype: torch.dtype | None = None,
             cache: dict | None = None) -> dict:
    """Run the whole eval stage on `artifact` -> the report (`pipeline.stages.evaluate` writes it into the artifact).

    On the device that quantized it (CUDA: the artifact's 16-bit dtype; CPU: float32), one model on the device
    at a time: vLLM's smoke-load first (a child process), then the reference (only if the smoke test needs it
    or its perplexity is not cached), then the decoded artifact.
    cache: pass one dict to several calls on artifacts of the same base model (a comparison) so the base
    model's files are resolved and hashed once.
    """
    artifact = Path(artifact)
    manifest = manifest_file.read(artifact)
    base_spec = base_spec or manifest.get("model", {}).get("spec")
    if not base_spec:
        raise ValueError(f"{artifact}: no manifest names its base model; pass --base <model spec>")
    peak_reset = _reset_host_peak()
    timings: dict[str, float] = {}
    ctx = _context(artifact, base_spec, manifest, compute_dtype, cache)
    device, dtype = ctx["device"], ctx["dtype"]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    popts = eopts.perplexity
    proto = Protocol(dataset=popts.dataset, seq_len=popts.seq_len, max_windows=popts.max_windows)
    # three independent waits side by side: hashing the artifact's shards (verify), the reference's files (the
    # cache key) and tokenizing the eval text; nothing reads the artifact's weights before verify succeeds
    with ThreadPoolExecutor(max_workers=2) as pool:
        verifying = pool.submit(manifest_file.verify, artifact)  # refuses a tampered artifact, naming the file
        hashing = pool.submit(_hash_reference, ctx["shared"], timings)
        text, where = load_eval_text(popts.dataset)
        wins = windows(ctx["tokenizer"], text, proto)
        verified = verifying.result()
        hashing.result()
    if verified:  # the manifest as verified, for the fingerprint of the files this eval scores
        manifest = manifest_file.read(artifact)
    record = protocol_record(proto, text, where, wins)
    ctx["batch"] = batch_windows(device, proto.seq_len)
    log.info("eval on %s in %s: %d windows of %d tokens from %s, %d per forward", refcache.device_kind(device),
             str(dtype).removeprefix("torch."), wins.shape[0], proto.seq_len, where, ctx["batch"])
    held: dict = {}

    def load_reference():
        if "model" not in held:
            t0 = time.perf_counter()
            held["model"] = source.load_model(ctx["src"], dtype, device=device)
            timings["load_reference"] = round(time.perf_counter() - t0, 2)
        return held["model"]

    smoke_res: dict = {"skipped": "eval.vllm.enabled is false"}
    if eopts.vllm.enabled:
        why_not = vllm_unavailable()
        # the endpoint it would have asked on is recorded all the same (chat, or completions for a base model)
        smoke_res = {"skipped": why_not, "endpoint": serve_config.endpoint(artifact)} if why_not else None
        if smoke_res is None:
            t0 = time.perf_counter()
            smoke_res = smoke(artifact, load_reference, ctx["tokenizer"], ctx["served"], eopts.vllm.max_tokens,
                              eopts.vllm.min_token_agreement, eopts.vllm.timeout_s)
            timings["vllm_smoke"] = round(time.perf_counter() - t0, 2)
    fp, cache_info = _reference_ppl(ctx, load_reference, wins, record, timings)
    held.clear()
    _free(device)
    t0 = time.perf_counter()
    quantized = load_dequantized(artifact, dtype, device)
    timings["load_quantized"] = round(time.perf_counter() - t0, 2)
    q = perplexity(quantized, wins, ctx["batch"], "quantized")
    timings["perplexity_quantized"] = q["seconds"]
    del quantized
    _free(device)
    delta = q["ppl"] - fp["ppl"]
    ppl = {"protocol": record, "fp16": {k: fp[k] for k in ("ppl", "tokens", "seconds")},
           "quantized": {k: q[k] for k in ("ppl", "tokens", "seconds")},
           "delta": delta, "delta_pct": 100 * delta / fp["ppl"]}
    lm = _lm_eval(artifact, eopts.lm_eval, ctx["served"])
    gates = _gates(ppl, eopts)
    passed = gates["passed"] and smoke_res.get("passed", True)
    scored = {"device": refcache.device_kind(device), "dtype": str(dtype).removeprefix("torch."),
              "windows_per_forward": ctx["batch"], "reference_cache": cache_info,
              "host_rss_peak_bytes": _host_peak_bytes(),
              "host_rss_peak_scope": "eval stage" if peak_reset else "process lifetime",
              "device_peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}
    report = {
        "artifact": str(artifact), "manifest_verified": verified, "files_scored": manifest_file.files_fingerprint(manifest),
        "base_model": base_spec,
        "reference_dtype": scored["dtype"], "scored_on": scored,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
        "perplexity": ppl, "gates": gates, "vllm_smoke": smoke_res, "lm_eval": lm,
        "quantize_timings_s": manifest.get("timings_s"), "eval_timings_s": timings, "passed": passed,
    }
    return report


def render_markdown(r: dict) -> str:
    p, s = r["perplexity"], r["vllm_smoke"]
    lines = [
        f"# Evaluation report: `{Path(r['artifact']).name}`", "",
        f"Base model `{r['base_model']}` · {r['date']} · {r['machine']} · **{'PASSED' if r['passed'] else 'FAILED'}**",
        "", "## Perplexity", "",
        f"Protocol: {modelcard.protocol_sentence(p['protocol'])}; {modelcard.scored_sentence(r)}.",
        "",
        "| model | perplexity | Δ | Δ % |", "|---|---:|---:|---:|",
        f"| FP16 (base) | {p['fp16']['ppl']:.4f} | | |",
        f"| quantized (decoded from the artifact) | {p['quantized']['ppl']:.4f} | {p['delta']:+.4f} | "
        f"{p['delta_pct']:+.2f} |", "",
        f"Gates: max Δ {r['gates']['max_ppl_delta']}, max Δ% {r['gates']['max_ppl_delta_pct']}: "
        + ("passed" if r["gates"]["passed"] else "FAILED: " + "; ".join(r["gates"]["failures"])), "",
        "## vLLM smoke-load", "",
    ]
    if "skipped" in s:
        lines.append(f"Skipped: {s['skipped']}" + (f" (it would ask on `{s['endpoint']}`)" if s.get("endpoint") else ""))
    else:
        lines += [f"Result: **{'passed' if s['passed'] else 'FAILED'}**; checks: "
                  + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in s["checks"].items())]
        if s.get("served_name"):
            answer = s.get("answer") or {}
            lines += ["", f"Served by vLLM's OpenAI-compatible server as `{s['served_name']}` (start-up {s.get('load_s')} s); "
                      f"asked on `{s.get('endpoint')}` ({s.get('endpoint_why')}): {json.dumps(answer.get('prompt'))} "
                      f"-> {json.dumps(answer.get('content'))}; a wrong model name: {s.get('wrong_name', 'not tried')}"]
        if s["checks"].get("loaded"):
            lines += [f"Method `{s.get('method')}` (artifact declares `{s['expected_method']}`); kernels: "
                      f"{', '.join(s.get('kernels') or ['not logged'])}; load {s.get('load_s')} s; "
                      f"{s.get('tokens_per_s')} generated tokens/s; teacher-forced agreement with FP16: "
                      f"{s.get('token_agreement')}", "", "| prompt | completion |", "|---|---|"]
            for x in s.get("samples", []):
                esc = lambda t: t.replace("|", "\\|").replace("\n", "⏎")  # noqa: E731
                lines.append(f"| {esc(x['prompt'])} | {esc(x['completion'])} |")
        for e in s["errors"]:
            lines.append(f"\n- error: {e}")
    lines += ["", "## lm-eval", "", "```", json.dumps(r["lm_eval"], indent=1)[:2000], "```", "",
              "## Timings (s)", "", f"quantize: {r['quantize_timings_s']}", "", f"eval: {r['eval_timings_s']}", ""]
    return "\n".join(lines)

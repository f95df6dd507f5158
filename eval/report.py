"""The eval stage: perplexity FP16 vs quantized, vLLM smoke-load, optional lm-eval -> report.json / report.md.

Works on any vLLM-loadable directory (ours or another tool's): the quantized model is decoded from the
artifact's packed tensors; the FP16 reference is the base model (from our manifest, or given).
The report's sha256 is recorded in the artifact's manifest (rewritten atomically).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from quantize import modelcard, source
from quantize.calib import hub_offline
from quantize.export import MANIFEST, sha256_file

from .artifact import load_dequantized, verify_manifest
from .perplexity import Protocol, load_eval_text, perplexity, protocol_record, windows
from .smoke import smoke

log = logging.getLogger(__name__)


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{platform.machine()} {cpu}, {os.cpu_count()} cores, {gpu}"


def _lm_eval(artifact: Path, opts) -> dict:
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
               f"pretrained={artifact},dtype=float16,enforce_eager=True", "--tasks", ",".join(opts.tasks),
               "--output_path", work] + (["--limit", str(opts.limit)] if opts.limit else [])
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            return {"error": proc.stderr.strip().splitlines()[-5:], "exit_code": proc.returncode}
        found = sorted(Path(work).rglob("results*.json"))
        return json.loads(found[-1].read_text())["results"] if found else {"error": "no results file written"}


def _ppl_block(reference, quantized, tokenizer, popts, cache: dict) -> dict:
    proto = Protocol(dataset=popts.dataset, seq_len=popts.seq_len, max_windows=popts.max_windows)
    text, where = load_eval_text(popts.dataset)
    wins = windows(tokenizer, text, proto)
    log.info("perplexity: %d windows of %d tokens from %s", wins.shape[0], proto.seq_len, where)
    key = ("fp_ppl", proto)
    if key not in cache:  # the reference's perplexity is the same for every artifact of one base model
        cache[key] = perplexity(reference, wins)
    fp = cache[key]
    q = perplexity(quantized, wins)
    delta = q["ppl"] - fp["ppl"]
    return {"protocol": protocol_record(proto, text, where, wins),
            "fp16": {k: fp[k] for k in ("ppl", "tokens", "seconds")},
            "quantized": {k: q[k] for k in ("ppl", "tokens", "seconds")},
            "delta": delta, "delta_pct": 100 * delta / fp["ppl"]}


def _gates(ppl: dict | None, eopts) -> dict:
    failures = []
    if ppl is not None:
        if eopts.max_ppl_delta is not None and ppl["delta"] > eopts.max_ppl_delta:
            failures.append(f"perplexity delta {ppl['delta']:.4f} > eval.max_ppl_delta {eopts.max_ppl_delta}")
        if eopts.max_ppl_delta_pct is not None and ppl["delta_pct"] > eopts.max_ppl_delta_pct:
            failures.append(f"perplexity delta {ppl['delta_pct']:.2f}% > eval.max_ppl_delta_pct "
                            f"{eopts.max_ppl_delta_pct}%")
    return {"max_ppl_delta": eopts.max_ppl_delta, "max_ppl_delta_pct": eopts.max_ppl_delta_pct,
            "failures": failures, "passed": not failures}


def evaluate(artifact: Path, base_spec: str | None, eopts, compute_dtype: torch.dtype | None = None,
             cache: dict | None = None) -> dict:
    """Run the whole eval stage on `artifact` -> report dict (also written into the artifact).

    cache: pass one dict to several calls on artifacts of the same base model (a comparison) so the reference
    model is loaded, and its perplexity computed, once.
    """
    artifact = Path(artifact)
    verified = verify_manifest(artifact)  # refuses a tampered artifact before anything reads it
    manifest = json.loads((artifact / MANIFEST).read_text()) if (artifact / MANIFEST).is_file() else {}
    base_spec = base_spec or manifest.get("model", {}).get("spec")
    if not base_spec:
        raise ValueError(f"{artifact}: no manifest names its base model; pass --base <model spec>")
    dtype = compute_dtype or (torch.float16 if torch.cuda.is_available() else torch.float32)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    shared = cache.setdefault((base_spec, str(dtype)), {}) if cache is not None else {}
    if "reference" not in shared:
        src = source.resolve(base_spec)
        shared["reference"] = source.load_model(src, dtype)
        shared["tokenizer"] = source.load_tokenizer(src)
    reference, tokenizer = shared["reference"], shared["tokenizer"]
    quantized = load_dequantized(artifact, dtype)
    timings["load"] = round(time.perf_counter() - t0, 2)
    t0 = time.perf_counter()
    ppl = _ppl_block(reference, quantized, tokenizer, eopts.perplexity, shared)
    timings["perplexity"] = round(time.perf_counter() - t0, 2)
    del quantized
    smoke_res: dict = {"skipped": "eval.vllm.enabled is false"}
    if eopts.vllm.enabled:
        t0 = time.perf_counter()
        smoke_res = smoke(artifact, reference, tokenizer, eopts.vllm.max_tokens, eopts.vllm.min_token_agreement,
                          eopts.vllm.timeout_s)
        timings["vllm_smoke"] = round(time.perf_counter() - t0, 2)
    lm = _lm_eval(artifact, eopts.lm_eval)
    gates = _gates(ppl, eopts)
    passed = gates["passed"] and smoke_res.get("passed", True)
    report = {
        "artifact": str(artifact), "manifest_verified": verified, "base_model": base_spec, "reference_dtype": str(dtype).removeprefix("torch."),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": _machine(),
        "perplexity": ppl, "gates": gates, "vllm_smoke": smoke_res, "lm_eval": lm,
        "quantize_timings_s": manifest.get("timings_s"), "eval_timings_s": timings, "passed": passed,
    }
    write_report(artifact, report)
    return report


def render_markdown(r: dict) -> str:
    p, s = r["perplexity"], r["vllm_smoke"]
    lines = [
        f"# Evaluation report: `{Path(r['artifact']).name}`", "",
        f"Base model `{r['base_model']}` · {r['date']} · {r['machine']} · **{'PASSED' if r['passed'] else 'FAILED'}**",
        "", "## Perplexity", "",
        f"Protocol: {modelcard.protocol_sentence(p['protocol'])}; reference computed in {r['reference_dtype']}.",
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
        lines.append(f"Skipped: {s['skipped']}")
    else:
        lines += [f"Result: **{'passed' if s['passed'] else 'FAILED'}**; checks: "
                  + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in s["checks"].items())]
        if s["checks"].get("loaded"):
            lines += [f"", f"Method `{s.get('method')}` (artifact declares `{s['expected_method']}`); kernels: "
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


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_report(artifact: Path, report: dict) -> None:
    """report.json + report.md into the artifact; their sha256 into manifest.json (each write atomic)."""
    _atomic_write(artifact / "report.json", json.dumps(report, indent=2) + "\n")
    _atomic_write(artifact / "report.md", render_markdown(report))
    mpath = artifact / MANIFEST
    if mpath.is_file():
        m = json.loads(mpath.read_text())
        m["report"] = {n: sha256_file(artifact / n) for n in ("report.json", "report.md")}
        m["report"]["passed"] = report["passed"]
        if "recipe" in m:  # our artifact: its model card gains the measured numbers
            _atomic_write(artifact / "README.md", modelcard.render(m, report))
            m.setdefault("files", {})["README.md"] = {"sha256": sha256_file(artifact / "README.md"),
                                                      "bytes": (artifact / "README.md").stat().st_size}
        _atomic_write(mpath, json.dumps(m, indent=2) + "\n")


def report_hash_ok(artifact: Path) -> bool:
    m = json.loads((Path(artifact) / MANIFEST).read_text())
    return all(hashlib.sha256((Path(artifact) / n).read_bytes()).hexdigest() == h
               for n, h in m.get("report", {}).items() if n != "passed")

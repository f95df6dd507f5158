"""`make compare`'s serving columns: each variant behind vLLM's server (its vllm-serve.yaml), measured once by vLLM's
serving benchmark at the highest of its recipe's `serve.concurrency` levels (output tok/s, TTFT p50 / p95), with
the memory vLLM logs at start-up (weights, KV cache GiB and tokens); one server at a time.

On by default where vLLM's CUDA build runs; `--serving` measures on vLLM's CPU build too (where it serves 4-bit
weights: an AVX-512 CPU), `--no-serving` never. Another tool's directory (`--artifact`) is not served: it has no
vllm-serve.yaml, so its server's flags would not be those its row is compared with.
"""

from __future__ import annotations

import logging
import tempfile
from importlib.util import find_spec
from pathlib import Path

from eval.bench_serve import INPUT_LEN, OUTPUT_LEN
from eval.serve import ServeError, int4_kernel_missing
from eval.serving import MIN_PROMPTS, measure, num_prompts
from eval.vllm_run import cuda_build
from quantize.preflight.deploy import vllm_version

log = logging.getLogger(__name__)

NOT_OURS = "another tool's directory: no vllm-serve.yaml to serve it with the flags of the rows beside it"
# the main table's serving columns: (header, the row's serving key, format)
COLUMNS = (("output tok/s", "output_throughput", ".1f"), ("TTFT p95 ms", "p95_ttft_ms", ".1f"),
           ("weights GiB", "weights_gib", ".2f"), ("KV cache tokens", "kv_cache_tokens", ",d"))


def plan(serving: bool | None, do_eval: bool, variants: list) -> str | None:
    """Whether the comparison measures serving -> None where it does, else why not. serving: the command line's
    --serving (True) / --no-serving (False) / neither (None: on where vLLM's CUDA build runs and the comparison
    evaluates). A ServeError where --serving asks for what this host cannot do, told before any model loads."""
    if serving is False:
        return "--no-serving"
    if serving is None and not cuda_build():
        return ("vLLM's CUDA build does not run here (no CUDA device); --serving (make compare SERVING=1) measures "
                "on vLLM's CPU build where it serves 4-bit weights")
    if serving is None and not do_eval:
        return "--no-eval (no vLLM); --serving measures anyway"
    why = _cannot_serve(variants)
    if why and serving:
        raise ServeError(f"--serving: {why}; leave --serving out (make compare SERVING=0)")
    return why


def _cannot_serve(variants: list) -> str | None:
    if find_spec("vllm") is None:
        return "vllm is not importable in this environment (make venv installs it)"
    if any(v.w_bit == 4 for v in variants) and (why := int4_kernel_missing()):
        return f"vLLM cannot serve 4-bit weights on this host: {why}"
    return None


def settings(skipped: str | None) -> dict:
    """The comparison document's `serving` entry: why it was skipped, or the load every variant was measured under."""
    if skipped:
        return {"skipped": skipped}
    return {"skipped": None, "vllm": vllm_version(), "input_len": INPUT_LEN, "output_len": OUTPUT_LEN,
            "num_prompts": f"max(4 x concurrency, {MIN_PROMPTS})", "concurrency": "the recipe's highest "
            "serve.concurrency level", "dataset": "random", "ignore_eos": True}


def measure_all(pairs: list[tuple], external_dirs: list[Path] = ()) -> dict[str, dict]:
    """(recipe, artifact) pairs -> {artifact path: serving record} (eval.serving.measure's figures, `error` where
    its server or benchmark failed); other tools' directories get {"skipped": why}. Each server is stopped before
    the next starts."""
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="compare-serving-") as work:
        for i, (v, art) in enumerate(pairs, 1):
            c = max(v.serve.concurrency)
            log.info("serving %d/%d %s: vLLM's server, then its serving benchmark at concurrency %d (%d requests)",
                     i, len(pairs), v.name, c, num_prompts(c))
            r = measure(Path(art), c, Path(work))
            log.info("serving %s: %s", v.name, summary(r))
            out[str(art)] = r
    for d in external_dirs:
        out[str(d)] = {"skipped": NOT_OURS}
    return out


def summary(r: dict) -> str:
    """A serving record in one line, for the progress log."""
    if r.get("error"):
        return "FAILED: " + r["error"].strip().splitlines()[-1][:200]
    kv = f"{r['kv_cache_tokens']:,}" if r.get("kv_cache_tokens") is not None else "n/a"
    return (f"{r['output_throughput']:.1f} output tok/s, TTFT p95 {r['p95_ttft_ms']:.0f} ms, KV cache {kv} tokens "
            f"(server up in {r['load_s']:.0f} s)")


def measured(r: dict | None) -> bool:
    """Whether a row's serving record holds figures (not skipped, not failed)."""
    return bool(r) and not r.get("skipped") and not r.get("error") and r.get("output_throughput") is not None


def header(meta: dict) -> tuple[list[str], list[str]]:
    """The main table's serving headers and alignments, none where serving was skipped (or not recorded)."""
    s = meta.get("serving")
    if not s or s.get("skipped"):
        return [], []
    return [h for h, _, _ in COLUMNS], ["---:"] * len(COLUMNS)


def cells(r: dict, meta: dict) -> list[str]:
    """A row's serving cells: figures, "failed" or "—" (not served)."""
    if not header(meta)[0]:
        return []
    s = r.get("serving")
    if not measured(s):
        return [("failed" if s and s.get("error") else "—")] + ["—"] * (len(COLUMNS) - 1)
    return [("n/a" if s.get(k) is None else format(s[k], spec)) for _, k, spec in COLUMNS]


def notes(rows: list[dict], meta: dict) -> list[str]:
    """The lines under the table: why serving was skipped, or how it was measured, the figures the table leaves to
    the JSON, and each failure's reason."""
    s = meta.get("serving")
    if not s:
        return []
    if s.get("skipped"):
        return [f"Serving columns: skipped: {s['skipped']}.", ""]
    levels = sorted({r["serving"]["concurrency"] for r in rows if r.get("serving") and "concurrency" in r["serving"]})
    lines = [f"Serving columns: vLLM {s['vllm']}'s serving benchmark against each variant's own server (its "
             f"vllm-serve.yaml), one at a time: random prompts of {s['input_len']} tokens, {s['output_len']} output "
             f"tokens each (EOS ignored), max(4 x concurrency, 32) requests, at the recipe's highest serve.concurrency "
             f"(here {', '.join(map(str, levels)) or 'none'}). weights GiB, KV cache tokens: what vLLM logs at "
             f"start-up (the CPU build logs no weights figure: n/a).", "",
             "| variant | concurrency | requests | TTFT p50 ms | KV cache GiB | server start (s) |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        v = r.get("serving")
        if measured(v):
            lines.append(f"| {r['variant']} | {v['concurrency']} | {v['num_prompts']} | {v['p50_ttft_ms']:.1f} | "
                         f"{_fmt(v.get('kv_cache_gib'), '.2f')} | {_fmt(v.get('load_s'), '.1f')} |")
    lines.append("")
    for r in rows:
        v = r.get("serving") or {}
        if v.get("error"):
            lines += [f"**{r['variant']}: serving failed**:", "", "```", v["error"].strip(), "```", ""]
        elif v.get("skipped"):
            lines += [f"{r['variant']}: not served: {v['skipped']}.", ""]
        elif v.get("failed"):
            lines += [f"{r['variant']}: {v['failed']} of {v['num_prompts']} requests failed.", ""]
    return lines


def _fmt(v, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def panel(ax, rows: list[dict], meta: dict, colour, label) -> None:
    """Quality (mean KL to FP16) against output tokens/s, one labelled point per served variant: the plot's
    answer to "which group size". colour(row), label(row): the other panels' point colour and name."""
    pts = [r for r in rows if measured(r.get("serving")) and r.get("kl_mean") is not None]
    for r in pts:
        x = r["serving"]["output_throughput"]
        ax.scatter(x, r["kl_mean"], s=40, color=colour(r))
        ax.annotate(label(r), (x, r["kl_mean"]), textcoords="offset points", xytext=(5, 4), fontsize=8)
    conc = sorted({r["serving"]["concurrency"] for r in pts})
    ax.set_xlabel(f"output tokens/s (vLLM serving benchmark, concurrency {', '.join(map(str, conc)) or '—'})")
    ax.set_ylabel("mean KL(FP16 || variant) (nats)")
    ax.grid(alpha=0.3)
    s = meta.get("serving") or {}
    failed = [r["variant"] for r in rows if (r.get("serving") or {}).get("error")]
    if not pts:
        why = f"serving: skipped: {s['skipped']}" if s.get("skipped") else "not measured (eval or serving off)"
        ax.text(0.5, 0.5, why, ha="center", va="center", wrap=True, fontsize=8, transform=ax.transAxes)
    ax.set_title("quality against serving speed", fontsize=9)
    if failed:
        ax.set_title("serving failed: " + ", ".join(failed), fontsize=8, color="tab:red", loc="right")

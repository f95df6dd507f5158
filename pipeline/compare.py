"""Side-by-side comparison of artifacts (a group-size sweep, say): one row per variant -> .md, .json and a plot.

Sizes come from the files themselves (safetensors headers), quality from each artifact's report.json, and
times from each manifest, so the comparison can be rebuilt from the artifact directories alone.
"""

from __future__ import annotations

import json
import logging
import struct
import time
from datetime import datetime, timezone
from pathlib import Path

from quantize import formats, manifest, methods, runner
from quantize.export.modelcard import protocol_sentence
from quantize.paths import child
from quantize.recipe import AUTO, RecipeError, load_variants
from quantize.records import Manifest, Report
from quantize.lock import output_lock

from eval.readable import machine, seconds_text

from . import compare_serving, external
from .stages import BaseHashes, evaluate

log = logging.getLogger(__name__)

PACKED = tuple(sorted({f.packed_tensor for f in formats.REGISTRY.values()}))  # every format's int32 code tensor


def _header(path: Path) -> dict:
    """A safetensors file's header: tensor name -> {dtype, shape, data_offsets}."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def sizes(artifact: Path, w_bit: int) -> dict:
    """Bytes on disk and effective bits per weight, from the safetensors headers -> dict.

    bits_per_weight: all bytes of the quantized linears (codes, scales, zeros, g_idx) x 8 / their weights;
    model_bits_per_weight: every weight file's bytes x 8 / every parameter of the model.
    """
    artifact = Path(artifact)
    per_module: dict[str, int] = {}
    weights = {"quantized": 0, "other": 0}
    tensor_bytes = 0
    headers = {}
    for f in sorted(artifact.glob("*.safetensors")):
        headers.update(_header(f))
    modules = {n.rsplit(".", 1)[0] for n in headers if n.rsplit(".", 1)[-1] in PACKED}
    for name, rec in headers.items():
        numel = 1
        for d in rec["shape"]:
            numel *= d
        nbytes = rec["data_offsets"][1] - rec["data_offsets"][0]
        tensor_bytes += nbytes
        module, suffix = name.rsplit(".", 1) if "." in name else ("", name)
        if module in modules:
            per_module[module] = per_module.get(module, 0) + nbytes
            if suffix in PACKED:
                weights["quantized"] += numel * 32 // w_bit
        else:
            weights["other"] += numel
    q_bytes = sum(per_module.values())
    on_disk = sum(p.stat().st_size for p in artifact.rglob("*") if p.is_file())
    return {"bytes_on_disk": on_disk,
            "weight_file_bytes": sum(p.stat().st_size for p in artifact.glob("*.safetensors")),
            "quantized_linears": len(modules), "quantized_weights": weights["quantized"],
            "bits_per_weight": 8 * q_bytes / weights["quantized"] if weights["quantized"] else None,
            "model_bits_per_weight": 8 * tensor_bytes / (weights["quantized"] + weights["other"])}


def source_bytes(m: Manifest) -> int | None:
    """Bytes of the FP16 source checkpoint's weight files (the 16-bit reference point), if still on disk."""
    resolved = Path(m.model.resolved or "")
    files = list(resolved.glob("*.safetensors")) if m.model.resolved and resolved.is_dir() else []
    return sum(f.stat().st_size for f in files) or None


def row(artifact: Path) -> dict:
    """One comparison row from an artifact directory (its manifest, report and files)."""
    artifact = Path(artifact)
    m = manifest.read(artifact)
    if m is None:
        raise manifest.ArtifactError(f"{artifact}: no {manifest.MANIFEST}; compare reads artifacts written by "
                                     f"make quantize")
    rec = m.recipe
    t = m.timings_s or {}
    return {
        "variant": m.artifact, "artifact": str(artifact), "external": False, "tool": None, "method": rec.method,
        "w_bit": rec.w_bit, "group_size": m.group_text() if m.mixed else rec.q_group_size, "zero_point": rec.zero_point, "format": m.format.name,
        **sizes(artifact, rec.w_bit), **_figures(manifest.read_report(artifact)),
        "quantize_s": t.get("quantize"), "pipeline_s": round(sum(t.values()), 3) if t else None,
        "base_model": m.model.spec, "source_bytes": source_bytes(m),
        "h100_tp1_kernel": m.deploy.kernels.get("9.0", {}).get("1") if m.deploy else None,
    }


def external_row(artifact: Path, rep: Report | None, base_spec: str) -> dict:
    """The row of another tool's directory: its figures from `rep` (scored against `base_spec`), its
    quantization from config.json, no times or kernel (no manifest of ours records them)."""
    artifact = Path(artifact)
    d = external.describe(artifact)
    return {
        "variant": artifact.name, "artifact": str(artifact), "external": True, "tool": d["tool"], "method": None,
        "w_bit": d["w_bit"], "group_size": d["group_size"], "zero_point": d["zero_point"], "format": d["format"],
        "format_title": d["format_title"], **sizes(artifact, d["w_bit"]), **_figures(rep),
        "quantize_s": None, "pipeline_s": None, "base_model": base_spec, "source_bytes": None,
        "h100_tp1_kernel": None,
    }


def _figures(rep: Report | None) -> dict:
    """A report's perplexity, distribution and vLLM smoke columns (None each before an eval)."""
    ppl = rep.perplexity if rep is not None else None
    smoke = rep.vllm_smoke if rep is not None else None
    dist = rep.distribution if rep is not None else None
    return {
        "ppl_fp16": ppl.fp16.ppl if ppl else None, "ppl": ppl.quantized.ppl if ppl else None,
        "delta_ppl": ppl.delta if ppl else None, "delta_ppl_pct": ppl.delta_pct if ppl else None,
        "vllm_smoke": ("not run" if smoke is None else "skipped" if smoke.skipped is not None
                       else "passed" if smoke.passed else "FAILED"),
        "token_agreement": smoke.token_agreement if smoke else None,
        **{k: getattr(dist, k) if dist else None for k in ("kl_mean", "kl_p99", "top1")},
        "eval_passed": None if rep is None else rep.passed,
        "protocol": ppl.protocol.to_json() if ppl else None,
        "lm_eval": _lm_eval_figures(rep.lm_eval if rep is not None else None),
    }


def _lm_eval_figures(lm) -> list[dict]:
    """A report's lm-eval scores, one entry per task and metric: both models', the Δ and its paired stderr."""
    if lm is None or lm.quantized is None or lm.reference is None:
        return []
    out = []
    for task, metrics in lm.quantized.scores.items():
        for m, v in metrics.items():
            p = lm.paired.get(task, {}).get(m)
            out.append({"task": task, "metric": m, "fp16": lm.reference.scores.get(task, {}).get(m), "quantized": v,
                        "delta": lm.difference.get(task, {}).get(m), "stderr": p.stderr if p else None,
                        "n": p.n if p else None, "distinguishable": p.distinguishable if p else None})
    return out


def _lm_eval_md(rows: list[dict]) -> list[str]:
    """The comparison's lm-eval table: each variant's score beside FP16's on the same documents, the Δ with its
    paired stderr, and whether Δ is distinguishable from zero (|Δ| > 1.96 stderr)."""
    found = [(r["variant"], x) for r in rows for x in r.get("lm_eval") or []]
    if not found:
        return []
    lines = ["lm-eval (the same documents for FP16 and every variant; stderr paired over them):", "",
             "| variant | task | metric | documents | FP16 | variant | Δ | ± paired stderr | distinguishable |",
             "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for variant, x in found:
        dist = "n/a" if x["distinguishable"] is None else "yes" if x["distinguishable"] else "no"
        lines.append(f"| {variant} | {x['task']} | {x['metric']} | {_fmt(x['n'], 'd')} | {_fmt(x['fp16'], '.4f')} | "
                     f"{_fmt(x['quantized'], '.4f')} | {_fmt(x['delta'], '+.4f')} | {_fmt(x['stderr'], '.4f')} | "
                     f"{dist} |")
    return lines + [""]


def _label(r: dict) -> str:
    """A row's method as the table and plot name it: ours by method, another tool's directory by its tool."""
    return r["method"] if not r.get("external") else f"external: {r['tool'] or 'tool not named in config.json'}"


def _fmt(v, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def render_markdown(name: str, rows: list[dict], meta: dict) -> str:
    proto = next((r["protocol"] for r in rows if r["protocol"]), None)
    fp = next((r["ppl_fp16"] for r in rows if r["ppl_fp16"] is not None), None)
    lines = [f"# Comparison `{name}`", "", f"Base model `{rows[0]['base_model']}` · {meta['date']} · {meta['machine']}",
             ""]
    if proto:
        lines += [f"Perplexity protocol: {protocol_sentence(proto)}; FP16 perplexity {fp:.4f}.", ""]
    heads, aligns = compare_serving.header(meta)  # output tok/s, TTFT p95, weights, KV tokens, where served
    lines += ["| variant | method | bits | group | format | size on disk (MB) | bits / weight | ppl | Δppl | Δ% "
              "| KL mean | KL p99 | top-1 | quantize (s) | vLLM smoke | H100 TP 1 kernel |" + "".join(
                  f" {h} |" for h in heads),
              "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|" + "|".join(aligns)
              + ("|" if aligns else "")]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {_label(r)} | {r['w_bit']} | {r['group_size']} | {r['format']} | "
            f"{r['bytes_on_disk'] / 1e6:.2f} | {_fmt(r['bits_per_weight'], '.3f')} | {_fmt(r['ppl'], '.4f')} | "
            f"{_fmt(r['delta_ppl'], '+.4f')} | {_fmt(r['delta_ppl_pct'], '+.2f')} | {_fmt(r.get('kl_mean'), '.4f')} | "
            f"{_fmt(r.get('kl_p99'), '.4f')} | {_fmt(r.get('top1'), '.4f')} | {_fmt(r['quantize_s'], '.1f')} | "
            f"{r['vllm_smoke']} | {r.get('h100_tp1_kernel') or 'n/a'} |" + "".join(
                f" {c} |" for c in compare_serving.cells(r, meta)))
    lines += ["", "KL: mean and p99 per-token KL(FP16 || variant) in nats on the perplexity windows (over the FP16 "
              "model's top-k tokens and the rest as one bucket: a lower bound); top-1: share of tokens whose most "
              "likely next token agrees with FP16's.",
              "", "bits / weight: every byte of the quantized linears (codes, scales, zeros) x 8 / their weights. "
              "quantize (s): this variant's own share of the shared layer-by-layer pass.", ""]
    lines += _lm_eval_md(rows)
    lines += compare_serving.notes(rows, meta)
    outside = [r for r in rows if r.get("external")]
    if outside:
        lines += ["External: directories another tool wrote (no manifest of ours), scored against the same base "
                  "model on the same protocol; what they are comes from their config.json's quantization_config:", ""]
        lines += [f"- {r['variant']}: {r['tool'] or 'tool not named'}, {r['format_title']}, `{r['artifact']}`"
                  for r in outside]
        lines.append("")
    if meta.get("timings_s"):
        lines += [f"Timings of this comparison run: {seconds_text(meta['timings_s'])}", ""]
    lines += [f"![Δppl against bits per weight and size, KL against bits per weight and against output "
              f"tokens/s]({name}.png)", ""]
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str, meta: dict | None = None) -> None:
    """Perplexity increase (%) against bits per weight and against size on disk, mean KL against bits per
    weight and against served output tokens/s (or why serving was not measured), one labelled point per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, grid = plt.subplots(2, 2, figsize=(12, 8.4))
    axes = grid.flatten()
    for ax, key, label, y, ylabel in (
            (axes[0], "bits_per_weight", "effective bits per weight (quantized linears)", "delta_ppl_pct",
             "perplexity increase vs FP16 (%)"),
            (axes[1], "bytes_on_disk", "size on disk (MB)", "delta_ppl_pct", "perplexity increase vs FP16 (%)"),
            (axes[2], "bits_per_weight", "effective bits per weight (quantized linears)", "kl_mean",
             "mean KL(FP16 || variant) (nats)")):
        pts = [r for r in rows if r.get(y) is not None]
        for r in pts:
            x = r[key] / 1e6 if key == "bytes_on_disk" else r[key]
            ax.scatter(x, r[y], s=40, color=_colour(r["method"]), marker="^" if r.get("external") else "o")
            ax.annotate(_point_label(r), (x, r[y]), textcoords="offset points", xytext=(5, 4), fontsize=8)
        ax.set_xlabel(label)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if not pts:
            ax.text(0.5, 0.5, "not measured (eval off)", ha="center", transform=ax.transAxes)
    compare_serving.panel(axes[3], rows, meta or {}, lambda r: _colour(r["method"]), _point_label)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _point_label(r: dict) -> str:
    """A row's name beside its point: method (another tool's: its tool or directory) and group size."""
    who = (r["tool"] or r["variant"]) if r.get("external") else r["method"]
    return f"{who} g{r['group_size']}"


def write_comparison(name: str, artifacts: list[Path], out_root: Path, extra: dict | None = None,
                     external_rows: list[dict] = (), serving: dict | None = None) -> dict:
    """compare-<name>.json / .md / .png under out_root -> the JSON document. external_rows: `external_row`s,
    after our variants'. serving: {artifact path: serving record} (`compare_serving.measure_all`), each row's
    `serving` (None where not measured); extra["serving"] says how, or why it was skipped."""
    rows = [row(a) for a in artifacts] + list(external_rows)
    for r in rows:
        r["serving"] = (serving or {}).get(r["artifact"])
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(), **(extra or {})}
    doc = {"name": name, **meta, "rows": rows}
    out_root = Path(out_root)
    out_root.mkdir(parents=True, exist_ok=True)
    stem = comparison_stem(out_root, name)
    stem.with_name(f"{stem.name}.json").write_text(json.dumps(doc, indent=2) + "\n")
    stem.with_name(f"{stem.name}.md").write_text(render_markdown(f"compare-{name}", rows, meta))
    plot(rows, stem.with_name(f"{stem.name}.png"), f"compare-{name}: {rows[0]['base_model']}", meta)
    log.info("wrote %s.{json,md,png}", stem)
    return doc


def comparison_stem(out_root: Path, name: str) -> Path:
    """out_root/compare-<name> (its .json, .md, .png); UnsafePathError if the name leads outside out_root."""
    path = child(out_root, f"compare-{name}.json", "comparison --name")
    return path.with_name(path.name.removesuffix(".json"))


def default_name(names: list[str]) -> str:
    """The recipes' common dash-separated prefix (qwen7b-awq-g32, qwen7b-awq-g64 -> qwen7b-awq)."""
    if len(names) == 1:
        return names[0]
    parts = [n.split("-") for n in names]
    common = []
    for group in zip(*parts):
        if len(set(group)) > 1:
            break
        common.append(group[0])
    return "-".join(common) or "-".join(names)[:80]


def run_comparison(recipe_names: list[str], out_root: Path, force: bool = False, do_eval: bool = True,
                   name: str | None = None, external_dirs: list[Path] = (),
                   serving: bool | None = None) -> tuple[dict, int]:
    """Quantize every variant (one shared pass per model/calibration), evaluate each, measure each behind vLLM's
    server (`compare_serving`), write the comparison.
    external_dirs: other tools' directories, scored after the variants against their base model on their
    protocol, one row each. serving: True / False force the serving columns on / off; None: on where vLLM's
    CUDA build runs (`compare_serving.plan`).

    -> (comparison document, exit code: 0, or 3 when any variant's eval gate, vLLM smoke or serving benchmark
    failed; another tool's directory that fails a gate shows it in its row and changes no exit code).
    """
    variants = [v for n in recipe_names for v in load_variants(n)]  # every variant validated before any load
    auto = [v.name for v in variants if v.method == AUTO]
    if auto:
        raise RecipeError(f"{auto[0]}: method {AUTO} writes the one artifact it chooses; to compare methods side by "
                          f"side, give compare one recipe per method (its card lists each candidate's held-out KL)")
    name = name or default_name([Path(n).stem for n in recipe_names])
    comparison_stem(out_root, name)  # a --name that leads outside --out is refused before any work
    external_dirs = [Path(d) for d in external_dirs]
    base, eopts = _external_plan(variants, external_dirs)  # a directory of another model is refused now too
    skip_serving = compare_serving.plan(serving, do_eval, variants)  # --serving where it cannot: refused now
    groups: dict[tuple, list] = {}
    for v in variants:
        groups.setdefault(runner.share_key(v), []).append(v)
    if len(groups) > 1:
        log.warning("%d groups of recipes differ in %s and cannot share a pass; each group runs on its own",
                    len(groups), ", ".join(runner.SHARED_KEYS))
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    artifacts, hashes, cache = [], BaseHashes(), {}  # each group's base model hashed during its pass, for the evals
    failed = []
    try:
        for group in groups.values():
            log.info("shared pass: %s", ", ".join(v.name for v in group))
            artifacts += runner.run_many(group, out_root, force,
                                         before_weights=hashes.before_weights if do_eval else None)
        timings["quantize_all"] = round(time.perf_counter() - t0, 2)
        t0 = time.perf_counter()
        if do_eval:
            for v, art in zip([v for g in groups.values() for v in g], artifacts):
                if v.eval.enabled:
                    log.info("eval %s", v.name)
                    if not evaluate(art, None, v.eval, cache=cache, hashes=hashes).passed:
                        failed.append(v.name)
        outside = [external_row(d, _external_report(d, base, eopts, do_eval, cache, hashes), base)
                   for d in external_dirs]
        if do_eval:
            timings["eval_all"] = round(time.perf_counter() - t0, 2)
    finally:
        hashes.cancel()
    served = {}
    if skip_serving is None:
        cache.clear()  # the reference's scores and tokenizer: vLLM's server wants the memory
        t0 = time.perf_counter()
        served = compare_serving.measure_all(list(zip([v for g in groups.values() for v in g], artifacts)),
                                             external_dirs)
        timings["serving_all"] = round(time.perf_counter() - t0, 2)
    serve_failed = [Path(a).name for a, r in served.items() if r.get("error")]
    doc = write_comparison(name, artifacts, Path(out_root), {
        "recipes": recipe_names, "timings_s": timings, "eval_failed": failed, "serving_failed": serve_failed,
        "serving": compare_serving.settings(skip_serving)}, outside, served)
    return doc, 3 if failed or serve_failed else 0


def _external_plan(variants: list, dirs: list[Path]) -> tuple[str | None, object]:
    """The base model and eval options other tools' directories are scored with: the comparison's own (the first
    evaluating variant's protocol); each directory checked against that model before any work."""
    if not dirs:
        return None, None
    models = sorted({v.model for v in variants})
    if len(models) > 1:
        raise manifest.ArtifactError(f"--artifact: the recipes name {len(models)} base models ({', '.join(models)}): "
                                     f"compare another tool's directory with recipes of the one model it was made "
                                     f"from")
    external.check(dirs, models[0])
    return models[0], next((v.eval for v in variants if v.eval.enabled), variants[0].eval)


def _external_report(d: Path, base: str, eopts, do_eval: bool, cache: dict, hashes: BaseHashes) -> Report | None:
    """Another tool's directory scored as `eval --artifact DIR --base MODEL` scores it, its report written into
    it; without an eval, a report already there that scored it alike, else None."""
    if do_eval and eopts.enabled:
        log.info("eval %s (another tool's directory, against %s)", d, base)
        with output_lock(d):  # as the eval command: no run replaces it while it is scored
            return evaluate(d, base, eopts, cache=cache, hashes=hashes)
    try:
        rep = manifest.read_report(d)
    except manifest.ArtifactError:
        return None  # a report this version cannot read is no figure of this comparison
    return rep if external.scored_alike(rep, base, eopts) else None


def _colour(method: str | None) -> str:
    """A method's colour in the comparison plot (grey for one not registered in this process, or another tool's
    directory)."""
    return methods.REGISTRY[method].colour if method in methods.REGISTRY else "tab:gray"

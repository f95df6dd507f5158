"""The text table of bench/gpu_bench.py's report: ours vs llm-compressor per stage, per layer, peak memory; our
first layers' breakdown.

    python bench/bench_table.py gpu_bench.json     # re-print the table of a saved report

Stage mapping: ours "load" = preflight + load, "calibrate+quantize" = our calibrate + quantize stages
against llm-compressor's whole `oneshot` call, "save" = our export against save_pretrained. The ratio is
peer / ours: above 1 means ours takes less time or memory.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

FIRST_LAYERS = 2  # the layers whose breakdown the table prints


def _ours_rows(r: dict) -> dict[str, float | None]:
    s = r["stages_s"]
    return {"load (s)": s.get("preflight", 0) + s.get("load", 0),
            "calibrate+quantize (s)": s.get("calibrate", 0) + s.get("quantize", 0),
            "save (s)": s.get("export"), "process total (s)": r["process_s"],
            "per layer (s)": r["per_layer"]["mean_s"], "peak GPU alloc (GiB)": r["peak_gpu_alloc_gib"],
            "peak GPU reserved (GiB)": r["peak_gpu_reserved_gib"], "peak RSS (GiB)": r["peak_rss_gib"]}


def _peer_rows(r: dict) -> dict[str, float | None]:
    s = r["stages_s"]
    return {"load (s)": s["load"], "calibrate+quantize (s)": s["oneshot"], "save (s)": s["save"],
            "process total (s)": r["process_s"], "per layer (s)": r["oneshot_per_layer_s"],
            "peak GPU alloc (GiB)": r["peak_gpu_alloc_gib"], "peak GPU reserved (GiB)": r["peak_gpu_reserved_gib"],
            "peak RSS (GiB)": r["peak_rss_gib"]}


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)


def _pair(method: str, ours: dict | None, peer: dict | None) -> list[str]:
    head = f"{method:28s} {'ours':>10s} {'llm-compr.':>10s} {'peer/ours':>10s}"
    lines = [head, "-" * len(head)]
    a = _ours_rows(ours) if ours and ours["ok"] else {}
    b = _peer_rows(peer) if peer and peer["ok"] else {}
    for key in (a or b):
        x, y = a.get(key), b.get(key)
        ratio = f"{y / x:.2f}" if x and y is not None else "-"
        lines.append(f"{key:28s} {_fmt(x):>10s} {_fmt(y):>10s} {ratio:>10s}")
    for label, r in (("ours", ours), ("llm-compressor", peer)):
        if r is not None and not r["ok"]:
            lines.append(f"{label}: FAILED (rc {r.get('rc')}); see log_tail in the JSON")
    if a and b:
        same = ours["calibration"]["samples_sha256"] == peer["calibration"]["samples_sha256"]
        lines.append(f"same calibration token blocks: {'yes' if same else 'NO'}")
    return lines


GOALS = {"awq": 1.5, "gptq": 2.5}  # a comparison of three group sizes against one run's quantize stage


def _compare(method: str, c: dict) -> list[str]:
    """A shared pass of three group sizes against one run and against the three runs alone (`compare_summary`)."""
    goal = GOALS.get(method)
    ok = lambda cond: "met" if cond else "NOT met"  # noqa: E731
    shares = ", ".join(f"{k.rsplit('-', 1)[-1]} {v:.1f}" for k, v in c["per_variant_s"].items())
    alone = ", ".join(f"{k.rsplit('-', 1)[-1]} {v:.1f}" for k, v in c["alone_quantize_s"].items())
    lines = [f"{method.upper()} comparison of {len(c['per_variant_s'])} group sizes in one pass (quantize stage)",
             f"  shared pass {c['compare_quantize_s']:.1f} s (variants' shares: {shares}; pass parts: "
             f"{c['pass_seconds']})",
             f"  alone: {alone}; sum {c['separate_quantize_s']:.1f} s",
             f"  pass / one run {c['compare_over_one_run']:.2f}x (goal <= {goal}x: "
             f"{ok(goal is None or c['compare_over_one_run'] <= goal)}); pass / runs alone "
             f"{c['compare_over_separate']:.2f}x (goal <= 1: {ok(c['compare_over_separate'] <= 1)})",
             f"  processes: shared {c['compare_process_s']:.1f} s, alone {c['separate_process_s']:.1f} s in all",
             "  weights byte-identical to the run alone: "
             + ", ".join(f"{k.rsplit('-', 1)[-1]} {'yes' if v else 'NO'}" for k, v in c["byte_identical"].items())]
    return lines


def _big(job: str, r: dict) -> list[str]:
    if not r["ok"]:
        return [f"{job}: FAILED (rc {r.get('rc')}); see log_tail in the JSON"]
    e = r.get("extrapolated") or {}
    return [f"{job}: {e.get('measured_layers')} layers measured, {_fmt(e.get('per_layer_s'))} s/layer -> "
            f"quantize ~{_fmt(e.get('quantize_s'))} s for {e.get('total_layers')} layers; peak GPU alloc "
            f"{_fmt(r['peak_gpu_alloc_gib'])} GiB (reserved {_fmt(r['peak_gpu_reserved_gib'])}; all layers: at most "
            f"{_fmt(e.get('peak_gpu_alloc_bound_gib'))}), peak RSS {_fmt(r['peak_rss_gib'])} GiB"]


def _first_layers(job: str, r: dict, n: int = FIRST_LAYERS) -> list[str]:
    """Our first layers' seconds side by side (upload, FP forward, jobs; each method stage's parts), and the
    device code's record: where a first layer's one-time costs went."""
    layers = ((r.get("runlog") or {}).get("layers") or [])[:n] if r["ok"] else []
    if not layers:
        return []
    head = f"{job + ', first layers (s)':44s}" + "".join(f"{'layer ' + str(x['index'] + 1):>10s}" for x in layers)
    lines = [head, "-" * len(head), f"{'whole layer':44s}" + "".join(f"{_fmt(x['seconds']):>10s}" for x in layers)]
    for key in dict.fromkeys(k for x in layers for k in x["parts"]):
        lines.append(f"{key:44s}" + "".join(f"{_fmt(x['parts'].get(key)):>10s}" for x in layers))
    rows: dict[str, list] = {}
    for i, x in enumerate(layers):
        for st in x["stages"]:
            names = "+".join(n.rsplit(".", 1)[-1] for n in st["stage"].split("+"))  # q_proj+k_proj+v_proj
            for part, v in st["seconds"].items():
                rows.setdefault(f"{names}: {part}", [None] * len(layers))[i] = v
    for label, values in rows.items():
        lines.append(f"{label:44s}" + "".join(f"{_fmt(v):>10s}" for v in values))
    device = r["runlog"].get("device")
    if device:
        lines.append(f"device: {json.dumps(device, sort_keys=True)}")
    return lines


def table(report: dict) -> str:
    runs = report["runs"]
    gpu = next((r.get("gpu") for r in runs.values() if r.get("ok")), None)
    lines = [f"gpu_bench {report['date']}  device {report['device']} ({gpu or 'no GPU'})  calibration "
             f"{report['calibration']['n_samples']} x {report['calibration']['seq_len']} tokens"]
    for name, b in report["builds"].items():
        built = f"{b['params'] / 1e9:.2f} B params, build {b['build_s']} s{' (reused)' if b['reused'] else ''}"
        lines.append(f"checkpoint {name}: {built if b['ok'] else 'BUILD FAILED'}")
    for method, title in (("awq", "AWQ"), ("gptq", "GPTQ"), ("gptq-warm", "GPTQ re-run (Triton cache warm)"),
                          ("awq-warm", "AWQ re-run (Triton cache warm)"),
                          ("gptq-onepass", "GPTQ one pass (true_seq off)"), ("gptq-tf32", "GPTQ update tf32"),
                          ("awq-classic", "AWQ classic clip, RTN"), ("awq-gptq", "AWQ + GPTQ rounding")):
        ours, peer = runs.get(f"ours-{method}"), runs.get(f"llmc-{method.split('-')[0]}")
        if ours or (peer and method in ("awq", "gptq")):
            lines += [""] + _pair(title, ours, peer)
            if ours:
                lines += _first_layers(f"ours-{method}", ours)
    ar = runs.get("autoround-awq")
    if ar:
        x = ar.get("extrapolated")
        lines += ["", f"AutoRound default, w4 g128 asym: {'FAILED rc=' + str(ar.get('rc')) if not ar['ok'] else ''}"
                  + (f"quantize_and_save {ar['quantize_and_save_s']} s, process {ar['total_s']} s" if ar["ok"] else "")
                  + (f"; {x['per_layer_s']} s a layer x {x['total_layers']} layers = {x['quantize_and_save_s']} s"
                     if x else "")]
    for method, c in (report.get("compare") or {}).items():
        lines += [""] + _compare(method, c)
    big = [(j, r) for j, r in runs.items() if "72b" in j]
    if big:
        lines.append("")
        for j, r in big:
            lines += _big(j, r)
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(json.loads(Path(sys.argv[1]).read_text())))

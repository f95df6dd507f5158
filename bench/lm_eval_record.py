"""An eval's lm-eval figures as a benchmark record: each task's scores for the FP16 base and the artifact on the
same documents, the Δ with its paired stderr and whether it is distinguishable from zero, each score's own stderr
(binomial, sqrt(p (1 - p) / n)), the documents scored, the seconds each side took, and the machine.

    python bench/lm_eval_record.py ARTIFACT --command "the eval's command line" --record NAME
        -> bench/results/NAME.json (read from ARTIFACT/report.json)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.serve_load import machine  # noqa: E402
from quantize.records import Report  # noqa: E402


def figures(rep: Report) -> dict:
    """report.json -> {task: {documents, doc_ids (first and last), metric: {fp16, quantized, stderrs, Δ, paired}}}."""
    lm = rep.lm_eval
    out = {}
    for task, metrics in lm.quantized.scores.items():
        ids = lm.quantized.outcomes.get(task, {}).get("doc_id", [])
        row = {"documents": len(ids), "first_doc_ids": ids[:5]}
        for m, q in metrics.items():
            ref, p = lm.reference.scores[task][m], lm.paired[task][m]
            n = p.n
            row[m] = {"fp16": ref, "quantized": q, "fp16_stderr": (ref * (1 - ref) / n) ** 0.5,
                      "quantized_stderr": (q * (1 - q) / n) ** 0.5, "delta": p.delta,
                      "delta_paired_stderr": p.stderr, "distinguishable": p.distinguishable}
        out[task] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--command", required=True, help="the command that wrote the report")
    ap.add_argument("--record", required=True, help="write bench/results/NAME.json")
    args = ap.parse_args()
    rep = Report.model_validate_json((args.artifact / "report.json").read_text())
    t = rep.eval_timings_s or {}
    record = {"date": rep.date, "machine": machine(Path("/proc/cpuinfo").read_text()), "report_machine": rep.machine,
              "command": args.command, "artifact": str(args.artifact), "base_model": rep.base_model, "tasks": rep.lm_eval.tasks,
              "subset": rep.lm_eval.subset, "limit": rep.lm_eval.limit, "scored_on": rep.scored_on.device,
              "dtype": rep.scored_on.dtype, "reference_cached": rep.lm_eval.reference.cached,
              "seconds": {"fp16": t.get("lm_eval_reference"), "quantized": t.get("lm_eval_quantized")},
              "lm_eval": figures(rep)}
    out = ROOT / "bench" / "results" / f"{args.record}.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record["lm_eval"], indent=1))
    print(f"record: {out}")


if __name__ == "__main__":
    main()

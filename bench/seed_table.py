"""The serving table of the vLLM tuning article this project started from, with our artifacts, on one CUDA GPU.

    python bench/seed_table.py --fp16 CKPT --awq ART --gptq ART [--awq-g64 ART] --out DIR [--budget-gb 38] [--resume]

Rows (each its own vLLM server, started and stopped in turn, then measured by vLLM's own serving benchmark under
the article's load: concurrency 32, 128 requests, 256 streamed output tokens, EOS ignored):
  FP16, max-num-seqs 32 | AWQ g128, 32 | AWQ g128, 128 + fp8 KV cache | GPTQ g128, 128 + fp8 KV | AWQ g64, 128 + fp8 KV
on a memory budget (`gpu_memory_utilization` = budget / the GPU's memory: 38 GB is the article's A100 40G) and,
with --whole-gpu, again at vLLM's default utilization. Per row: output tok/s, TTFT p50/p95, the weights' memory and
KV cache size vLLM logs, and its KV cache in tokens. -> DIR/seed-table.json and DIR/seed-table.md
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eval.bench_serve import bench_command  # noqa: E402
from eval.serve import Server  # noqa: E402
from eval.serving import log_figures  # noqa: E402
from eval.vllm_run import VllmError, root_cause, vllm_env  # noqa: E402
from quantize.export.capacity import kv_bytes_per_token  # noqa: E402
from quantize.preflight.checks import fp8_kv_needs_bfloat16  # noqa: E402

LOAD = {"concurrency": 32, "num_prompts": 128, "output_len": 256, "input_len": 256}


def predicted_kv_tokens(model: Path, flags: dict, gpu_bytes: int) -> int:
    """The model card's capacity arithmetic for this row: (utilization x GPU bytes - weight bytes) / KV bytes per
    token (quantize/export/capacity.py), before vLLM's activations and graphs are taken out."""
    config = json.loads((model / "config.json").read_text())
    weights = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    util = float(flags.get("gpu-memory-utilization", 0.9))
    per_token = kv_bytes_per_token(config, 1 if flags.get("kv-cache-dtype") == "fp8" else 2)
    return int((util * gpu_bytes - weights) // per_token)


def row(label: str, model: Path, flags: dict, work: Path, gpu_bytes: int) -> dict:
    out: dict = {"label": label, "model": str(model), "flags": flags,
                 "card_kv_tokens": predicted_kv_tokens(model, flags, gpu_bytes)}
    log = work / f"{label.replace(' ', '_').replace(',', '')}.log"
    t0 = time.perf_counter()
    try:
        with Server(model, flags, log=log, timeout=900) as srv:
            out["start_s"] = srv.load_s
            name = f"{log.stem}.json"
            proc = subprocess.run(bench_command(srv.url, srv.name, model, LOAD["concurrency"], LOAD["num_prompts"],
                                                LOAD["input_len"], LOAD["output_len"], work, name),
                                  env=vllm_env(work), cwd=ROOT, capture_output=True, text=True, timeout=900)
            res = json.loads((work / name).read_text()) if (work / name).is_file() else {}
            if proc.returncode or not res.get("completed"):
                out["error"] = root_cause(proc.stdout + proc.stderr)
            out.update({k: res.get(k) for k in ("output_throughput", "p50_ttft_ms", "p95_ttft_ms", "p50_itl_ms",
                                                "p95_itl_ms", "completed", "failed", "duration")})
    except VllmError as e:
        out["error"] = str(e)
    out.update(log_figures(log.read_text(errors="replace") if log.is_file() else ""))
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    if out.get("kv_cache_tokens"):
        out["card_vs_vllm_kv"] = round(out["card_kv_tokens"] / out["kv_cache_tokens"] - 1, 4)
    print(json.dumps(out), flush=True)
    return out


def table(rows: list[dict], base: dict | None) -> str:
    lines = ["| setting | output tok/s | x FP16 | TTFT p50 ms | TTFT p95 ms | weights GiB | KV cache GiB | KV tokens "
             "| card's KV tokens |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    def f(v, fmt="{:.1f}"):
        return "—" if v is None else fmt.format(v)
    for r in rows:
        x = (r.get("output_throughput") or 0) / base["output_throughput"] if base and base.get("output_throughput") \
            and r.get("output_throughput") else None
        lines.append(f"| {r['label']} | {f(r.get('output_throughput'))} | {f(x, '{:.2f}')} | {f(r.get('p50_ttft_ms'))} "
                     f"| {f(r.get('p95_ttft_ms'))} | {f(r.get('weights_gib'), '{:.2f}')} | "
                     f"{f(r.get('kv_cache_gib'), '{:.2f}')} | {f(r.get('kv_cache_tokens'), '{:,}')} | "
                     f"{f(r.get('card_kv_tokens'), '{:,}')} ({f(r.get('card_vs_vllm_kv'), '{:+.1%}')}) |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fp16", type=Path, required=True)
    ap.add_argument("--awq", type=Path, required=True)
    ap.add_argument("--gptq", type=Path)
    ap.add_argument("--awq-g64", type=Path)
    ap.add_argument("--budget-gb", type=float, default=38.0)
    ap.add_argument("--whole-gpu", action="store_true", help="the same rows again at vLLM's default utilization")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--resume", action="store_true", help="keep the rows an earlier run into --out measured")
    a = ap.parse_args()
    total = torch.cuda.get_device_properties(0).total_memory
    util = round(a.budget_gb * 1e9 / total, 3)
    common = {"max-model-len": 4096}
    # an fp8 KV cache on Hopper needs a bfloat16 model (pre-flight's fp8_kv_problem says why): the fp8 rows serve in it
    bf16 = fp8_kv_needs_bfloat16(torch.cuda.get_device_capability(0))
    fp8 = {"kv-cache-dtype": "fp8", **({"dtype": "bfloat16"} if bf16 else {})}
    settings = [("FP16, 32", a.fp16, {"dtype": "float16", "max-num-seqs": 32}),
                ("AWQ g128, 32", a.awq, {"max-num-seqs": 32}),
                ("AWQ g128, 128, fp8 KV", a.awq, {"max-num-seqs": 128, **fp8})]
    if a.gptq:
        settings.append(("GPTQ g128, 128, fp8 KV", a.gptq, {"max-num-seqs": 128, **fp8}))
    if a.awq_g64:
        settings.append(("AWQ g64, 128, fp8 KV", a.awq_g64, {"max-num-seqs": 128, **fp8}))
    budgets = [(f"{a.budget_gb:g} GB", {"gpu-memory-utilization": util})] + ([("whole GPU", {})] if a.whole_gpu else [])
    result = {"gpu": torch.cuda.get_device_name(0), "gpu_bytes": total, "load": LOAD, "budgets": {}}
    a.out.mkdir(parents=True, exist_ok=True)
    md = [f"# The seed's serving table on {result['gpu']}", "",
          f"Load: vLLM's serving benchmark, random prompts of {LOAD['input_len']} tokens, {LOAD['num_prompts']} "
          f"requests at concurrency {LOAD['concurrency']}, {LOAD['output_len']} output tokens each, EOS ignored, "
          f"streamed. Weights: random init of the Qwen2.5-7B shape (speed only)."]
    done = {}  # --resume: the rows a cut-off run of the same table measured, kept rather than measured again
    if a.resume and (a.out / "seed-table.json").is_file():
        done = {r["label"]: r for rows in json.loads((a.out / "seed-table.json").read_text())["budgets"].values()
                for r in rows if not r.get("error")}
    with tempfile.TemporaryDirectory(prefix="seed-table-") as w:
        for budget, extra in budgets:
            rows = result["budgets"].setdefault(budget, [])
            for label, model, flags in settings:  # the record is rewritten after each row: a cut-off run keeps its rows
                name = f"{label} ({budget})"
                rows.append(done.get(name) or row(name, model, {**common, **flags, **extra}, Path(w), total))
                (a.out / "seed-table.json").write_text(json.dumps(result, indent=1) + "\n")
            md += ["", f"## {budget}" + (f" (gpu_memory_utilization {util})" if extra else ""), "",
                   table(rows, rows[0])]
    (a.out / "seed-table.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())

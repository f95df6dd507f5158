"""Serving benchmark: the artifact and its FP16 reference behind vLLM's OpenAI-compatible server, measured by
vLLM's own serving benchmark at each concurrency the recipe lists (serve.concurrency), side by side.

    python -m eval.bench_serve artifacts/<name> [--num-prompts 32] [--input-len 128] [--output-len 32]
    -> artifacts/<name>-bench-serve.{json,md,png}

Both servers get the same flags (the artifact's vllm-serve.yaml; the reference the same served settings with
no quantization), one at a time. The benchmark's random dataset needs no download; EOS is ignored so every
request produces --output-len tokens. Figures: output tokens/s, requests/s, TTFT and ITL p50 / p95.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from quantize.export import serve_config
from quantize.source import load as source
from quantize.errors import run_main
from quantize import manifest
from quantize.preflight.deploy import vllm_version
from quantize.manifest import MANIFEST

from . import child
from .serve import INT4_MISSING, ROOT, Server, ServeError
from .vllm_run import VllmError, root_cause, vllm_env

METRICS = (("output_throughput", "output tok/s"), ("request_throughput", "req/s"),
           ("p50_ttft_ms", "TTFT p50 ms"), ("p95_ttft_ms", "TTFT p95 ms"),
           ("p50_itl_ms", "ITL p50 ms"), ("p95_itl_ms", "ITL p95 ms"))
# the default load: requests per level (at least the level), prompt tokens, output tokens per request
NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 32, 128, 32


def bench_command(url: str, name: str, model_dir: Path, concurrency: int, n: int, input_len: int, output_len: int,
                  result_dir: Path, result_name: str) -> list[str]:
    """`vllm bench serve` against the server at url serving `name`, as a module command line."""
    return [sys.executable, "-m", "eval.vllm_bench", "--backend", "openai", "--base-url", url,
            "--endpoint", "/v1/completions", "--model", str(model_dir), "--served-model-name", name,
            "--tokenizer", str(model_dir), "--dataset-name", "random", "--random-input-len", str(input_len),
            "--random-output-len", str(output_len), "--num-prompts", str(n), "--max-concurrency", str(concurrency),
            "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,95",
            "--seed", "0", "--disable-tqdm", "--save-result", "--result-dir", str(result_dir),
            "--result-filename", result_name]


def run_side(model_dir: Path, extra: dict, levels: list[int], n: int, input_len: int, output_len: int,
             work: Path, label: str, timeout: float) -> dict:
    """One server, every concurrency level -> {served_name, load_s, levels: {c: figures}} or {error}."""
    out: dict = {"model": str(model_dir), "levels": {}}
    try:
        with Server(model_dir, extra, log=work / f"{label}-server.log", timeout=timeout) as srv:
            out.update(served_name=srv.name, load_s=srv.load_s, flags=extra)
            for c in levels:
                name = f"{label}-c{c}.json"
                proc = child.run(bench_command(srv.url, srv.name, model_dir, c, max(n, c), input_len, output_len, work, name),
                                 vllm_env(work), timeout=timeout, cwd=ROOT)
                res = json.loads((work / name).read_text()) if (work / name).is_file() else None
                if proc.returncode or res is None or not res.get("completed"):
                    log = proc.stdout + proc.stderr + (work / f"{label}-server.log").read_text(errors="replace")
                    hint = f"\n{INT4_MISSING}" if "cpu_gemm_wna16" in log else ""
                    out["levels"][c] = {"error": root_cause(log) + hint}
                    break  # the server is broken: further levels would fail the same way
                out["levels"][c] = {k: res.get(k) for k in (*[m for m, _ in METRICS], "completed", "failed",
                                                           "duration", "total_output_tokens")}
    except VllmError as e:
        out["error"] = str(e)
    return out


def render_markdown(r: dict) -> str:
    lines = [f"# Serving benchmark: `{r['artifact_name']}` vs its FP16 reference", "",
             f"{r['date']} · {r['machine']} · vLLM {r['vllm']} · vLLM's serving benchmark (random dataset, "
             f"{r['num_prompts']} prompts per level (at least the concurrency), {r['input_len']} input tokens, "
             f"{r['output_len']} output tokens, EOS ignored, all requests at once up to the concurrency)", "",
             "| concurrency | model | " + " | ".join(h for _, h in METRICS) + " |",
             "|---:|---|" + "---:|" * len(METRICS)]
    for c in r["concurrency"]:
        for side in ("quantized", "fp16"):
            s = r[side]
            fig = s["levels"].get(str(c)) or s["levels"].get(c)
            if fig is None or "error" in (fig or {}):
                cells = ["—"] * len(METRICS)
            else:
                cells = [f"{fig[k]:.2f}" if fig.get(k) is not None else "—" for k, _ in METRICS]
            lines.append(f"| {c} | {side} `{s.get('served_name', '?')}` | " + " | ".join(cells) + " |")
    for side in ("quantized", "fp16"):
        s = r[side]
        errs = [s["error"]] if "error" in s else [f"concurrency {c}: {f['error']}" for c, f in s["levels"].items()
                                                  if "error" in f]
        for e in errs:
            lines += ["", f"**{side} failed**:", "", "```", e, "```"]
    lines += ["", f"Command: `{r['command']}`; at each level it runs `vllm bench serve {r['vllm_bench_serve']}` "
              "(the `--max-concurrency` value varies)", ""]
    return "\n".join(lines)


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for side, marker in (("quantized", "o"), ("fp16", "s")):
        levels = {int(c): f for c, f in r[side]["levels"].items() if "error" not in f}
        xs = sorted(levels)
        if not xs:
            continue
        label = f"{side} ({r[side].get('served_name')})"
        axes[0].plot(xs, [levels[c]["output_throughput"] for c in xs], marker=marker, label=label)
        axes[1].plot(xs, [levels[c]["p50_ttft_ms"] for c in xs], marker=marker, label=f"{label} p50")
        axes[1].plot(xs, [levels[c]["p95_ttft_ms"] for c in xs], marker=marker, ls="--", label=f"{label} p95")
        axes[2].plot(xs, [levels[c]["p50_itl_ms"] for c in xs], marker=marker, label=f"{label} p50")
        axes[2].plot(xs, [levels[c]["p95_itl_ms"] for c in xs], marker=marker, ls="--", label=f"{label} p95")
    for ax, title in zip(axes, ("output tokens/s", "TTFT (ms)", "ITL (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.suptitle(f"{r['artifact_name']}: vLLM serving, {r['machine']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def bench(artifact: Path, n: int, input_len: int, output_len: int, levels: list[int] | None,
          timeout: float = 900) -> dict:
    """Both sides at every level -> the report (also written next to the artifact as .json, .md, .png)."""
    artifact = Path(artifact).absolute()  # a linked artifact's report stays beside the link
    m = manifest.read(artifact)
    if m is None:
        raise ServeError(f"{artifact} is not an artifact directory (no {MANIFEST}); run `make quantize` first")
    cfg = serve_config.read(artifact)
    if cfg is None:
        raise ServeError(f"{artifact} has no {serve_config.SERVE_CONFIG}: re-run `make quantize` with this version")
    levels = levels or list((m.recipe.serve or {}).get("concurrency") or (1, 8, 32))
    reference = source.resolve(m.model.spec).path  # the FP16 base (a GGUF converted once, cached)
    ref_flags = {k: v for k, v in cfg.items() if k != "quantization"}
    ref_flags["served-model-name"] = f"{cfg['served-model-name']}-fp16"
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as w:
        work = Path(w)
        r = {"artifact": str(artifact), "artifact_name": artifact.name, "reference": str(reference),
             "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
             "machine": f"{platform.machine()}, {os.cpu_count()} cores", "vllm": vllm_version() or "?",
             "num_prompts": n, "input_len": input_len, "output_len": output_len, "concurrency": levels,
             "command": f"python -m eval.bench_serve {artifact} --num-prompts {n} --input-len {input_len} "
                        f"--output-len {output_len} --concurrency {' '.join(map(str, levels))}",
             "vllm_bench_serve": " ".join(bench_command("<url>", "<served name>", Path("<model dir>"), levels[0], n,
                                                        input_len, output_len, Path("<dir>"), "<file>")[3:])}
        r["quantized"] = run_side(artifact, {}, levels, n, input_len, output_len, work, "quantized", timeout)
        r["fp16"] = run_side(reference, ref_flags, levels, n, input_len, output_len, work, "fp16", timeout)
    stem = artifact.parent / f"{artifact.name}-bench-serve"
    Path(f"{stem}.json").write_text(json.dumps(r, indent=2) + "\n")
    Path(f"{stem}.md").write_text(render_markdown(r))
    plot(r, Path(f"{stem}.png"))
    return r


def main(argv: list[str] | None = None) -> int:
    """-> 0, or 3 when either side failed (the reason is in the report); a ServeError for what the user can fix."""
    ap = argparse.ArgumentParser(prog="python -m eval.bench_serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="exit codes: 0 done; 2 a user error (one `error:` line); 3 either side failed")
    ap.add_argument("artifact", type=Path, help="an artifact directory written by `make quantize` (artifacts/<name>)")
    ap.add_argument("--num-prompts", type=int, default=NUM_PROMPTS,
                    help=f"requests per concurrency level, at least the level (default {NUM_PROMPTS})")
    ap.add_argument("--input-len", type=int, default=INPUT_LEN, help=f"prompt tokens per request (default {INPUT_LEN})")
    ap.add_argument("--output-len", type=int, default=OUTPUT_LEN,
                    help=f"output tokens per request, EOS ignored (default {OUTPUT_LEN})")
    ap.add_argument("--concurrency", type=int, nargs="+", help="requests in flight, one run per level (default: the "
                                                               "recipe's serve.concurrency)")
    a = ap.parse_args(argv)
    if not (a.artifact / MANIFEST).is_file():
        raise ServeError(f"{a.artifact} is not an artifact directory (no {MANIFEST}); run `make quantize "
                         f"RECIPE=<name>` first, or give artifacts/<name>")
    for flag, value in (("--num-prompts", a.num_prompts), ("--input-len", a.input_len),
                        ("--output-len", a.output_len), *(("--concurrency", c) for c in a.concurrency or ())):
        if value <= 0:
            raise ServeError(f"{flag} {value}: give a positive whole number")
    r = bench(a.artifact, a.num_prompts, a.input_len, a.output_len, a.concurrency)
    print(render_markdown(r))
    stem = Path(a.artifact).absolute().parent / f"{Path(a.artifact).absolute().name}-bench-serve"
    print(f"wrote {stem}.json, {stem}.md, {stem}.png")
    failed = "error" in r["quantized"] or "error" in r["fp16"] or any(
        "error" in f for s in ("quantized", "fp16") for f in r[s]["levels"].values())
    return 3 if failed else 0


if __name__ == "__main__":
    sys.exit(run_main(main))

"""`python -m eval RECIPE` (our artifact) or `python -m eval --artifact DIR --base MODEL` (any vLLM-loadable dir).

Exit codes: 0 passed; 3 a gate or the vLLM smoke test failed (numbers printed); 2 a user error.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def run_eval(artifact: Path, base: str | None, eopts, cache: dict | None = None) -> int:
    from .report import evaluate

    r = evaluate(artifact, base, eopts, cache=cache)
    p = r["perplexity"]
    print(f"perplexity FP16 {p['fp16']['ppl']:.4f}  quantized {p['quantized']['ppl']:.4f}  "
          f"delta {p['delta']:+.4f} ({p['delta_pct']:+.2f}%)  [{p['protocol']['windows']} x "
          f"{p['protocol']['seq_len']} tokens]")
    s = r["vllm_smoke"]
    if "skipped" in s:
        print(f"vLLM smoke: skipped ({s['skipped']})")
    else:
        print(f"vLLM smoke: {'passed' if s['passed'] else 'FAILED'}; method {s.get('method')}, "
              f"agreement {s.get('token_agreement')}, load {s.get('load_s')} s, {s.get('tokens_per_s')} tok/s")
    for e in r["gates"]["failures"] + s.get("errors", []):
        print(f"FAILED: {e}", file=sys.stderr)
    print(f"report: {artifact / 'report.md'}")
    return 0 if r["passed"] else 3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval", description=__doc__)
    ap.add_argument("recipe", nargs="?", help="recipe name: evaluates artifacts/<name>/ with the recipe's eval block")
    ap.add_argument("--artifact", help="any vLLM-loadable directory (instead of a recipe)")
    ap.add_argument("--base", help="the unquantized model (recipe `model` syntax); default: the manifest's")
    ap.add_argument("--out", default="artifacts")
    ap.add_argument("--max-windows", type=int, help="override the perplexity window count")
    ap.add_argument("--no-vllm", action="store_true", help="skip the vLLM smoke-load")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr)
    from quantize.paths import child
    from quantize.recipe import EvalOptions, RecipeError, load_recipe

    from quantize.lock import OutputLockedError, output_lock

    from .artifact import ArtifactError

    try:
        if a.recipe:
            recipe = load_recipe(a.recipe)
            eopts, artifact = recipe.eval, Path(a.artifact or child(a.out, recipe.name, "recipe name"))
        elif a.artifact:
            eopts, artifact = EvalOptions(), Path(a.artifact)
        else:
            ap.error("give a recipe name or --artifact DIR")
        if not (artifact / "config.json").is_file():
            raise FileNotFoundError(f"{artifact} is not an artifact directory (no config.json); run make quantize first")
        if a.max_windows:
            eopts = eopts.model_copy(update={"perplexity": eopts.perplexity.model_copy(
                update={"max_windows": a.max_windows})})
        if a.no_vllm:
            eopts = eopts.model_copy(update={"vllm": eopts.vllm.model_copy(update={"enabled": False})})
        with output_lock(artifact):  # no quantize run replaces the artifact while it is being scored
            return run_eval(artifact, a.base, eopts)
    except (RecipeError, ArtifactError, ValueError, FileNotFoundError, OutputLockedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

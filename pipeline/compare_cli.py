"""The `compare` command's arguments and its run. Light at import (argparse only): `--help` imports no torch;
`pipeline.compare`, which does, is imported when the command runs."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub, common: argparse.ArgumentParser) -> None:
    c = sub.add_parser("compare", parents=[common],
                       help="quantize several recipes (or a sweep recipe) in one shared pass, evaluate each, write "
                            "artifacts/compare-<name>.{md,json,png}; --artifact puts other tools' directories beside "
                            "them")
    c.add_argument("recipes", nargs="+", help="recipe names or YAML paths; a recipe with `sweep:` expands to variants")
    c.add_argument("--artifact", action="append", default=[], metavar="DIR",
                   help="another tool's 4-bit directory (AutoAWQ, GPTQModel, llm-compressor, AutoRound; no manifest "
                        "needed), scored against the recipes' base model on their protocol as `eval --artifact DIR "
                        "--base MODEL` scores it, one row marked external; repeat for several")
    c.add_argument("--name", help="comparison name (default: the recipes' common prefix)")
    c.add_argument("--out", default="artifacts", help="parent directory of the artifacts and comparison files")
    c.add_argument("--force", action="store_true", help="replace existing artifact directories")
    c.add_argument("--no-eval", action="store_true", help="compare sizes and times only (no perplexity, no vLLM)")
    c.add_argument("--serving", action=argparse.BooleanOptionalAction, default=None,
                   help="serving columns: each variant behind vLLM's server, measured by vLLM's serving benchmark at "
                        "its recipe's highest serve.concurrency (output tok/s, TTFT, weight memory, KV cache "
                        "tokens). Default: on where vLLM's CUDA build runs and the comparison evaluates; --serving "
                        "measures on vLLM's CPU build too (an AVX-512 CPU; refused where vLLM cannot serve 4-bit), "
                        "--no-serving never")


def command(args) -> int:
    """Run `compare` -> exit code; prints the comparison's .md path."""
    from .compare import run_comparison

    doc, code = run_comparison(args.recipes, Path(args.out), args.force, not args.no_eval, args.name, args.artifact,
                               args.serving)
    print(Path(args.out) / f"compare-{doc['name']}.md")
    return code

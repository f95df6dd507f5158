"""Command line: `python -m quantize run <recipe>`, `validate`, `list`."""

from __future__ import annotations

import argparse
import logging
import sys

import torch

from .arch import UnsupportedArchitecture
from .calib import CalibrationError
from .export import DiskFullError, OutputExistsError
from .lock import OutputLockedError
from .preflight import PreflightError
from .recipe import RecipeError, list_recipes, load_recipe
from .source import ModelSourceError

# Errors a user can cause: printed as one clear message, exit code 2, no traceback. Anything else is a bug
# and keeps its traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (RecipeError, PreflightError, ModelSourceError, CalibrationError,
                                                UnsupportedArchitecture, OutputExistsError, FileNotFoundError,
                                                OutputLockedError, DiskFullError)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m quantize", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="quantize per recipe: recipes/<name>.yaml -> artifacts/<name>/")
    r.add_argument("recipe", help="recipe name (recipes/<name>.yaml) or path to a YAML file")
    r.add_argument("--out", default="artifacts", help="parent directory of the artifact (default: artifacts)")
    r.add_argument("--force", action="store_true", help="replace an existing artifact directory")
    r.add_argument("--no-eval", action="store_true", help="skip the eval stage even if the recipe enables it")
    v = sub.add_parser("validate", help="check recipes without loading any model")
    v.add_argument("recipes", nargs="*", help="names or paths (default: every recipe in recipes/)")
    sub.add_parser("list", help="list the shipped recipes")
    pf = sub.add_parser("preflight", help="check a recipe against the model's shapes and vLLM's kernels; "
                                          "reads config.json only (no weights)")
    pf.add_argument("recipe")
    pf.add_argument("--out", default="artifacts", help="parent directory of the artifact (checks its free disk)")
    pf.add_argument("--force", action="store_true", help="an existing artifact would be replaced: not an error")
    return p


def is_out_of_memory(e: BaseException) -> bool:
    """torch's CUDA OOM, or a RuntimeError saying so (older torch, other allocators, the CPU allocator)."""
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return True
    msg = str(e).lower()
    return isinstance(e, RuntimeError) and ("out of memory" in msg or "not enough memory" in msg)


def oom_message(e: BaseException, recipe_name: str, during_eval: bool = False) -> str:
    """What to turn when a run does not fit in memory, with the recipe's current values when it loads."""
    first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
    if during_eval:
        return (f"out of memory during eval: {first}\nThe artifact was written; lower the recipe's "
                f"`eval.perplexity.seq_len`, then rerun `make eval` (or `python -m eval {recipe_name}`).")
    try:
        r = load_recipe(recipe_name)
        now = (f" (now: batch_size {r.batch_size}, calibration.n_samples {r.calibration.n_samples}, "
               f"calibration.seq_len {r.calibration.seq_len}, device {r.device})")
    except RecipeError:
        now = ""
    return (f"out of memory: {first}\nThe run does not fit in this device's memory. In the recipe, lower "
            f"`batch_size` (calibration samples per forward), then `calibration.n_samples` or "
            f"`calibration.seq_len`{now}; or set `device: cpu` to quantize in host memory (slower).")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr)
    during_eval = False
    try:
        if args.cmd == "list":
            for name in list_recipes():
                r = load_recipe(name)
                print(f"{name:28s} {r.method} w{r.w_bit} g{r.q_group_size} {r.model}")
            return 0
        if args.cmd == "validate":
            failed = 0
            for name in args.recipes or list_recipes():
                try:
                    load_recipe(name)
                    print(f"ok      {name}")
                except RecipeError as e:
                    failed += 1
                    print(f"INVALID {e}")
            return 1 if failed else 0
        if args.cmd == "preflight":
            from .runner import preflight_only

            print(preflight_only(args.recipe, out_root=args.out, force=args.force))
            return 0
        from .runner import run

        out = run(args.recipe, out_root=args.out, force=args.force)
        print(out)
        recipe = load_recipe(args.recipe)
        if recipe.eval.enabled and not args.no_eval:
            from eval.cli import run_eval

            during_eval = True
            return run_eval(out, None, recipe.eval)
        return 0
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # torch.cuda.OutOfMemoryError is one
        if args.cmd not in ("run", "preflight") or not is_out_of_memory(e):
            raise
        print(f"error: {oom_message(e, args.recipe, during_eval)}", file=sys.stderr)
        return 2

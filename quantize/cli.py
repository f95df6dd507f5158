"""Command line: `python -m quantize run <recipe>`, `validate`, `list`."""

from __future__ import annotations

import argparse
import logging
import sys

from .arch import UnsupportedArchitecture
from .calib import CalibrationError
from .export import OutputExistsError
from .preflight import PreflightError
from .recipe import RecipeError, list_recipes, load_recipe
from .source import ModelSourceError

# Errors a user can cause: printed as one clear message, exit code 2, no traceback. Anything else is a bug
# and keeps its traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (RecipeError, PreflightError, ModelSourceError, CalibrationError,
                                                UnsupportedArchitecture, OutputExistsError, FileNotFoundError)


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
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr)
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

            print(preflight_only(args.recipe))
            return 0
        from .runner import run

        out = run(args.recipe, out_root=args.out, force=args.force)
        print(out)
        recipe = load_recipe(args.recipe)
        if recipe.eval.enabled and not args.no_eval:
            from eval.cli import run_eval

            return run_eval(out, None, recipe.eval)
        return 0
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

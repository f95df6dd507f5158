"""Command line: `python -m pipeline run <recipe>` (also installed as `quantize`), `eval`, `compare`, `register`,
`registry`, `serve`, `validate`, `list`, `preflight`. Wherever a recipe is asked for, its name (recipes/<name>.yaml)
or the path of a .yaml file will do.

Exit codes: 0 done; 2 a user error (one line, `error: ...`); 3 an eval gate, the vLLM smoke or compare's serving failed.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import os
import threading
from contextlib import ExitStack
from pathlib import Path

# torch, transformers and vLLM take seconds to import: `--help`, `list` and `validate` import none of them, so
# everything that does is imported inside the command that needs it
from quantize.errors import UserError
from quantize.paths import check_output_parent, child
from quantize.recipe import AUTO, EvalOptions, RecipeError, list_recipes, load_recipe, load_variants
from . import bytecode, compare_cli, register_cli
from .oom import is_out_of_memory, oom_message


class Interrupted(KeyboardInterrupt):
    """SIGINT (Ctrl-C) or SIGTERM: unwinds like Ctrl-C, so every cleanup on the way runs."""


def _interrupt(signum, frame):
    raise Interrupted(signal.Signals(signum).name)


INTERRUPTED = ("error: interrupted by {sig}; files being written were removed and existing artifacts are untouched. "
               "Rerun the command to start again (a run with checkpoints resumes after its last saved layer)")


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="on an error, show its traceback, not one line")
    p = argparse.ArgumentParser(prog=_prog(), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", parents=[common], help="quantize per recipe: recipes/<name>.yaml -> artifacts/<name>/")
    r.add_argument("recipe", help="recipe name (recipes/<name>.yaml) or path to a YAML file")
    r.add_argument("--out", default="artifacts", help="parent directory of the artifact (default: artifacts)")
    r.add_argument("--force", action="store_true", help="replace an existing artifact directory")
    r.add_argument("--no-eval", action="store_true", help="skip the eval stage even if the recipe enables it")
    e = sub.add_parser("eval", parents=[common],
                       help="perplexity FP16 vs quantized + vLLM smoke-load -> <artifact>/report.{json,md}; our "
                            "artifact by recipe name, or any vLLM-loadable directory with --artifact")
    e.add_argument("recipe", nargs="?", help="recipe name: evaluates artifacts/<name>/ with the recipe's eval block")
    e.add_argument("--artifact", help="any vLLM-loadable directory (instead of a recipe)")
    e.add_argument("--base", help="the unquantized model (recipe `model` syntax); default: the manifest's")
    e.add_argument("--out", default="artifacts", help="parent directory of the artifact (default: artifacts)")
    e.add_argument("--max-windows", type=int, help="override the perplexity window count")
    e.add_argument("--no-vllm", action="store_true", help="skip the vLLM smoke-load")
    compare_cli.add_parser(sub, common)
    register_cli.add_parsers(sub, common)
    sv = sub.add_parser("serve", parents=[common],
                        help="vLLM's OpenAI-compatible server on an artifact: a recipe's, a directory, or a "
                             "registered version (models:/<name>@<alias> or models:/<name>/<version>)")
    sv.add_argument("model", help="recipe name or YAML path (serves <out>/<name>/), an artifact directory, or "
                                  "models:/<name>@<alias> | models:/<name>/<version> from the registry")
    sv.add_argument("--out", default="artifacts", help="parent directory of the artifacts (default: artifacts)")
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 for every "
                                                        "interface)")
    sv.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    sv.add_argument("--dry-run", action="store_true",
                    help="resolve and verify the artifact, print the server command, start nothing")
    v = sub.add_parser("validate", parents=[common],
                       help="check recipes without loading any model; exit 2 when any is invalid")
    v.add_argument("recipes", nargs="*", help="names or paths (default: every recipe in recipes/)")
    sub.add_parser("list", parents=[common], help="list the shipped recipes")
    pf = sub.add_parser("preflight", parents=[common],
                        help="check a recipe against the model's shapes and vLLM's kernels; reads config.json only "
                             "(no weights); the plan's JSON goes to a file")
    pf.add_argument("recipe", help="recipe name (recipes/<name>.yaml) or path to a YAML file")
    pf.add_argument("--out", default="artifacts", help="parent directory of the artifact (checks its free disk)")
    pf.add_argument("--force", action="store_true", help="an existing artifact would be replaced: not an error")
    pf.add_argument("--json", metavar="PATH", help="where the plan's JSON goes (default: <out>/<name>.preflight.json)")
    return p


def _prog() -> str:
    """How the user started us, for usage lines: the `quantize` script or `python -m pipeline`."""
    return "quantize" if Path(sys.argv[0]).name == "quantize" else "python -m pipeline"


def run_eval(artifact: Path, base: str | None, eopts, cache: dict | None = None, hashes=None) -> int:
    """The eval stage on one artifact, its report written into it; prints the figures -> exit code 0 or 3.
    hashes: the run's `stages.BaseHashes`, whose base model's hash the eval uses."""
    from . import stages

    r = stages.evaluate(artifact, base, eopts, cache=cache, hashes=hashes)
    p = r.perplexity
    print(f"perplexity FP16 {p.fp16.ppl:.4f}  quantized {p.quantized.ppl:.4f}  "
          f"delta {p.delta:+.4f} ({p.delta_pct:+.2f}%)  [{p.protocol.windows} x {p.protocol.seq_len} tokens]")
    if d := r.distribution:
        print(f"KL(reference || quantized) mean {d.kl_mean:.4f}  p99 {d.kl_p99:.4f} nats  top-1 agreement "
              f"{d.top1:.4f}  [top-{d.k} of the reference]")
    from quantize.export.modelcard import paired_text  # the card's wording; imported once an eval has run

    lm = r.lm_eval
    for task, metrics in (lm.quantized.scores if lm and lm.quantized else {}).items():
        ref, paired = lm.reference.scores.get(task, {}), lm.paired.get(task, {})
        shown = [f"{m} FP16 {ref.get(m, float('nan')):.4f} quantized {v:.4f}"
                 + (f" (Δ {p.delta:+.4f} {paired_text(p)}, n {p.n})" if (p := paired.get(m)) else "")
                 for m, v in metrics.items()]
        print(f"lm-eval {task}: " + "  ".join(shown))
    for task, why in (lm.not_run if lm else {}).items():
        print(f"lm-eval {task}: {why}")
    s = r.vllm_smoke
    if s.skipped is not None:
        print(f"vLLM smoke: skipped ({s.skipped})")
    else:
        print(f"vLLM smoke: {'passed' if s.passed else 'FAILED'}; method {s.method}, agreement with FP16 "
              f"{s.token_agreement}, with our decoding {s.decode_agreement}, load {s.load_s} s, {s.tokens_per_s} tok/s")
    for e in r.failures:
        print(f"FAILED: {e}", file=sys.stderr)
    print(f"report: {artifact / 'report.md'}")
    return 0 if r.passed else 3


def _eval_command(args) -> int:
    """`eval`: a recipe's artifact with its eval block, or any directory with default options."""
    if args.recipe:
        recipe = load_recipe(args.recipe)
        eopts, artifact = recipe.eval, Path(args.artifact or child(args.out, recipe.name, "recipe name"))
    elif args.artifact:
        eopts, artifact = EvalOptions(), Path(args.artifact)
    else:
        raise RecipeError("give a recipe name or --artifact DIR")
    from quantize.manifest import ArtifactError, read, read_json

    if not (artifact / "config.json").is_file():
        raise ArtifactError(f"{artifact} is not an artifact directory (no config.json); run make quantize first")
    read_json(artifact / "config.json")  # a damaged file is named before the eval reads it
    read(artifact)  # so is a manifest this version cannot read
    if args.max_windows:
        eopts = eopts.model_copy(update={"perplexity": eopts.perplexity.model_copy(
            update={"max_windows": args.max_windows})})
    if args.no_vllm:
        eopts = eopts.model_copy(update={"vllm": eopts.vllm.model_copy(update={"enabled": False})})
    from quantize.lock import output_lock

    from eval import gpu_share

    gpu_share.warn_before_eval(eopts)  # a GPU another process holds is said now, not at the vLLM stage
    with output_lock(artifact):  # no quantize run replaces the artifact while it is being scored
        return run_eval(artifact, args.base, eopts)


def _world_size() -> int:
    """The number of ranks torchrun started (1 without torchrun, where `distributed` need not import torch)."""
    if "WORLD_SIZE" not in os.environ:
        return 1
    from quantize.capture import distributed

    return distributed.world_size()


def main(argv: list[str] | None = None) -> int:
    code = _main_handled(argv)
    if _world_size() > 1:  # a torchrun worker: see `distributed.leave`
        from quantize.capture import distributed

        distributed.leave(code)
    return code


def _main_handled(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    # under torchrun rank 0 tells the story; the others speak only of trouble
    quiet = _world_size() > 1 and os.environ.get("RANK", "0") != "0"
    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S", stream=sys.stderr)
    if bytecode.PREPARED is not None:
        logging.getLogger("pipeline").info(bytecode.PREPARED.line())
    handled = (signal.SIGINT, signal.SIGTERM) if threading.current_thread() is threading.main_thread() else ()
    previous = {s: signal.signal(s, _interrupt) for s in handled}
    try:
        return _main(args)
    except KeyboardInterrupt as e:
        if args.debug:
            raise
        print(INTERRUPTED.format(sig=e.args[0] if e.args else "SIGINT (Ctrl-C)"), file=sys.stderr)
        return 2
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _run_command(args, recipe, out: Path) -> int:
    """`run` of the parsed recipe into `out`: quantize, then evaluate unless the recipe or --no-eval says not to.
    Under torchrun (WORLD_SIZE > 1) every rank quantizes its share; rank 0 alone holds the lock, writes the artifact
    and evaluates it. The device is decided here, once, for the start line, the quantize stage and its hook."""
    from eval import gpu_share
    from quantize import runner
    from quantize.capture import distributed
    from quantize.lock import output_lock
    from quantize.preflight.checks import pick_device

    from . import expect, stages

    dist = distributed.init_from_env()
    hashes = stages.BaseHashes()  # the eval's base model hashed during the quantize stage (rank 0, on a GPU)
    try:
        writer = dist is None or dist.rank == 0
        with ExitStack() as held:
            # one lock over quantize and eval: no other run can replace the artifact while it is being scored
            take = lambda: held.enter_context(output_lock(out))  # noqa: E731
            if dist is None:
                take()
            else:  # a refused lock on rank 0 stops every rank
                dist.agree(lambda: take() if writer else None)
            try:
                evaluates = recipe.eval.enabled and not args.no_eval
                if evaluates and writer:  # a GPU another process holds is said now, not after the quantize stage
                    gpu_share.warn_before_eval(recipe.eval)
                device = pick_device(recipe)
                if writer:  # a slow CPU and a skipped smoke are said now, not after minutes
                    expect.announce(recipe, evaluates, device)
                check = hashes.before_weights if writer else stages.check_eval_inputs
                if recipe.method == AUTO:  # its candidates in one pass, scored, the winner written to `out`
                    from . import auto

                    if dist is not None:
                        raise RecipeError(f"method {AUTO} runs in one process: start it without torchrun")
                    written = auto.run(recipe, args.out, args.force, check if evaluates else None, out, device)
                else:
                    written = runner.run(recipe, out_root=args.out, force=args.force, locked=True, dist=dist,
                                         before_weights=check if evaluates else None, out=out, device=device)
            except BaseException as e:  # noqa: BLE001 - the first failing rank's message is the one to show
                if dist is None:
                    raise
                shown = dist.explain(e)
                if shown is e:
                    raise
                raise shown from e
            if not writer:
                return 0
            print(written)
            if recipe.eval.enabled and not args.no_eval:
                try:
                    return run_eval(written, None, recipe.eval, hashes=hashes)
                except RuntimeError as e:
                    e.during_eval = True  # an out-of-memory message then says the artifact was written
                    raise
        return 0
    finally:
        hashes.cancel()  # a run refused or failed before its eval leaves no hash running
        distributed.shutdown()


def _main(args) -> int:
    try:
        return _command(args)
    except UserError as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # torch.cuda.OutOfMemoryError is one
        if args.cmd not in ("run", "preflight", "eval") or not is_out_of_memory(e) or args.debug:
            raise
        during_eval = args.cmd == "eval" or getattr(e, "during_eval", False)
        print(f"error: {oom_message(e, args.recipe, during_eval, getattr(e, 'recipe', None))}", file=sys.stderr)
        return 2


def _command(args) -> int:
    """Run the parsed command -> exit code; a user's mistake raises a `UserError`."""
    if args.cmd != "run" and _world_size() > 1:
        from quantize.capture.distributed import DistributedError

        raise DistributedError(f"`{args.cmd}` runs in one process; only `run` is spread over ranks: start it "
                               f"without torchrun")
    if args.cmd == "list":
        for name in list_recipes():
            vs = load_variants(name)
            r = vs[0]
            sweep = f"  (sweep: {', '.join(v.name for v in vs)})" if len(vs) > 1 else ""
            print(f"{name:28s} {r.method} w{r.w_bit} g{r.q_group_size} {r.model}{sweep}")
        return 0
    if args.cmd == "validate":
        failed = 0
        for name in args.recipes or list_recipes():
            try:
                n = len(load_variants(name))
                print(f"ok      {name}" + (f" (sweep of {n} variants)" if n > 1 else ""), flush=True)
            except RecipeError as e:
                failed += 1
                print(f"error: {e}", file=sys.stderr, flush=True)
        return 2 if failed else 0
    if args.cmd == "eval":
        return _eval_command(args)
    if args.cmd == "compare":
        return compare_cli.command(args)
    if args.cmd == "register":
        return register_cli.register_command(args)
    if args.cmd == "registry":
        return register_cli.registry_command(args)
    if args.cmd == "serve":
        from .serve import serve_command

        return serve_command(args)
    recipe, out = _recipe_and_out(args)
    try:
        if args.cmd == "preflight":
            from quantize import runner

            from . import stages

            print(runner.preflight_only(recipe, out_root=args.out, force=args.force,
                                        before_weights=stages.check_eval_inputs, json_path=args.json, out=out))
            return 0
        return _run_command(args, recipe, out)
    except RuntimeError as e:
        e.recipe = recipe  # an out-of-memory message then names the values this run used
        raise


def _recipe_and_out(args):
    """`run` and `preflight`: the recipe, parsed here once and passed on, and its artifact directory under --out,
    worked out and checked once. A serve.targets the recipe cannot meet is refused from config.json alone, before
    `runner` imports torch (seconds); pre-flight checks them again and decides what this leaves open
    (quantize.preflight.targets.refuse_targets_early)."""
    from quantize.preflight.targets import refuse_targets_early

    recipe = load_recipe(args.recipe)
    check_output_parent(args.out)
    out = child(args.out, recipe.name, "recipe name")
    refuse_targets_early(recipe, out, args.force)
    return recipe, out

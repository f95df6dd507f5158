"""The `register` and `registry` commands' arguments and their runs: artifacts into the MLflow model registry, and
what it holds. Light at import (argparse, the recipe schema): parsed on every command line, as compare's arguments
are, so each command imports the registry and what it needs where it runs."""

from __future__ import annotations

import argparse
import json
import os
import signal
from contextlib import ExitStack
from pathlib import Path

from quantize.paths import child
from quantize.recipe import RecipeError, load_variants


def add_parsers(sub, common: argparse.ArgumentParser) -> None:
    rg = sub.add_parser("register", parents=[common],
                        help="register evaluated artifacts in the MLflow model registry (default: SQLite file "
                             "registry/mlflow.db; MLFLOW_TRACKING_URI for a server); several (a sweep, a "
                             "comparison) become versions of one registered model")
    rg.add_argument("recipes", nargs="*", metavar="recipe",
                    help="recipe names or YAML paths: registers artifacts/<name>/; a sweep recipe registers each "
                         "variant")
    rg.add_argument("--artifact", help="artifact directory (instead of a recipe name)")
    rg.add_argument("--comparison", metavar="NAME",
                    help="every variant of <out>/compare-NAME.json, as versions of registered model NAME")
    rg.add_argument("--name", help="registered model name (default: the artifact's name; for several, the "
                                   "comparison's name or the recipes' common prefix)")
    rg.add_argument("--alias", help="an MLflow alias (e.g. champion) for the version registered now; serve it as "
                                    "models:/<name>@<alias>")
    rg.add_argument("--variant", help="with several artifacts and --alias: the one the alias marks")
    rg.add_argument("--out", default="artifacts", help="parent directory of the artifacts (default: artifacts)")
    rg.add_argument("--by-reference", action="store_true", help="record the artifact's location, do not copy it")
    rg.add_argument("--storage-uri", help="where the artifact lives for consumers (s3://..., implies --by-reference)")
    ls = sub.add_parser("registry", parents=[common], help="list registered versions with their metrics")
    ls.add_argument("--name", help="one registered model only")
    ls.add_argument("--json", action="store_true", help="print the versions as JSON (tags, metrics, aliases, source)")
    ls.add_argument("--ui", action="store_true",
                    help="serve MLflow's own web UI on the registry (registry/mlflow.db) until Ctrl-C")
    ls.add_argument("--host", default="127.0.0.1", help="with --ui: the address to bind (default 127.0.0.1)")
    ls.add_argument("--port", type=int, default=5000, help="with --ui: the port (default 5000)")


def registry_command(args) -> int:
    """Run `registry` -> exit code: the registered versions as a table or JSON, or MLflow's UI on them."""
    from . import registry

    if args.ui:
        return _registry_ui(registry.ui_command(args.host, args.port), args.host, args.port)
    rows = registry.versions(args.name)
    print(json.dumps(rows, indent=2) if args.json else registry.table(rows))
    return 0


def _registry_ui(cmd: list[str], host: str, port: int) -> int:
    """Run MLflow's server in the foreground; Ctrl-C (or SIGTERM) stops it and its workers."""
    import subprocess

    print(f"MLflow UI on the registry: http://{'localhost' if host in ('127.0.0.1', '0.0.0.0') else host}:{port} "
          f"(Ctrl-C stops it)", flush=True)
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        return 0


def register_command(args) -> int:
    """Run `register` -> exit code; prints each version registered."""
    from quantize.lock import output_lock

    from . import registry

    if args.variant and not args.alias:
        raise RecipeError("--variant names the version an --alias marks; add --alias NAME (e.g. --alias champion)")
    artifacts, name = _register_targets(args)
    chosen = registry.chosen(artifacts, args.variant) if args.alias else None
    with ExitStack() as held:
        for artifact in artifacts:  # no run replaces one while it is checked and copied
            held.enter_context(output_lock(artifact))
        results = registry.register_many(artifacts, name, True if args.by_reference else None, args.storage_uri,
                                         args.alias, chosen)
    for res in results:
        alias = f", alias @{res['alias']}" if res.get("alias") else ""
        print(f"registered {res['name']} version {res['version']} ({res['variant']}, group size "
              f"{res['group_size']}{alias}) in {res['tracking_uri']} (source {res['source']})")
    return 0


def _register_targets(args) -> tuple[list[Path], str | None]:
    """`register`'s arguments -> (artifact directories, registered model name or None for the artifact's own)."""
    from . import registry

    given = [bool(args.recipes), bool(args.artifact), bool(args.comparison)]
    if sum(given) != 1:
        raise RecipeError("give exactly one of: recipe names (or YAML paths), --artifact DIR, --comparison NAME")
    if args.artifact:
        artifacts = [Path(args.artifact)]
    elif args.comparison:
        artifacts = registry.comparison_artifacts(Path(args.out), args.comparison)
    else:
        artifacts = [child(args.out, v.name, "recipe name") for n in args.recipes for v in load_variants(n)]
    for artifact in artifacts:
        if not artifact.is_dir():
            raise registry.RegistryError(f"{artifact} does not exist; run make quantize RECIPE=... (or make compare) "
                                         f"first")
    name = args.name or args.comparison
    if name is None and len(artifacts) > 1:
        from .compare import default_name

        name = default_name([Path(n).stem for n in args.recipes])
    return artifacts, name

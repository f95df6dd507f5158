"""`serve`: what `make serve` runs. Finds the artifact, then starts vLLM's server on it (`eval.serve`).

The model to serve is a recipe name or YAML path (its artifact under --out), an artifact directory, or a
registered version, `models:/<name>@<alias>` or `models:/<name>/<version>`: that version's files are fetched
through MLflow into a temporary directory beside the artifacts (removed when the server stops), its manifest is
verified and compared with the one registered, and the server starts on it as on any artifact.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from eval import serve
from quantize.paths import check_output_parent, child
from quantize.recipe import RecipeError, recipe_path

from . import registry


def serve_command(args) -> int:
    """Resolve `args.model`, then serve it until Ctrl-C (or, with --dry-run, print the server command) -> 0."""
    if not args.model.startswith("models:/"):
        return _serve_dir(local_artifact(args.model, args.out), args, serve)
    registry.parse_models_uri(args.model)  # a malformed name is refused before anything is created
    check_output_parent(args.out)
    out = Path(args.out)
    made = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".serve-registry-", dir=out))
    try:
        model_dir = registry.resolve(args.model, work)
        print(f"{args.model}: {model_dir} (manifest verified)", flush=True)
        return _serve_dir(model_dir, args, serve)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if made and not any(out.iterdir()):  # a directory this command created and left empty
            out.rmdir()


def _serve_dir(model_dir: Path, args, serve) -> int:
    if args.dry_run:
        if not (Path(model_dir) / "config.json").is_file():
            raise serve.ServeError(f"{model_dir} is not a model directory (no config.json)")
        print(" ".join(serve.server_command(Path(model_dir), args.port, args.host)))
        return 0
    return serve.main([str(model_dir), "--host", args.host, "--port", str(args.port)])


def local_artifact(model: str, out: str | Path) -> Path:
    """A recipe name or YAML path -> <out>/<recipe name>; an existing directory -> itself."""
    p = Path(model)
    if p.is_dir():
        return p
    try:
        recipe_path(model)
    except RecipeError as e:
        raise RecipeError(f"{model!r} is neither an artifact directory, a registered version (models:/<name>@<alias>)"
                          f" nor a recipe: {e}") from None
    artifact = child(out, p.stem if p.suffix in (".yaml", ".yml") else model, "recipe name")  # stem == name
    if not artifact.is_dir():
        raise RecipeError(f"{artifact} does not exist; run `make quantize RECIPE={model}` first (or serve a registered "
                          f"version: MODEL=models:/<name>@<alias>)")
    return artifact

"""What a `model` shaped like a hub id (owner/name) that can be found nowhere is told: a relative directory that
is missing looks just like a hub id, so the message says what was tried both ways and what to change."""

from __future__ import annotations

from pathlib import Path

# `model` values a recipe left as they were because nothing of that name lies beside it -> where it was looked for
# (`recipe.load.model_beside` records them; the loader's message reads them)
_TRIED_BESIDE: dict[str, Path] = {}


def remember_tried(model: str, beside: Path) -> None:
    _TRIED_BESIDE[model] = beside


def directory_tried(model: str) -> Path | None:
    """Where a recipe that named `model` looked for it as a directory (beside the recipe file), or None."""
    return _TRIED_BESIDE.get(model)


def not_found(spec: str, e: Exception, offline: bool) -> str:
    """The message for `spec`, found neither as a directory nor on the hub (`e`: the hub library's error). The
    directory is named as it was resolved: beside the recipe that gave it, else in the working directory.
    Offline, the hub library's text adds nothing; online, its reason comes last."""
    where = directory_tried(spec)
    tried = (f"there is no directory {where} (a relative `model` is looked for beside the recipe)" if where
             else f"there is no directory {Path(spec).absolute()} (resolved against the working directory)")
    if offline:
        hub = (f"hub id {spec!r} is not in the local hub cache (HF_HUB_OFFLINE=1: the hub was not asked). Fix the "
               f"path if the model is local, or fetch the hub model once with the hub reachable (HF_HUB_OFFLINE=0)")
    else:
        text = " ".join(str(e).split())[:200]
        hub = (f"hub id {spec!r} could not be fetched ({type(e).__name__}: {text}). Fix the path if the model is "
               f"local, or check the id on the hub")
    return f"model {spec!r} was found neither as a directory nor on the hub: {tried}, and {hub}"

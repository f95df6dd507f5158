"""The source stage: the checkpoint resolved to a local directory, checked against its config and loaded; the
architecture tables that say where its linears are.

What the stage hands on (`ModelSource`) and the error each of its modules raises for a model it cannot take
(`ModelSourceError`) live here, below the modules that share them: the loader (`load`), the GGUF conversion
(`gguf`) and the checkpoint's integrity checks (`integrity`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError


class ModelSourceError(UserError, ValueError):
    pass


@dataclass(frozen=True)
class ModelSource:
    spec: str  # what the recipe said
    path: Path  # a local HF directory
    kind: str  # dir | gguf | hub
    origin_sha256: str | None = None  # of the GGUF file, when the source was one

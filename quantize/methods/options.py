"""The base of every method's recipe section: unknown keys refused, values frozen (as the recipe's own sections)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

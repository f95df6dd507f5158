"""The base of every record: a JSON object of an artifact as attributes, its keys kept in the order given, unknown
keys kept, undeclared ones refused where we write them (see the package's docstring)."""

from __future__ import annotations

from typing import Any, ClassVar, Union

from pydantic import BaseModel, ConfigDict, PrivateAttr, model_serializer, model_validator

Num = Union[int, float]  # kept as written: an int re-serialised as a float would change the file's bytes


def stats_key(method: str) -> str:
    """The manifest key holding method `method`'s per-layer statistics (readable without the method registered)."""
    return f"{method}_stats"


class Record(BaseModel):
    """A JSON object of an artifact as attributes, written back with its keys in the order they were given."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    OPEN: ClassVar[bool] = False  # its undeclared keys are content (a recipe's settings), not a writer's typo
    WHAT: ClassVar[str] = ""  # what an error calls the file it came from (default: the class name)
    _keys: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="wrap")
    @classmethod
    def _remember_order(cls, data: Any, handler):
        rec = handler(data)
        if isinstance(data, dict):
            rec._keys = list(data)
        return rec

    @model_serializer(mode="wrap")
    def _in_given_order(self, handler) -> dict:
        out = handler(self)
        first = {k: out[k] for k in self._keys if k in out}
        return {**first, **{k: v for k, v in out.items() if k not in first}}  # keys set later go last

    @classmethod
    def of(cls, data):
        """A record from itself or from its JSON object (the dicts tests and older callers hand in)."""
        return data if isinstance(data, cls) else cls.model_validate(data)

    def to_json(self) -> dict:
        """The JSON object: the keys given, in their order, unknown ones included, unset ones left out."""
        return self.model_dump(mode="python", by_alias=True, exclude_unset=True)

    def written(self):
        """This record, checked before it is written: a key no record class declares is a writer's mistake."""
        stray = self.undeclared()
        if stray:
            raise TypeError(f"{type(self).__name__} written with keys no record declares: {stray}; declare them "
                            f"in quantize/records/")
        return self

    def undeclared(self, where: str = "") -> list[str]:
        """Keys no class declares, by dotted path, in this record and the records it holds (OPEN ones excepted)."""
        out = [] if self.OPEN else [f"{where}{k}" for k in self.model_extra or {}]
        for name in (n for n in type(self).model_fields if n in self.model_fields_set):
            for key, value in _children(getattr(self, name)):
                if isinstance(value, Record):
                    out += value.undeclared(f"{where}{name}{key}.")
        return out


def _children(value) -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        return [(f"[{k!r}]", v) for k, v in value.items()]
    if isinstance(value, list):
        return [(f"[{i}]", v) for i, v in enumerate(value)]
    return [("", value)]

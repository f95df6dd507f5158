"""The records an artifact carries across package lines, as schema classes: the manifest (manifest.json, written
by quantize) and the eval report (report.json, written by eval), read by the model card, the registry, compare
and the eval through attributes rather than string keys.

The JSON is the shape the artifacts on disk and in registries hold, key for key and in the same order, so they
read and verify as they are; `to_json()` of a record read from a file is that file's object again
(tests/golden/records pins it). No schema version field: a change of shape adds one, with a reader for the shape
before it.

Unknown keys: every record keeps them (`extra="allow"`) and writes them back where they stood. An artifact
written by an older or a newer version must still read, verify and register here: refusing a key this version
does not know would lock users out of their own artifacts, and dropping it would change the bytes a registry
version's manifest_sha256 pins. What we write ourselves is held strict instead: `undeclared()` names any key no
class declares, and the writers refuse to write one (a typo in a writer fails its first test, not a user's run).
Absent keys stay absent: a field the writer did not set is not written as null (`exclude_unset`).

The base class and its rules are in `base`, the manifest's classes in `manifest_json`, the report's in
`report_json`; every name is imported from here.
"""

from __future__ import annotations

from .base import Num, Record, stats_key
from .manifest_json import (AutoCandidate, AutoChoice, Calibration, Capacity, Deploy, Experts, FileRecord,
                            FormatRecord, Manifest, ModelRecord, RecipeSnapshot, ReportHashes, Seal)
from .report_json import (Distribution, ErrorRow, Gates, LmEval, LmScores, Perplexity, PplSide, Protocol, Report,
                          ScoredOn, Smoke, WorstWindow)

__all__ = ["AutoCandidate", "AutoChoice", "Calibration", "Capacity", "Deploy", "Distribution", "ErrorRow", "Experts",
           "FileRecord", "FormatRecord", "Gates", "LmEval", "LmScores", "Manifest", "ModelRecord", "Num", "Perplexity",
           "PplSide", "Protocol", "RecipeSnapshot", "Record", "Report", "ReportHashes", "ScoredOn", "Seal", "Smoke",
           "WorstWindow", "stats_key"]

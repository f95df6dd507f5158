"""Calibration text: resolve a dataset name to text, then cut it into seeded token blocks.

A name means one text wherever the recipe runs:
- `groups-merged`: the bundled general-text mix (data/groups-merged.txt: llama.cpp's community "groups_merged"
  calibration set: prose, code, maths, references);
- `wikitext2`: the bundled WikiText-2 raw test text (data/wikitext2-raw-test.txt), the text the eval scores;
- `pileval` (the Pile's validation sample, mit-han-lab/pile-val-backup) or any other hub id: the Hugging Face
  hub only. A hub that cannot be reached stops the run at once, naming the bundled alternative; nothing
  falls back silently.
- a local .txt/.jsonl/.parquet path (.jsonl/.parquet through `datasets`).
What was used, and its sha256, is returned so the manifest can record it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import UserError
from .source.load import hub_offline

log = logging.getLogger(__name__)

DATA_DIR = Path(__file__).resolve().parent.parent / "data"

# bundled name -> file in data/ (provenance: data/README.md)
BUNDLED = {"groups-merged": "groups-merged.txt", "wikitext2": "wikitext2-raw-test.txt"}
# short name -> (hub dataset, subset, default split)
HUB_NAMES = {"pileval": ("mit-han-lab/pile-val-backup", None, "validation")}
OFFLINE_CHOICE = "groups-merged"  # what a message about an unreachable hub offers instead
HUB_PROBE_S = 1.5  # an unreachable hub is reported within this, not after minutes of retries


class CalibrationError(UserError, ValueError):
    pass


@dataclass(frozen=True)
class CalibText:
    """Documents of calibration text and where they came from."""

    documents: list[str]
    source: str  # what was actually read: a file path or "hub:<id>[/<subset>]:<split>"
    sha256: str  # of the documents joined with "\n\n"


def _sha(docs: list[str]) -> str:
    return hashlib.sha256("\n\n".join(docs).encode()).hexdigest()


def _split_paragraphs(text: str) -> list[str]:
    return [p.strip() for p in text.split("\n\n") if p.strip()]


def _from_hub(dataset: str, subset: str | None, split: str, column: str, max_docs: int | None) -> list[str]:
    import datasets

    ds = datasets.load_dataset(dataset, subset, split=split)
    if column not in ds.column_names:
        raise CalibrationError(
            f"calibration.text_column {column!r} is not a column of {dataset}; columns: {ds.column_names}"
        )
    texts = ds[column] if max_docs is None else ds.select(range(min(max_docs, len(ds))))[column]
    return [t for t in texts if isinstance(t, str) and t.strip()]


def _from_file(path: Path, column: str) -> list[str]:
    if path.suffix == ".txt":
        try:
            return _split_paragraphs(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise CalibrationError(f"calibration.dataset {path} is not UTF-8 text ({e.reason} at byte {e.start}); "
                                   f"convert it to UTF-8 or point calibration.dataset at a text file") from None
    if path.suffix == ".jsonl":
        return _from_jsonl(path, column)
    if path.suffix in (".json", ".parquet"):
        import datasets

        kind = "parquet" if path.suffix == ".parquet" else "json"
        try:
            ds = datasets.load_dataset(kind, data_files=str(path), split="train")
        except Exception as e:  # noqa: BLE001 - the json/parquet readers raise many types for bad input
            what = "JSON" if kind == "json" else "Parquet"
            first = " ".join(str(e).split())[:200]
            raise CalibrationError(f"calibration.dataset {path} cannot be read as {what} ({type(e).__name__}: "
                                   f"{first}); fix the file or point calibration.dataset at another one") from None
        if column not in ds.column_names:
            raise CalibrationError(
                f"calibration.text_column {column!r} is not a column of {path}; columns: {ds.column_names}"
            )
        return [t for t in ds[column] if isinstance(t, str) and t.strip()]
    raise CalibrationError(f"calibration.dataset {str(path)!r}: use a .txt, .jsonl or .parquet file")


def hub_unreachable(timeout: float = HUB_PROBE_S) -> str | None:
    """Why the Hugging Face hub cannot be reached (within `timeout` seconds, name lookup included), or None."""
    from huggingface_hub import constants

    outcome: list[str | None] = []

    def probe() -> None:
        try:
            urllib.request.urlopen(urllib.request.Request(constants.ENDPOINT, method="HEAD"), timeout=timeout)
            outcome.append(None)
        except urllib.error.HTTPError:
            outcome.append(None)  # it answered
        except Exception as e:  # noqa: BLE001 - any failure to connect is the answer
            outcome.append(f"{type(e).__name__}: {e}")

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(timeout)
    return outcome[0] if outcome else f"no answer from {constants.ENDPOINT} within {timeout:.1f} s"


def _unreachable(dataset: str, hub_id: str, why: str) -> CalibrationError:
    return CalibrationError(
        f"calibration.dataset {dataset!r} is the hub dataset {hub_id}, which cannot be reached from here ({why}); "
        f"to calibrate without the hub set `calibration.dataset: {OFFLINE_CHOICE}` (the bundled general-text mix, "
        f"data/{BUNDLED[OFFLINE_CHOICE]}) or a local .txt/.jsonl/.parquet file in the recipe")


def _hub_text(dataset: str, hub_id: str, subset: str | None, split: str, column: str) -> CalibText:
    """A hub dataset's documents: from the local cache when HF_HUB_OFFLINE=1, else after a quick probe."""
    if not hub_offline():
        why = hub_unreachable()
        if why:
            raise _unreachable(dataset, hub_id, why)
    try:
        docs = _from_hub(hub_id, subset, split, column, None)
    except CalibrationError:
        raise
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds; the message names it
        why = "HF_HUB_OFFLINE=1 and it is not in the local cache" if hub_offline() else f"{type(e).__name__}: {e}"
        raise _unreachable(dataset, hub_id, why) from None
    return CalibText(docs, f"hub:{hub_id}/{subset}:{split}", _sha(docs))


def _from_jsonl(path: Path, column: str) -> list[str]:
    """One JSON object per line -> the non-empty strings under `column` (a bad line is named by its number)."""
    def bad(n: int, why: str) -> CalibrationError:
        return CalibrationError(f"calibration.dataset {path} cannot be read as JSON Lines (one JSON object per line): "
                                f"line {n} {why}; fix the file or point calibration.dataset at another one")

    docs, columns = [], set()
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8").strip()
                row = json.loads(line) if line else None
            except UnicodeDecodeError as e:
                raise bad(n, f"is not UTF-8 ({e.reason} at byte {e.start})") from None
            except ValueError as e:
                raise bad(n, f"is not JSON ({e})") from None
            if row is None:
                continue
            if not isinstance(row, dict):
                raise bad(n, f"is a JSON {type(row).__name__}, not an object")
            columns.update(row)
            if isinstance(row.get(column), str) and row[column].strip():
                docs.append(row[column])
    if column not in columns:
        raise CalibrationError(f"calibration.text_column {column!r} is not a column of {path}; columns: "
                               f"{sorted(columns)[:20]}")
    return docs


def load_text(dataset: str, split: str | None = None, subset: str | None = None, column: str = "text") -> CalibText:
    """A bundled name, hub name or id, or local path -> CalibText."""
    path = Path(dataset)
    if path.suffix in (".txt", ".jsonl", ".json", ".parquet"):
        if not path.is_file():
            raise CalibrationError(f"calibration.dataset: file {path} does not exist")
        docs = _from_file(path, column)
        return CalibText(docs, str(path.resolve()), _sha(docs))
    if dataset in BUNDLED:
        docs = _split_paragraphs((DATA_DIR / BUNDLED[dataset]).read_text(encoding="utf-8"))
        return CalibText(docs, str(DATA_DIR / BUNDLED[dataset]), _sha(docs))
    hub_id, hub_subset, hub_split = HUB_NAMES.get(dataset, (dataset, None, "train"))
    return _hub_text(dataset, hub_id, subset or hub_subset, split or hub_split, column)


def make_samples(docs: list[str], tokenizer, n_samples: int, seq_len: int, seed: int) -> torch.Tensor:
    """Shuffle documents with `seed`, tokenize, concatenate and cut: -> input_ids [n_samples, seq_len].

    Documents are joined with the tokenizer's EOS token between them (as AutoAWQ concatenates pile
    samples); no BOS is added to blocks.
    """
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    need = n_samples * seq_len
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids: list[int] = []
    for i in order:
        ids.extend(tokenizer(docs[i], add_special_tokens=False)["input_ids"] + eos)
        if len(ids) >= need:
            break
    if len(ids) < need:
        raise CalibrationError(
            f"calibration text has {len(ids)} tokens but n_samples x seq_len = {n_samples} x {seq_len} = {need}; "
            f"lower calibration.n_samples or calibration.seq_len, or set calibration.dataset to a longer text"
        )
    return torch.tensor(ids[:need], dtype=torch.long).reshape(n_samples, seq_len)  # [n, seq]


def samples_sha256(samples: torch.Tensor) -> str:
    """sha256 of token blocks [n, seq] as their raw int64 bytes: equal hashes mean equal blocks (manifests, and
    the benchmark's check that ours and the peer calibrated on the same tokens)."""
    return hashlib.sha256(samples.numpy().tobytes()).hexdigest()

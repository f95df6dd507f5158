"""The reference model's perplexity, cached on disk so `make eval`, a re-run and every variant of a comparison
score the unquantized model once.

The key is what fixes the number: the sha256 of the model's files (weights, config, tokenizer), the protocol
record (text sha256, windows, tokens), the dtype, the device kind (CPU, or the GPU's name) and the torch and
transformers versions. An entry is a JSON file holding its whole key beside the result; a lookup recomputes the
key from the files on disk and accepts an entry only when the stored key equals it. The file name is only an
address, never trusted.

An entry may also hold the reference's per-token distributions on those windows (its top-k log-probabilities and
token ids, `eval.distribution`): a safetensors file beside the JSON, named and hashed in the entry (key
`distribution`), so KL and top-1 against the reference need no reference forward either. An entry without it (or
whose file is missing, altered or of another k) still gives the perplexity; the eval then scores the reference once
more and rewrites the entry with both.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

import torch

from safetensors.torch import load_file, save

from quantize.files import atomic_write, atomic_write_text, sha256_file
from quantize.paths import cache_dir
from quantize.source.load import TOKENIZER_FILES

log = logging.getLogger(__name__)

RESULT_KEYS = ("ppl", "nll_sum", "tokens", "per_window_nll", "seconds")


def model_files(path: Path) -> list[Path]:
    """The files a reference perplexity depends on: weights, their index, config, tokenizer."""
    path = Path(path)
    names = {"config.json", *TOKENIZER_FILES} - {"generation_config.json"}
    return sorted(p for p in path.iterdir() if p.is_file() and (
        p.name in names or p.name.endswith((".safetensors", ".safetensors.index.json"))))


CHUNK = 1 << 28  # 256 MiB: a 15 GB checkpoint is hashed as ~60 pieces in parallel


class Cancelled(Exception):
    """A hash stopped before its end (`HashAhead.cancel`)."""


def _chunk_sha256(job: tuple[Path, int], stop: threading.Event | None = None) -> str:
    path, offset = job
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(offset)
        left = CHUNK
        while left and (block := f.read(min(1 << 22, left))):
            if stop is not None and stop.is_set():
                raise Cancelled(str(path))
            h.update(block)
            left -= len(block)
    return h.hexdigest()


def model_sha256(path: Path, workers: int | None = None, stop: threading.Event | None = None) -> str:
    """One sha256 over the model's files: each file cut into 256 MiB pieces hashed in parallel threads (hashlib
    releases the GIL; a 7B checkpoint is 15 GB), then the names, sizes and piece digests hashed in order.
    workers: the threads (default: up to 16); stop: set, it ends the hash within one 4 MiB read (Cancelled)."""
    files = model_files(path)
    jobs = [(f, off) for f in files for off in range(0, max(f.stat().st_size, 1), CHUNK)]
    with ThreadPoolExecutor(max_workers=workers or min(16, os.cpu_count() or 1)) as pool:
        digests = list(pool.map(lambda job: _chunk_sha256(job, stop), jobs))
    h = hashlib.sha256()
    for (f, off), d in zip(jobs, digests):
        h.update(f"{f.name}\0{f.stat().st_size}\0{off}\0{d}\n".encode())
    return h.hexdigest()


class HashAhead:
    """The base model's `model_sha256` computed in a thread of its own while a run's quantize stage keeps the GPU
    busy, so that its eval finds the reference cache's key ready instead of first hashing 15 GB (a 7B checkpoint).

    `result(path)` gives the sha256 only for those files as they stand when it is asked: the same resolved
    directory, every file's name, size and mtime as when the hash began; otherwise None, and the eval hashes them
    itself. Few threads: the quantize stage's own host work (reading layers, copying them to the device) shares
    the processor. `cancel` stops it within one 4 MiB read (a run refused or failed before its eval)."""

    WORKERS = 4

    def __init__(self, path: Path):
        self.path = Path(path).resolve()
        self.stamp = _files_stamp(self.path)
        self.stop = threading.Event()
        self.future: Future[str] = Future()
        self.seconds: float | None = None
        threading.Thread(target=self._hash, name="base-model-hash", daemon=True).start()

    def _hash(self) -> None:
        t0 = time.perf_counter()
        try:
            sha = model_sha256(self.path, self.WORKERS, self.stop)
        except BaseException as e:  # noqa: BLE001 - handed to whoever asks; the eval then hashes itself
            self.future.set_exception(e)
            return
        self.seconds = round(time.perf_counter() - t0, 2)
        self.future.set_result(sha)

    def cancel(self) -> None:
        self.stop.set()

    def result(self, path: Path) -> str | None:
        """The sha256 of `path`'s model files, once the hash has ended; None when it was of other or changed files,
        cancelled or failed."""
        if Path(path).resolve() != self.path:
            return None  # another base model's: asked before any wait
        try:
            sha = self.future.result()
        except Exception as e:  # noqa: BLE001 - a file vanished or could not be read: the caller's hash says so
            log.info("the base model's hash computed ahead is not used (%s: %s)", type(e).__name__, e)
            return None
        if _files_stamp(self.path) != self.stamp:
            log.info("the base model's files changed while they were hashed ahead: hashing them again")
            return None
        return sha


MEMO = "model-sha256-memo.json"
MEMO_ENTRIES = 64  # the model directories last hashed here; older ones are forgotten


def _files_stamp(path: Path) -> str:
    """The model directory's resolved path and each of its files' name, size and mtime: when these are unchanged
    the files almost surely are, which is all a guess may assume (a cache key is never built from it)."""
    path = Path(path)
    parts = [str(path.resolve())]
    for f in model_files(path):
        st = f.stat()
        parts.append(f"{f.name}\0{st.st_size}\0{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def remember_model_sha256(path: Path, sha: str, root: Path | None = None) -> None:
    """Note which sha256 `model_sha256` gave for the model directory as its files stand now (see `probably_cached`);
    a memo that cannot be written is forgotten silently: it only ever steers a guess."""
    memo_path = (root or cache_dir() / "reference-ppl") / MEMO
    try:
        memo = _read_memo(memo_path)
        memo.pop(stamp := _files_stamp(path), None)
        memo[stamp] = sha
        memo = dict(list(memo.items())[-MEMO_ENTRIES:])
        memo_path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(memo_path, json.dumps(memo) + "\n")
    except OSError:
        pass


def _read_memo(memo_path: Path) -> dict:
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in memo.items() if isinstance(v, str)} if isinstance(memo, dict) else {}


def probably_cached(path: Path, dtype: torch.dtype, device: torch.device, k: int, root: Path | None = None) -> bool:
    """A guess, before the model's files are hashed, at whether the cache holds its reference perplexity with top-`k`
    distributions for this dtype and device: the sha256 last hashed for these files (by name, size and mtime) has
    such an entry. False when the files were never hashed here or changed since. The eval starts loading the
    reference early when this says False; the lookup itself always uses the hash."""
    root = root or cache_dir() / "reference-ppl"
    try:
        sha = _read_memo(root / MEMO).get(_files_stamp(path))
    except OSError:
        return False
    if sha is None:
        return False
    want = {"model_sha256": sha, "dtype": str(dtype).removeprefix("torch."), "device": device_kind(device)}
    for entry_file in root.glob("*.json"):
        if len(entry_file.stem) != 32:  # the memo, and lm-eval's entries beside an entry
            continue
        try:
            entry = json.loads(entry_file.read_text())
        except (OSError, ValueError):
            continue
        key = entry.get("key") if isinstance(entry, dict) else None
        dist = entry.get("distribution") if isinstance(entry, dict) else None
        if isinstance(key, dict) and all(key.get(n) == v for n, v in want.items()) and \
                isinstance(dist, dict) and dist.get("k") == k:
            return True
    return False


def device_kind(device: torch.device) -> str:
    """'cpu', or 'cuda:<GPU name>': kernels, hence the last digits of a perplexity, differ between GPU models."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type


def make_key(model_sha: str, protocol: dict, dtype: torch.dtype, device: torch.device) -> dict:
    versions = {}
    for pkg in ("torch", "transformers"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    return {"model_sha256": model_sha, "protocol": protocol, "dtype": str(dtype).removeprefix("torch."),
            "device": device_kind(device), "versions": versions}


def entry_path(key: dict, root: Path | None = None) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return (root or cache_dir() / "reference-ppl") / f"{digest[:32]}.json"


def lookup(key: dict, root: Path | None = None) -> dict | None:
    """The cached result for `key`, or None when absent, unreadable or stored under another key."""
    path = entry_path(key, root)
    try:
        entry = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("reference perplexity cache %s is unreadable (%s): recomputing", path, e)
        return None
    if not isinstance(entry, dict) or entry.get("key") != key:
        log.warning("reference perplexity cache %s holds another key: recomputing", path)
        return None
    result = entry.get("result")
    if not isinstance(result, dict) or any(k not in result for k in RESULT_KEYS) or \
            not math.isfinite(result["ppl"]):
        log.warning("reference perplexity cache %s holds no usable result: recomputing", path)
        return None
    log.info("reference perplexity %.4f from the cache (%s)", result["ppl"], path)
    topk = _read_topk(path, entry.get("distribution"))
    return {**result, "topk": topk} if topk is not None else dict(result)


def _read_topk(path: Path, rec) -> dict | None:
    """The entry's distributions file, verified against the sha256 the entry records -> {k, logp, idx}, or None."""
    if not isinstance(rec, dict) or not isinstance(rec.get("file"), str) or "/" in rec["file"]:
        return None
    f = path.parent / rec["file"]
    try:
        if sha256_file(f) != rec.get("sha256"):
            log.warning("reference distributions %s differ from their cache entry: the reference runs again", f)
            return None
        t = load_file(str(f))
    except (OSError, ValueError, RuntimeError) as e:
        log.warning("reference distributions %s are unreadable (%s): the reference runs again", f, e)
        return None
    if set(t) != {"logp", "idx"} or t["logp"].shape != t["idx"].shape or t["logp"].shape[-1] != rec.get("k"):
        return None
    return {"k": rec["k"], "logp": t["logp"], "idx": t["idx"]}


def store(key: dict, result: dict, root: Path | None = None) -> Path | None:
    """Save a finite result under `key` (atomically), with its `topk` distributions when it holds them (their file
    first, then the entry naming it); a cache that cannot be written is only a warning."""
    if not math.isfinite(result["ppl"]):
        return None
    path = entry_path(key, root)
    entry = {"key": key, "result": {k: result[k] for k in RESULT_KEYS}}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if result.get("topk") is not None:
            t = result["topk"]
            f = path.with_name(f"{path.stem}.topk.safetensors")
            data = save({"logp": t["logp"].contiguous(), "idx": t["idx"].contiguous()})
            atomic_write(f, lambda fh: fh.write(data))
            entry["distribution"] = {"k": t["k"], "file": f.name, "sha256": hashlib.sha256(data).hexdigest(),
                                     "bytes": len(data)}
        atomic_write_text(path, json.dumps(entry) + "\n")
    except OSError as e:
        log.warning("reference perplexity not cached (%s): the next eval recomputes it", e)
        return None
    return path


def _extra_path(key: dict, name: str, spec: dict, root: Path | None) -> Path:
    path = entry_path(key, root)
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    return path.with_name(f"{path.stem}.{name}-{digest}.json")


def lookup_extra(key: dict, name: str, spec: dict, root: Path | None = None) -> dict | None:
    """Another reference result stored beside the entry of `key` (e.g. its lm-eval scores), for `spec` (what
    else fixes it: tasks, limit); None unless the stored key and spec equal the asked ones."""
    path = _extra_path(key, name, spec, root)
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(entry, dict) or entry.get("key") != key or entry.get("spec") != spec:
        return None
    log.info("reference %s from the cache (%s)", name, path)
    return entry.get("result")


def store_extra(key: dict, name: str, spec: dict, result: dict, root: Path | None = None) -> None:
    path = _extra_path(key, name, spec, root)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps({"key": key, "spec": spec, "result": result}) + "\n")
    except OSError as e:
        log.warning("reference %s not cached (%s): the next eval recomputes it", name, e)

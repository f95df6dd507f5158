"""The artifact's manifest: written with the sha256 of every file, verified before anything trusts the files,
and updated when the eval adds its report.

An artifact is a closed set: every file it holds is listed (`files`, plus the eval report's `report` hashes)
with its sha256, nothing else is in the directory, nothing is a symlink, and no listed name leads outside it.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from pydantic import ValidationError

from .errors import UserError
from .files import atomic_write_text, fsync_path, sha256_file, sha256_of, usable_cores
from .records import FileRecord, Manifest, Record, Report, ReportHashes, Seal

R = TypeVar("R", bound=Record)

MANIFEST = "manifest.json"
CARD = "README.md"  # the model card: re-rendered when the eval adds its numbers, so no report fingerprints it
REPORT_FILES = ("report.json", "report.md")


class ArtifactError(UserError, ValueError):
    pass


def read(root: Path) -> Manifest | None:
    """The manifest of an artifact directory -> its record (None when there is none: another tool's directory).
    ArtifactError naming the file when it is not one this version can read."""
    path = Path(root) / MANIFEST
    return parse(Manifest, read_json(path), path) if path.is_file() else None


def read_report(root: Path) -> Report | None:
    """The eval report of an artifact directory -> its record (None before the eval); ArtifactError naming the
    file when it is not one this version can read."""
    path = Path(root) / REPORT_FILES[0]
    return parse(Report, read_json(path), path, "evaluate the artifact again with make eval") if path.is_file() \
        else None


def parse(cls: type[R], data: dict, path: Path, remedy: str = "re-create the artifact with make quantize") -> R:
    """A JSON object read from `path` -> its record; ArtifactError naming the file and the first key at fault."""
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(map(str, err["loc"])) or "the object"
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        raise ArtifactError(f"{path} is not a {cls.WHAT or cls.__name__.lower()} this version can read ({where}: {err['msg']}"
                            f"{more}); restore that file, or {remedy}") from None


def read_json(path: Path) -> dict:
    """One of an artifact's JSON files (config.json, manifest.json) -> its object; ArtifactError naming the file
    when it is not a JSON object (a parser's message alone does not say which file)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError alike
        raise ArtifactError(f"{path} is not valid JSON ({e}); restore that file, or re-create the artifact with "
                            f"make quantize") from None
    if not isinstance(data, dict):
        raise ArtifactError(f"{path} holds a JSON {type(data).__name__}, not an object; restore that file, or "
                            f"re-create the artifact with make quantize")
    return data


class Sealer:
    """Hash and fsync a directory's files in background threads, each one as soon as the writer says it is
    final, so that a shard's hashing and write-back run while the rest is written; `files()` seals the rest and
    waits. A file's hash and its fsync are separate tasks: the kernel starts writing a few GB back only when asked
    (far below its dirty-page thresholds on a large host), so the fsync is issued at once and the disk works while
    the hash is computed."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.pool = ThreadPoolExecutor(max_workers=min(16, 2 * usable_cores()), thread_name_prefix="seal")
        self.pending: dict[Path, tuple[Future, Future]] = {}
        self.handles: list[tuple[Future, int, Future, object]] = []  # the open files of `add`, by their task

    def add(self, path: Path) -> None:
        """`path` (under root) is written and will not change: fsync and hash it in the background. It is opened
        here, so the work follows the file if it is renamed (`rename`) before the work is done."""
        path = Path(path)
        if path not in self.pending:
            f = open(path, "rb")
            fd = os.dup(f.fileno())
            synced, digest = self.pool.submit(_fsync_and_close, fd), self.pool.submit(_hash_and_close, f)
            self.pending[path] = (synced, digest)
            self.handles.append((synced, fd, digest, f))

    def rename(self, path: Path, new: Path) -> None:
        """Rename a file given to `add` (its fsync and hash carry on: they read the open file)."""
        path, new = Path(path), Path(new)
        os.replace(path, new)
        if path in self.pending:
            self.pending[new] = self.pending.pop(path)

    def files(self) -> dict[str, FileRecord]:
        """Every file under root except the manifest -> its sha256 and bytes, each fsynced (those not yet added
        are sealed now, in parallel), in path order."""
        files = [p for p in sorted(self.root.rglob("*")) if p.is_file() and p.name != MANIFEST]
        for p in files:
            self.add(p)
        out = {}
        for p in files:
            synced, digest = self.pending[p]
            synced.result()
            out[str(p.relative_to(self.root))] = FileRecord(sha256=digest.result(), bytes=p.stat().st_size)
        return out

    def close(self) -> None:
        """Stop: queued work is dropped, running work finishes (call before the directory is removed or renamed)."""
        self.pool.shutdown(wait=True, cancel_futures=True)
        for synced, fd, digest, f in self.handles:  # a dropped task never closed its file
            if synced.cancelled():
                os.close(fd)
            if digest.cancelled():
                f.close()
        self.handles = []


def _fsync_and_close(fd: int) -> None:
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _hash_and_close(f) -> str:
    with f:
        return sha256_of(f)


def write(root: Path, extras: Manifest, sealer: Sealer | None = None) -> Manifest:
    """Hash (and fsync) every file under root and write the manifest: extras + `files` -> the manifest. sealer:
    the one the files were written under (those it was given are sealed already or under way); without one, all
    are sealed here, in parallel threads."""
    manifest = extras.written().model_copy()
    own = sealer is None
    sealer = Sealer(root) if own else sealer
    try:
        manifest.files = sealer.files()  # an assignment: `files` counts as set, so it is written
    finally:
        if own:
            sealer.close()
    (Path(root) / MANIFEST).write_text(json.dumps(manifest.to_json(), indent=2, sort_keys=False) + "\n")
    return manifest


def add_report(root: Path, report_passed: bool, card: str | None) -> None:
    """Record the eval report's files (and the model card re-rendered with its numbers) in the manifest, each
    write atomic; call after report.json and report.md are written."""
    root = Path(root)
    m = read(root)
    if m is None:
        return
    m.report = ReportHashes.model_validate({**{n: sha256_file(root / n) for n in REPORT_FILES},
                                            "passed": report_passed})
    if card is not None:
        atomic_write_text(root / CARD, card)
        m.files[CARD] = FileRecord(sha256=sha256_file(root / CARD), bytes=(root / CARD).stat().st_size)
    atomic_write_text(root / MANIFEST, json.dumps(m.to_json(), indent=2) + "\n")


def report_hash_ok(root: Path) -> bool:
    """The report files are the ones the manifest recorded."""
    path = Path(root) / MANIFEST
    m = parse(Seal, read_json(path), path) if path.is_file() else None
    recorded = m.report.hashes() if m is not None and m.report is not None else {}
    return all(hashlib.sha256((Path(root) / n).read_bytes()).hexdigest() == h for n, h in recorded.items())


def verify(path: Path) -> bool:
    """Check the artifact against its manifest -> True; False if there is no manifest (another tool's directory).
    Raises ArtifactError naming each file that breaks the closed set: such an artifact is refused."""
    root = Path(path)
    mpath = root / MANIFEST
    if mpath.is_symlink():
        raise ArtifactError(f"{root}: refused, {MANIFEST} is a symlink")
    if not mpath.is_file():
        return False
    try:
        m = parse(Seal, read_json(mpath), mpath)
    except ArtifactError as e:
        raise ArtifactError(f"{root}: refused, {e}") from None
    expected = {name: rec.sha256 for name, rec in m.files.items()}
    expected.update(m.report.hashes() if m.report is not None else {})
    bad = _unlisted(root, set(expected) | {MANIFEST})
    base = root.resolve()
    inside = {n for n in expected if not (Path(n).is_absolute() or ".." in Path(n).parts
                                          or base not in (root / n).resolve().parents)}
    regular = sorted(n for n in inside if not (root / n).is_symlink() and (root / n).is_file())
    with ThreadPoolExecutor(max_workers=min(8, usable_cores())) as pool:  # shards in parallel: GBs each
        actual = dict(zip(regular, pool.map(lambda n: sha256_file(root / n), regular)))
    for name, sha in sorted(expected.items()):
        if name not in inside:
            bad.append(f"{name} (its path leads outside the artifact)")
        elif (root / name).is_symlink():
            continue  # named by _unlisted
        elif name not in actual:
            bad.append(f"{name} (missing)")
        elif actual[name] != sha:
            bad.append(f"{name} (sha256 differs from the manifest)")
    if bad:
        shown = bad[:10] + ([f"and {len(bad) - 10} more"] if len(bad) > 10 else [])
        raise ArtifactError(f"{root}: refused, the manifest does not verify: {', '.join(shown)}")
    return True


def files_fingerprint(manifest: Manifest | None) -> str:
    """sha256 over the (name, sha256) pairs of an artifact's files, its model card excepted (the eval rewrites
    that): a report records the one it scored, so a report can never vouch for files it did not see."""
    files = manifest.files if manifest is not None else {}
    pairs = sorted((n, rec.sha256) for n, rec in files.items() if n != CARD)
    return hashlib.sha256(json.dumps(pairs).encode()).hexdigest()


def _unlisted(root: Path, listed: set[str]) -> list[str]:
    """Entries under root that a closed artifact may not hold: symlinks, special files, files not listed."""
    bad = []
    for dirpath, dirnames, filenames in os.walk(root):  # does not follow symlinked directories
        for n in sorted(dirnames + filenames):
            p = Path(dirpath) / n
            rel = str(p.relative_to(root))
            if p.is_symlink():
                bad.append(f"{rel} (a symlink, to {os.readlink(p)})")
            elif n in filenames and not p.is_file():
                bad.append(f"{rel} (not a regular file)")
            elif n in filenames and rel not in listed:
                bad.append(f"{rel} (not listed in the manifest)")
    return bad

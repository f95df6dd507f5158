"""Write an artifact directory atomically: sharded safetensors, config, tokenizer, recipe, manifest.

Everything is written into a temporary sibling directory, fsynced, and renamed into place, so an
interrupted run never leaves a directory that looks finished. The manifest records the sha256 of every
file, so a reader can verify the artifact before trusting it.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import yaml
from huggingface_hub.constants import SAFETENSORS_INDEX_FILE, SAFETENSORS_SINGLE_FILE
from safetensors.torch import save_file

from ..errors import UserError
from .. import manifest
from ..records import Manifest
from ..files import DiskFullError, disk_full_errno, fsync_path, human_bytes, usable_cores

log = logging.getLogger(__name__)

class OutputExistsError(UserError, FileExistsError):
    pass


class ExportError(UserError, OSError):
    """The operating system refused a write or rename of the artifact (not a full disk); nothing was left behind."""


class NonFiniteTensorError(UserError, FloatingPointError):
    """A tensor bound for an artifact holds NaN or inf; nothing was written."""


def nonfinite(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """name -> "(n of N values NaN or inf)" for each floating tensor holding NaN or inf."""
    bad = {}
    for name in sorted(tensors):
        t = tensors[name]
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad[name] = f"({int((~torch.isfinite(t)).sum())} of {t.numel()} values NaN or inf)"
    return bad


def check_finite(tensors: dict[str, torch.Tensor], origin: str, found: dict[str, str] | None = None) -> None:
    """Refuse NaN/inf in any floating tensor bound for an artifact (unquantized norms, embeddings, lm_head,
    scales): a NaN there is silent garbage that vLLM would serve. Raises NonFiniteTensorError naming them.
    found: `nonfinite` of further tensors of the same artifact, checked elsewhere (named with these)."""
    bad = {**nonfinite(tensors), **(found or {})}
    bad = [f"{name} {bad[name]}" for name in sorted(bad)]
    if bad:
        raise NonFiniteTensorError(
            f"{len(bad)} tensor(s) to be written hold NaN or inf: {', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}"
            f"; nothing was written. Check the same tensors in {origin}: if they are non-finite there, the "
            f"checkpoint is damaged (re-download or re-convert it); if not, rerun with `dtype: bfloat16` or "
            f"`compute_dtype: float32` in the recipe")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """`t` with a storage of exactly its own bytes: huggingface_hub sizes a tensor by its storage and groups
    tensors that share one, so a view into a larger buffer is copied out (a whole tensor is not)."""
    t = t.contiguous()
    return t if t.untyped_storage().nbytes() == _nbytes(t) else t.clone()


class ShardWriter:
    """Safetensors shards filled in the order tensors are added, each written by a thread as soon as it is full:
    a caller that adds tensors as it makes them (`export.stream.WeightStream`, during the pass) has most of its
    files written, hashed and synced by the time it calls `finish`.

    The rule is huggingface_hub's splitter's (`split_torch_state_dict_into_shards`) over the tensors in the order
    added: a new shard when the next tensor would pass max_shard_bytes, a tensor larger than that alone in a
    shard of its own. Shards are written under hidden names and renamed by `finish` to model.safetensors (one
    shard) or model-0000i-of-0000n.safetensors with the index (`metadata.total_size`, the weight map in name
    order). on_written(path): called with each shard once it is complete (`manifest.Sealer.add`); rename(old,
    new): how finish renames (`manifest.Sealer.rename`, whose work follows the file).

    Shards are written by parallel threads (safetensors writes without holding the GIL: two 600 MB shards took
    1.55 s side by side against 2.94 s one after the other on a 2-core box); `finish` raises the first shard's
    error once every writer has stopped.
    """

    def __init__(self, out: Path, max_shard_bytes: int, on_written: Callable[[Path], object] | None = None,
                 rename: Callable[[Path, Path], object] = os.replace):
        self.out, self.max, self.on_written, self.rename = Path(out), max_shard_bytes, on_written, rename
        self.pool = ThreadPoolExecutor(max_workers=max(1, min(8, usable_cores())), thread_name_prefix="shard")
        self.current: dict[str, torch.Tensor] = {}
        self.current_bytes = 0
        self.shards: list[list[str]] = []  # tensor names of each shard, in shard order
        self.futures: list = []
        self.total = 0

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        """Append tensors (in this order) to the shards."""
        for name, t in tensors.items():
            t = _own_storage(t)
            n = _nbytes(t)
            self.total += n
            if n > self.max:
                self._flush({name: t})
                continue
            if self.current and self.current_bytes + n > self.max:
                self._flush(self.current)
                self.current, self.current_bytes = {}, 0
            self.current[name] = t
            self.current_bytes += n

    def _part(self, i: int) -> Path:
        return self.out / f".shard-{i:05d}.safetensors"

    def _flush(self, tensors: dict[str, torch.Tensor]) -> None:
        self.shards.append(list(tensors))
        self.futures.append(self.pool.submit(self._write, dict(tensors), self._part(len(self.shards))))

    def _write(self, tensors: dict[str, torch.Tensor], path: Path) -> None:
        save_file(tensors, str(path), metadata={"format": "pt"})
        if self.on_written is not None:
            self.on_written(path)

    def finish(self) -> list[str]:
        """Write what is left, wait for every shard, name them, write the index -> the file names."""
        if self.current or not self.shards:
            self._flush(self.current)
            self.current, self.current_bytes = {}, 0
        self.close()
        for f in self.futures:
            f.result()  # the first shard's error, in shard order
        n = len(self.shards)
        files = [SAFETENSORS_SINGLE_FILE] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors"
                                                           for i in range(1, n + 1)]
        for i, fname in enumerate(files, 1):
            self.rename(self._part(i), self.out / fname)
        if n == 1:
            return files
        weight_map = {name: fname for fname, names in zip(files, self.shards) for name in names}
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out / SAFETENSORS_INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return [*files, SAFETENSORS_INDEX_FILE]

    def close(self) -> None:
        """Stop taking work; running writes finish (call before the directory is removed)."""
        self.pool.shutdown(wait=True)


def _readable(root: Path) -> None:
    """Files as the user's umask allows (safetensors writes 0600): a registry or server reads them later."""
    umask = os.umask(0)
    os.umask(umask)
    for p in root.rglob("*"):
        os.chmod(p, (0o755 if p.is_dir() else 0o644) & ~umask)
    os.chmod(root, 0o755 & ~umask)


def temp_name(out: Path) -> str:
    """The glob of `out`'s temporary directories (written, then renamed to `out`)."""
    return f".{out.name}.tmp-*"


class AtomicDir:
    """An artifact directory written in a temporary sibling and renamed into place once complete. Opened before
    the work that fills it (the weights are written while the pass computes them: `WeightStream`); `commit`
    seals it, `abort` (or leaving the `with` block without a commit) removes it.

    On any failure (an interrupt included) the temporary directory is removed and a previous `out` is in place;
    a full disk raises DiskFullError, another refused write or rename ExportError, each saying so.
    """

    def __init__(self, out: Path, force: bool = False):
        out = Path(out)
        if out.exists() and not force:
            raise OutputExistsError(f"output {out} already exists; remove it or pass --force (make ... FORCE=1)")
        out.parent.mkdir(parents=True, exist_ok=True)
        self.out = out
        self.tmp = out.parent / temp_name(out).replace("*", uuid.uuid4().hex[:8])
        self.tmp.mkdir()
        self.sealer = manifest.Sealer(self.tmp)
        self.done = False
        self.replaced_s = 0.0  # seconds `commit` spent removing the previous artifact that --force replaced

    def __enter__(self) -> "AtomicDir":
        return self

    def __exit__(self, kind, e, tb) -> bool:
        if not self.done:
            mapped = self.abort(e)
            if mapped is not None and mapped is not e:
                raise mapped from e
        return False  # e itself goes on

    def commit(self, extras: Manifest) -> Path:
        """Hash (those not hashed yet) and fsync every file, write the manifest, rename the directory to `out`."""
        try:
            manifest.write(self.tmp, extras, self.sealer)
            self.sealer.close()
            _readable(self.tmp)
            for p in [self.tmp / manifest.MANIFEST, *(d for d in self.tmp.rglob("*") if d.is_dir()), self.tmp]:
                fsync_path(p)
            old = swap_in(self.tmp, self.out)
        except BaseException as e:
            mapped = self.abort(e)
            if mapped is not e:
                raise mapped from e
            raise
        self.done = True
        if old is not None:  # timed apart from the seal: 1.1 s for a 5.6 GB artifact on the 2-core box, 1.8-2.2 s
            t0 = time.perf_counter()  # on the H100 and H200 hosts (docs/BENCHMARKS.md)
            remove_path(old)
            self.replaced_s = time.perf_counter() - t0
        return self.out

    def abort(self, e: BaseException | None = None) -> BaseException | None:
        """Remove the temporary directory -> the error a user reads for `e` (a full disk, another OSError: each
        saying so) or `e` itself."""
        self.done = True
        self.sealer.close()  # no thread still reads a file of tmp
        written = _tree_bytes(self.tmp)
        shutil.rmtree(self.tmp, ignore_errors=True)
        if e is None or isinstance(e, (ExportError, DiskFullError)):
            return e
        code = disk_full_errno(e)
        if code is not None:
            return _disk_full(self.out, written, code)
        if isinstance(e, OSError):
            return ExportError(f"writing the artifact {self.out} failed: {e}; the partial files were removed and "
                               f"{_state(self.out)}. Fix the cause (permissions, the disk) or write elsewhere with "
                               f"--out DIR, then rerun")
        return e


def swap_in(tmp: Path, out: Path) -> Path | None:
    """Rename tmp to out; a previous out is moved aside first and moved back if the second rename fails -> where
    the previous out now is (the caller removes it), None where there was none."""
    if not out.exists():
        os.replace(tmp, out)
        return None
    old = out.parent / old_name(out).replace("*", uuid.uuid4().hex[:8])
    os.replace(out, old)
    try:
        os.replace(tmp, out)
    except BaseException as e:
        try:
            os.replace(old, out)
        except OSError as again:
            raise ExportError(f"writing the artifact {out} failed at the final rename ({e}), and moving the "
                              f"previous artifact back failed too ({again}): it is in {old}; rename it to {out}") from e
        raise
    return old


def remove_path(path: Path) -> None:
    """Remove a directory tree or a single file (what `--force` moved aside may be either)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def old_name(out: Path) -> str:
    """The glob of where `--force` moves a previous `out` while the new one is renamed into place."""
    return f".{out.name}.old-*"


def remove_stale(out: Path) -> list[str]:
    """Clean up after a run of `out` that was killed while exporting (call with `out`'s lock held, so no live
    run owns these) -> what was done, each also logged as a warning.

    Killed before its first rename: only its temporary directory is left, and is removed. Killed between the two
    renames of `--force` (no `out`, the previous one in `.<name>.old-*`): the previous artifact is put back, as
    if the killed run had never started, and its unfinished new one removed. Killed after both: the swap is
    finished by removing the previous artifact."""
    out = Path(out)
    if not out.parent.is_dir():
        return []
    done = []
    for old in sorted(out.parent.glob(old_name(out)), key=lambda p: p.stat().st_mtime, reverse=True):
        if not out.exists() and not out.is_symlink():
            os.replace(old, out)
            done.append(f"a run of {out} was killed while replacing it: put back the previous artifact from "
                        f"{old.name}")
        else:
            remove_path(old)
            done.append(f"a run of {out} was killed after replacing it: finished the replacement by removing the "
                        f"previous artifact {old.name}")
    for tmp in sorted(out.parent.glob(temp_name(out))):
        remove_path(tmp)
        done.append(f"removed {tmp.name}, the unfinished artifact of a killed run of {out}")
    for line in done:
        log.warning("%s", line)
    return done


def _tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if root.exists() else 0


def _state(out: Path) -> str:
    return f"the previous {out} is untouched" if out.exists() else f"{out} was not created"


def _disk_full(out: Path, written: int, code: int) -> DiskFullError:
    what = "disk is full" if code == errno.ENOSPC else "disk quota is exceeded"
    free = shutil.disk_usage(out.parent).free
    return DiskFullError(
        f"the {what} on {out.parent.resolve()} while writing the artifact ({human_bytes(written)} written when "
        f"it failed: {os.strerror(code)}); the partial files were removed and {_state(out)}. {human_bytes(free)} are "
        f"free there now: free more space on that disk or write elsewhere with --out DIR, then rerun")


def write_model_dir(tmp: Path, model, quantization_config: dict, dtype: torch.dtype, source_dir: Path,
                    copy_files: tuple[str, ...], recipe_dict: dict) -> list[str]:
    """Fill an artifact directory beside its weights (`stream.WeightStream`): config.json, tokenizer files,
    recipe.yaml -> the files copied."""
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["quantization_config"] = quantization_config
    config["dtype"] = str(dtype).removeprefix("torch.")
    config.pop("torch_dtype", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    copied = []
    for fname in copy_files:
        if (source_dir / fname).is_file():
            shutil.copy2(source_dir / fname, tmp / fname)
            copied.append(fname)
    (tmp / "recipe.yaml").write_text(yaml.safe_dump(recipe_dict, sort_keys=False))
    return copied

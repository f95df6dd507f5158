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
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import yaml
from huggingface_hub import split_torch_state_dict_into_shards
from huggingface_hub.constants import SAFETENSORS_INDEX_FILE
from safetensors.torch import save_file

from ..errors import UserError
from .. import manifest
from ..records import Manifest
from ..files import fsync_path
from ..preflight.checks import human_bytes
from ..recipe import parse_size

log = logging.getLogger(__name__)

class OutputExistsError(UserError, FileExistsError):
    pass


class DiskFullError(UserError, OSError):
    """The disk filled up (or a quota was hit) while an artifact was written; nothing was left behind."""


class ExportError(UserError, OSError):
    """The operating system refused a write or rename of the artifact (not a full disk); nothing was left behind."""


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
# How libraries that wrap the OS error say it: safetensors (Rust) "... (os error 28)"; torch.save to a path
# loses the errno, to a file object keeps the OSError as the RuntimeError's __context__.
_DISK_FULL_TEXT = {errno.ENOSPC: ("No space left on device", f"(os error {errno.ENOSPC})"),
                   errno.EDQUOT: ("Disk quota exceeded", f"(os error {errno.EDQUOT})")}


def disk_full_errno(e: BaseException | None) -> int | None:
    """ENOSPC / EDQUOT if `e`, or an exception it was raised from, says the disk is full -> errno, else None."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in DISK_FULL:
            return e.errno
        for code, texts in _DISK_FULL_TEXT.items():
            if not isinstance(e, OSError) and any(t in str(e) for t in texts):
                return code
        e = e.__cause__ or e.__context__
    return None


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


def write_sharded(tensors: dict[str, torch.Tensor], out: Path, max_shard_bytes: int,
                  on_written: Callable[[Path], object] | None = None) -> list[str]:
    """Write safetensors shards (model.safetensors, or model-0000i-of-0000n + index) -> file names.

    huggingface_hub's splitter decides the shards: tensors in name order, a new shard when the next one would
    pass max_shard_bytes, a tensor larger than that alone in a shard of its own. The index is its format
    (`metadata.total_size`, `weight_map`), with the weight map in name order. on_written(path): called with each
    shard once it is complete (`manifest.Sealer.add`).

    Shards are written by parallel threads (safetensors writes without holding the GIL: two 600 MB shards took
    1.55 s side by side against 2.94 s one after the other on a 2-core box); the first error is raised once every
    shard's writer has stopped.
    """
    tensors = {name: _own_storage(tensors[name]) for name in sorted(tensors)}
    split = split_torch_state_dict_into_shards(tensors, max_shard_size=max_shard_bytes)

    def one(item: tuple[str, list[str]]) -> None:
        fname, names = item
        save_file({n: tensors[n] for n in names}, str(out / fname), metadata={"format": "pt"})
        if on_written is not None:
            on_written(out / fname)

    shards = list(split.filename_to_tensors.items())
    with ThreadPoolExecutor(max_workers=max(1, min(len(shards), 8, os.cpu_count() or 1)),
                            thread_name_prefix="shard") as pool:
        futures = [pool.submit(one, item) for item in shards]
    for f in futures:
        f.result()  # the first shard's error, in shard order
    files = list(split.filename_to_tensors)
    if not split.is_sharded:
        return files
    index = {"metadata": split.metadata, "weight_map": dict(sorted(split.tensor_to_filename.items()))}
    (out / SAFETENSORS_INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return [*files, SAFETENSORS_INDEX_FILE]


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


def atomic_write_dir(out: Path, fill: Callable[[Path, manifest.Sealer], Manifest], force: bool = False) -> Path:
    """Call fill(tmp_dir, sealer) -> the manifest but its files; add file hashes; fsync; rename tmp_dir to `out`.
    fill may hand the sealer each large file as soon as it is final, to be hashed and fsynced meanwhile.

    On any failure (an interrupt included) the temporary directory is removed and a previous `out` is in place;
    a full disk raises DiskFullError, another refused write or rename ExportError, each saying so.
    """
    out = Path(out)
    if out.exists() and not force:
        raise OutputExistsError(f"output {out} already exists; remove it or pass --force (make ... FORCE=1)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / temp_name(out).replace("*", uuid.uuid4().hex[:8])
    tmp.mkdir()
    sealer = manifest.Sealer(tmp)
    try:
        extras = fill(tmp, sealer)
        manifest.write(tmp, extras, sealer)
        sealer.close()
        _readable(tmp)
        for p in [tmp / manifest.MANIFEST, *(d for d in tmp.rglob("*") if d.is_dir()), tmp]:
            fsync_path(p)
        _swap_in(tmp, out)
    except BaseException as e:
        sealer.close()  # no thread still reads a file of tmp
        written = _tree_bytes(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, (ExportError, DiskFullError)):
            raise
        code = disk_full_errno(e)
        if code is not None:
            raise _disk_full(out, written, code) from e
        if isinstance(e, OSError):
            raise ExportError(f"writing the artifact {out} failed: {e}; the partial files were removed and "
                              f"{_state(out)}. Fix the cause (permissions, the disk) or write elsewhere with --out "
                              f"DIR, then rerun") from e
        raise
    return out


def _swap_in(tmp: Path, out: Path) -> None:
    """Rename tmp to out; a previous out is moved aside first and moved back if the second rename fails."""
    if not out.exists():
        os.replace(tmp, out)
        return
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
    _remove(old)  # a directory, or the file that --force replaced


def _remove(path: Path) -> None:
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
            _remove(old)
            done.append(f"a run of {out} was killed after replacing it: finished the replacement by removing the "
                        f"previous artifact {old.name}")
    for tmp in sorted(out.parent.glob(temp_name(out))):
        _remove(tmp)
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


def unconverted_tensors(model, converted: set[str], dtype: torch.dtype, drop: set[str],
                        overrides: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The model's tensors an artifact writes as they are: all but the `.weight` of each converted module and
    the names in `drop` (tied lm_head), floating ones cast to `dtype`, on the CPU. overrides: tensor name ->
    value replacing the model's (what a method changed in a copy of a layer)."""
    overrides = overrides or {}
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if name in drop or (name.endswith(".weight") and name.removesuffix(".weight") in converted):
            continue
        t = overrides.get(name, t)
        out[name] = t.detach().to("cpu", dtype) if t.is_floating_point() else t.detach().cpu()
    return out


def packed_tensors(packed: dict[str, dict[str, torch.Tensor]], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """module name -> {tensor suffix: packed tensor} -> "module.suffix" -> tensor, floating ones (scales) cast to
    `dtype`, integer ones as they are. With `unconverted_tensors`, every tensor of an artifact."""
    return {f"{module}.{suffix}": t.to(dtype) if t.is_floating_point() else t
            for module, d in packed.items() for suffix, t in d.items()}


def write_model_dir(tmp: Path, model, tensors: dict[str, torch.Tensor], quantization_config: dict,
                    dtype: torch.dtype, source_dir: Path, copy_files: tuple[str, ...], recipe_dict: dict,
                    max_shard_size: str, sealer: manifest.Sealer | None = None) -> list[str]:
    """Fill an artifact directory: weights, config.json, tokenizer files, recipe.yaml -> files copied. sealer:
    each weight shard is handed to it once written."""
    write_sharded(tensors, tmp, parse_size(max_shard_size), None if sealer is None else sealer.add)
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

"""A GGUF checkpoint -> a cached safetensors directory transformers and vLLM read.

A GGUF file (a local `.gguf`, or one shipped in a Python package) is refused from its header alone when its
architecture is not one we take, then dequantized once by transformers into `<cache>/gguf/<stem>-<sha>/`, which
runs started side by side share (one converts under a lock, the others wait for it). A conversion records the
file it was made from in its `source.json` (path, size, mtime, sha256, license), so later runs recognise the file
without hashing or parsing it again; a cache that does not hold what a finished conversion writes is rebuilt.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from filelock import FileLock
from safetensors import SafetensorError, safe_open

from . import ModelSource, ModelSourceError
from .arch import check_gguf_architecture
from ..errors import brief
from ..files import sha256_file
from ..paths import cache_dir

log = logging.getLogger(__name__)


def gguf_source(gguf: Path, spec: str) -> ModelSource:
    """A GGUF file -> its converted directory. Its header is read first, so that an unsupported model is refused
    before the file is hashed or converted; but reading it parses every metadata field, the tokenizer's
    vocabulary included (seconds), so a file that was already converted (same path, size and modification time)
    skips it: it passed that check then, and its converted config.json is checked again once loaded."""
    if not _converted_before(gguf):
        gguf_architecture(gguf, spec)
    path, sha = gguf_to_dir(gguf)
    return ModelSource(spec, path, "gguf", sha)


def _stamp(gguf: Path) -> dict:
    """What source.json records to recognise the file again without hashing it."""
    st = gguf.stat()
    return {"gguf": str(gguf), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _converted_before(gguf: Path) -> bool:
    """Whether a finished conversion in the cache was made from this file as it is now (path, size, mtime)."""
    try:
        stamp = _stamp(gguf)
        for d in (cache_dir() / "gguf").iterdir():
            if d.name.startswith(f"{gguf.stem}-"):
                with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
                    if {k: json.loads((d / "source.json").read_text()).get(k) for k in stamp} == stamp:
                        return True
    except OSError:  # no cache yet, or a cache root that is not a directory (the conversion reports it)
        pass
    return False


def gguf_architecture(gguf: Path, spec: str) -> str:
    """The transformers architecture of a GGUF file, from its metadata alone (nothing is converted or written);
    ModelSourceError for a file that is not GGUF, UnsupportedArchitecture for a model we cannot take."""
    from gguf import GGUFReader

    try:
        field = GGUFReader(str(gguf)).fields["general.architecture"]
        name = bytes(field.parts[field.data[0]]).decode("utf-8")
    except Exception as e:  # noqa: BLE001 - the parser's errors on arbitrary bytes are not one type
        raise ModelSourceError(f"model {spec!r}: {gguf} is not a readable GGUF file ({brief(e)}); re-download it "
                               f"or point the recipe's `model` at another file") from None
    return check_gguf_architecture(name, f"model {spec!r}")


def gguf_to_dir(gguf: Path) -> tuple[Path, str]:
    """Dequantize a GGUF checkpoint once into a cached bf16 safetensors directory -> (dir, gguf sha256).

    A cache that does not hold what a finished conversion writes (a killed conversion, a damaged file) is
    removed and rebuilt, with a warning."""
    sha = sha256_file(gguf)
    target = cache_dir() / "gguf" / f"{gguf.stem}-{sha[:16]}"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # Runs started side by side on one GGUF (a comparison and its peers, jobs sharing a GPU host) convert it
        # once: the first holds the lock while it converts, the others wait and then find the finished cache.
        lock = FileLock(target.parent / f".{target.name}.lock")
        lock.acquire()
    except OSError as e:  # the cache root, or a folder on its way, is a file or is not writable
        raise _cache_unwritable(target, e) from None
    try:
        return _convert_once(gguf, sha, target), sha
    finally:
        lock.release()


def _cache_unwritable(target: Path, e: OSError) -> ModelSourceError:
    blocking = next((p for p in (target.parent, *target.parent.parents) if p.exists() and not p.is_dir()), None)
    what = f"{blocking} is a file, not a directory" if blocking else f"{e.strerror}: {e.filename}"
    return ModelSourceError(
        f"the cache directory {cache_dir()} (QUANTIZE_CACHE_DIR) cannot hold the GGUF conversion: {what}; "
        f"{'move that file aside' if blocking else 'fix its permissions'}, or set QUANTIZE_CACHE_DIR to a "
        f"directory you can write")


def _convert_once(gguf: Path, sha: str, target: Path) -> Path:
    """Under the conversion lock: the cached directory, converted now if missing or damaged."""
    if target.exists():
        damage = _cache_damage(target, sha)
        if damage is None:
            _restamp(target, gguf, sha)
            return target
        log.warning("GGUF conversion cache %s is damaged (%s); removing it and converting again", target, damage)
        shutil.rmtree(target)
    log.info("converting GGUF %s to safetensors (once; cached at %s)", gguf, target)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    except OSError as e:
        raise _cache_unwritable(target, e) from None
    try:
        _convert_gguf(gguf, tmp)
        (tmp / "source.json").write_text(json.dumps({**_stamp(gguf), "sha256": sha, **_license(gguf)}, indent=2))
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _restamp(target: Path, gguf: Path, sha: str) -> None:
    """Record the file as it is now in a finished conversion of the same bytes (a cache made before source.json
    held the stamp, or a file touched since), so the next run recognises it without reading its metadata."""
    src = target / "source.json"
    with contextlib.suppress(OSError, ValueError):
        old = json.loads(src.read_text())
        stamp = {**_stamp(gguf), "sha256": sha, **({"license": old["license"]} if "license" in old else _license(gguf))}
        if old != stamp:
            tmp = target / ".source.json.tmp"
            tmp.write_text(json.dumps(stamp, indent=2))
            os.replace(tmp, src)


def gguf_license(gguf: Path) -> str | None:
    """`general.license` from a GGUF file's metadata (None when it has none); ValueError for an unreadable file.
    The reader indexes every tensor too (about 2 s for SmolLM2's 272 on a 2-core host), so a conversion records
    the answer in its source.json once."""
    from gguf import GGUFReader

    try:
        field = GGUFReader(str(gguf)).fields.get("general.license")
        return bytes(field.parts[field.data[0]]).decode("utf-8") if field is not None else None
    except Exception as e:  # noqa: BLE001 - the parser's errors on arbitrary bytes are not one type
        raise ValueError(f"{gguf} is not a readable GGUF file ({e})") from None


def _license(gguf: Path) -> dict:
    """{"license": ...} for source.json, or {} when the file cannot be read (the model card then reads it)."""
    try:
        return {"license": gguf_license(gguf)}
    except (OSError, ValueError):
        return {}


def _cache_damage(target: Path, sha: str) -> str | None:
    """What is wrong with a GGUF conversion cache -> a phrase, or None when it is complete (source.json names
    this GGUF, config.json parses, every safetensors header matches its file's size)."""
    try:
        if json.loads((target / "source.json").read_text())["sha256"] != sha:
            return "source.json names another GGUF file"
        json.loads((target / "config.json").read_text())
        files = sorted(target.glob("*.safetensors"))
        if not files:
            return "no safetensors files"
        for f in files:
            with safe_open(str(f), framework="pt"):
                pass
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as e:
        return brief(e)
    return None


def _convert_gguf(gguf: Path, into: Path) -> None:
    """transformers' GGUF loader, dequantizing to bf16, saved as a safetensors checkpoint with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        quantization_config=GgufConfig(gguf_file=gguf.name, dequantize=True),
        dtype=torch.bfloat16,
    )
    # The GGUF quantizer stays attached after dequantizing; a saved config must not claim GGUF.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(into)
    tok.save_pretrained(into)

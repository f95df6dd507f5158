"""A checkpoint's tensors must be exactly what its config.json describes, checked before any weight loads.

transformers fills a tensor missing from the safetensors with random values and loads the rest (a warning at
most), so a checkpoint with a lost shard, a layer too few, or a config from another model size would be quantized
and shipped. Here the model is built on the meta device from the config (shapes only) and its state_dict is
compared name by name and shape by shape with the safetensors headers (read by safetensors itself; no tensor data
is read): every expected tensor present with its shape, nothing unexpected. Parameters the model shares (a tied
lm_head) need only one of their names in the files.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .arch import Arch, checkpoint_name
from .experts import split_experts
from . import ModelSource, ModelSourceError
from ..errors import brief

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def weight_files(src: ModelSource) -> list[Path]:
    """The safetensors files transformers loads (model.safetensors, else the index's shards) -> paths."""
    d = src.path
    if (d / SINGLE).is_file():
        return [d / SINGLE]
    if not (d / INDEX).is_file():
        raise ModelSourceError(f"model {src.spec!r}: {d} has neither {SINGLE} nor {INDEX}; transformers would load "
                               f"no weights from it. Point the recipe's `model` at a complete checkpoint")
    try:
        weight_map = json.loads((d / INDEX).read_text(encoding="utf-8"))["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ModelSourceError(f"model {src.spec!r}: {d / INDEX} is not a valid safetensors index ({brief(e)}); "
                               f"re-download or re-export the checkpoint") from None
    missing = [s for s in shards if not (d / s).is_file()]
    if missing:
        raise ModelSourceError(f"model {src.spec!r}: {INDEX} lists shards that are not in {d}: "
                               f"{', '.join(missing[:5])}; re-download the missing files")
    return [d / s for s in shards]


def read_shapes(src: ModelSource, files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Every tensor name in the files' headers -> its shape (safetensors validates each header against its
    file's size, so a truncated or empty file fails here)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for k in st.keys():
                    shapes[k] = tuple(st.get_slice(k).get_shape())
        except (SafetensorError, OSError) as e:
            raise ModelSourceError(f"model {src.spec!r}: {f} is not a readable safetensors file ({brief(e)}): it "
                                   f"is truncated or corrupt; {_remedy(src)}") from None
    return shapes


def meta_model(src: ModelSource, config, trust_remote_code: bool):
    """The model built from its config on the meta device (no memory); ModelSourceError if the config cannot."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError) as e:
        raise ModelSourceError(f"model {src.spec!r}: {src.path / 'config.json'} does not describe a model that can "
                               f"be built ({brief(e)}); fix or re-download config.json") from None


def check_tensors(src: ModelSource, config, arch: Arch, trust_remote_code: bool = False) -> None:
    """Refuse (ModelSourceError) a checkpoint whose tensors differ from what config.json describes."""
    files = weight_files(src)
    found = read_shapes(src, files)
    meta = meta_model(src, config, trust_remote_code)
    split_experts(meta, arch)  # checkpoints hold one tensor per expert
    params = {checkpoint_name(arch, n): t for n, t in meta.state_dict(keep_vars=True).items()}
    aliases: dict[int, list[str]] = {}
    for name, t in params.items():
        aliases.setdefault(id(t), []).append(name)
    problems, missing = [], []
    for names in aliases.values():
        present = [n for n in names if n in found]
        if not present:  # a shared parameter (tied lm_head) needs one of its names only
            missing.append(names[0])
        for n in present:
            want = tuple(params[n].shape)
            if found[n] != want:
                problems.append(f"{n} has shape {list(found[n])} but config.json implies {list(want)}")
    unexpected = sorted(set(found) - set(params))
    layers = _layer_count_problem(config, arch, found)
    if layers:
        problems.insert(0, layers)
    if missing:
        problems.append(f"{len(missing)} tensor(s) missing from the weights: {_names(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} tensor(s) in the weights that the model does not have: {_names(unexpected)}")
    if problems:
        where = ", ".join(f.name for f in files[:3]) + (" ..." if len(files) > 3 else "")
        raise ModelSourceError(f"model {src.spec!r}: the weights ({where}) do not match config.json: "
                               f"{'; '.join(problems[:4])}. transformers would fill missing tensors with random "
                               f"values; {_remedy(src, 'fix config.json or restore the complete weight files')}")


def _remedy(src: ModelSource, usual: str = "re-download or re-export it") -> str:
    if src.kind == "gguf":  # our own conversion cache: rebuilt when removed
        return f"delete the GGUF conversion cache {src.path} and rerun to convert the GGUF file again"
    return usual


def _layer_count_problem(config, arch: Arch, found: dict) -> str | None:
    prefix = f"{arch.layers}."
    indices = {int(n[len(prefix):].split(".", 1)[0]) for n in found
               if n.startswith(prefix) and n[len(prefix):].split(".", 1)[0].isdigit()}
    want = config.get_text_config().num_hidden_layers
    if indices and (len(indices) != want or max(indices) != want - 1):
        return (f"config.json num_hidden_layers is {want} but the weights hold {len(indices)} decoder layers "
                f"({prefix}{min(indices)} to {prefix}{max(indices)})")
    return None


def _names(names: list[str], limit: int = 4) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")

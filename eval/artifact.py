"""Read a 4-bit artifact directory back into a transformers model, decoding its packed tensors with our code.

Works on any AutoAWQ-GEMM, GPTQ (v1 or v2, act-order g_idx included) or compressed-tensors pack-quantized
directory (ours or another tool's): the dequantized weights are what vLLM
computes with, so scoring this model scores the artifact itself, not pre-pack fake-quant weights.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from quantize import formats
from quantize.formats.checks import TensorError
from quantize.source.arch import ARCHITECTURES, arch_for, attn_implementation, checkpoint_name
from quantize.source.experts import split_experts
from quantize.manifest import ArtifactError


def safetensors_files(path: Path) -> list[Path]:
    """The (sharded) safetensors files of a checkpoint directory; ArtifactError if there are none."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ArtifactError(f"{path} has no .safetensors files")
    return files


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a (sharded) safetensors checkpoint directory."""
    out: dict[str, torch.Tensor] = {}
    for f in safetensors_files(path):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                out[k] = st.get_tensor(k)
    return out


def quantization_format(path: Path) -> tuple[formats.Format, dict, int]:
    """An artifact's config.json -> (its format, quantization_config, bits); ArtifactError, saying what to do, for
    a directory the eval cannot decode. Cheap: the eval asks it first, before it scores anything."""
    config = json.loads((Path(path) / "config.json").read_text())
    qcfg = config.get("quantization_config")
    if not qcfg or not isinstance(qcfg, dict):
        raise ArtifactError(f"{path}/config.json has no quantization_config: the eval scores 4-bit directories "
                            f"(AWQ GEMM, GPTQ, compressed-tensors); give the quantized model's directory")
    method = qcfg.get("quant_method")
    fmt = formats.by_quant_method(method)
    known = ", ".join(f.quant_method for f in formats.REGISTRY.values())
    if fmt is None:
        raise ArtifactError(f"{path}: quant_method {method!r} is not readable here (only {known}); evaluate it "
                            f"with the tool that wrote it, or export it in one of these formats")
    try:
        return fmt, qcfg, fmt.read_config(qcfg)
    except ValueError as e:
        raise ArtifactError(f"{path}: config.json's quantization_config: {e}; export it in a layout the eval reads "
                            f"({known})") from None


def decoded_tensors(path: Path, device: torch.device | str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Artifact dir -> (name, tensor) one at a time: each packed linear decoded on `device` to its `.weight`
    (float32), every other tensor as stored. Only one module's tensors are held at a time, so a 7B artifact
    never needs a whole decoded copy in host memory."""
    fmt, qcfg, bits = quantization_format(path)
    with ExitStack() as stack:
        where = {}  # tensor name -> the open shard that holds it
        for f in safetensors_files(path):
            st = stack.enter_context(safe_open(str(f), framework="pt"))
            where.update({k: st for k in st.keys()})
        marker = "." + fmt.packed_tensor
        used: set[str] = set()
        for m in [k.removesuffix(marker) for k in where if k.endswith(marker)]:
            names = [f"{m}.{s}" for s in fmt.tensors if f"{m}.{s}" in where]
            own = {n.removeprefix(f"{m}."): where[n].get_tensor(n).to(device) for n in names}
            used.update(names)
            yield f"{m}.weight", _decode(fmt, own, qcfg, bits, m, Path(path))
        for name, st in where.items():
            if name not in used:
                yield name, st.get_tensor(name)


def _decode(fmt: formats.Format, own: dict[str, torch.Tensor], qcfg: dict, bits: int, module: str,
            path: Path) -> torch.Tensor:
    """One linear's tensors -> its weight; ArtifactError naming the tensor its layout cannot hold."""
    try:
        return fmt.decode(own, qcfg, bits)
    except TensorError as e:
        raise ArtifactError(f"{path}: cannot decode {module}.{e.tensor}: it {e}. The file does not hold the "
                            f"{fmt.title} layout config.json declares: export the directory again with the tool "
                            f"that wrote it, or correct config.json's quantization_config") from None


def dequantized_state_dict(path: Path, dtype: torch.dtype = torch.float32) -> tuple[dict[str, torch.Tensor], dict]:
    """Artifact dir -> (state dict with every packed linear decoded to `.weight`, quantization_config)."""
    out = {name: t.to(dtype) if t.is_floating_point() else t for name, t in decoded_tensors(path)}
    return out, json.loads((Path(path) / "config.json").read_text())["quantization_config"]


def empty_model(config, dtype: torch.dtype, device: torch.device | str):
    """A transformers causal LM of `config` allocated on `device` without running its initializers (every
    parameter is overwritten next); buffers computed at construction (rotary frequencies) are real. Its attention
    is the one the architecture table names (as calibration ran it)."""
    from transformers import AutoModelForCausalLM

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers releases that keep it in modeling_utils
        from transformers.modeling_utils import no_init_weights

    with torch.device(device), no_init_weights():
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation(config))


def load_dequantized(path: Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
    """Artifact dir -> transformers causal LM on `device` (eval mode) holding the decoded weights.

    The model is allocated empty on the device and filled tensor by tensor as the artifact is decoded there:
    one copy of the model, on the device, plus one module's temporaries.
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = empty_model(config, dtype, device)
    arch = arch_for(config) if any(n in ARCHITECTURES for n in config.architectures or []) else None
    if arch is not None:  # a MoE artifact holds one linear per expert (Mixtral's under its checkpoint names)
        split_experts(model, arch)
    params = {checkpoint_name(arch, n) if arch else n: t for n, t in model.state_dict().items()}
    filled, unexpected, wrong = set(), [], []
    with torch.no_grad():
        for name, t in decoded_tensors(path, device):
            if name not in params:
                unexpected.append(name)
            elif params[name].shape != t.shape:
                wrong.append(f"{name} {list(t.shape)} (model: {list(params[name].shape)})")
            else:
                params[name].copy_(t)
                filled.add(name)
    tied = config.get_text_config().tie_word_embeddings
    missing = [m for m in params if m not in filled and not (m == "lm_head.weight" and tied)]
    if missing or unexpected or wrong:
        raise ArtifactError(f"{path}: tensors do not match the architecture its config.json describes: missing "
                            f"{missing[:5]}, unexpected {unexpected[:5]}, wrong shape {wrong[:5]}; check that "
                            f"config.json belongs to these weights (export the directory again if not)")
    if tied:
        model.tie_weights()
    return model.eval()

"""Read a 4-bit artifact directory back into a transformers model, decoding its packed tensors with our code.

Works on any AutoAWQ-GEMM directory (ours or another tool's): the dequantized weights are what vLLM
computes with, so scoring this model scores the artifact itself, not pre-pack fake-quant weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from quantize.formats import awq_gemm
from quantize.primitives import dequantize


class ArtifactError(ValueError):
    pass


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a (sharded) safetensors checkpoint directory."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ArtifactError(f"{path} has no .safetensors files")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                out[k] = st.get_tensor(k)
    return out


def dequantized_state_dict(path: Path, dtype: torch.dtype = torch.float32) -> tuple[dict[str, torch.Tensor], dict]:
    """Artifact dir -> (state dict with every packed linear decoded to `.weight`, quantization_config)."""
    config = json.loads((Path(path) / "config.json").read_text())
    qcfg = config.get("quantization_config")
    if not qcfg:
        raise ArtifactError(f"{path}/config.json has no quantization_config")
    method, version = qcfg.get("quant_method"), str(qcfg.get("version", "")).lower()
    if method != "awq" or version != "gemm":
        raise ArtifactError(f"{path}: quant_method {method!r} version {version!r} is not readable here (awq/gemm)")
    bits = qcfg.get("bits", qcfg.get("w_bit"))
    if bits != 4:
        raise ArtifactError(f"{path}: bits {bits} is not supported by the AWQ GEMM reader (4 only)")
    tensors = read_tensors(path)
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith((".qzeros", ".scales")):
            continue
        if name.endswith(".qweight"):
            module = name.removesuffix(".qweight")
            codes, scales, zeros = awq_gemm.unpack({
                "qweight": t, "qzeros": tensors[f"{module}.qzeros"], "scales": tensors[f"{module}.scales"]})
            if not qcfg.get("zero_point", True):
                zeros = torch.full_like(zeros, 8)  # vLLM ignores qzeros without zero points: (q - 8) * s
            out[f"{module}.weight"] = dequantize(codes, scales, zeros).to(dtype)
        else:
            out[name] = t.to(dtype) if t.is_floating_point() else t
    return out, qcfg


def load_dequantized(path: Path, dtype: torch.dtype = torch.float32):
    """Artifact dir -> transformers causal LM (CPU, eval mode) holding the decoded weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    state, _ = dequantized_state_dict(path, dtype)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and config.get_text_config().tie_word_embeddings)]
    if missing or unexpected:
        raise ArtifactError(f"{path}: tensors do not match the architecture: missing {missing[:5]}, "
                            f"unexpected {unexpected[:5]}")
    if config.get_text_config().tie_word_embeddings:
        model.tie_weights()
    return model.eval()

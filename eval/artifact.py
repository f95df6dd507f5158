"""Read a 4-bit artifact directory back into a transformers model, decoding its packed tensors with our code.

Works on any AutoAWQ-GEMM, GPTQ (v1, contiguous g_idx) or compressed-tensors pack-quantized directory
(ours or another tool's): the dequantized weights are what vLLM
computes with, so scoring this model scores the artifact itself, not pre-pack fake-quant weights.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

from quantize.formats import awq_gemm, compressed_tensors, gptq
from quantize.primitives import dequantize


class ArtifactError(ValueError):
    pass


def verify_manifest(path: Path) -> bool:
    """Check the artifact against its manifest -> True; False if there is no manifest (another tool's directory).

    An artifact is a closed set: every file it holds is listed in the manifest (`files`, plus the eval report's
    `report` hashes) with its sha256, nothing else is in the directory, nothing is a symlink, and no listed name
    leads outside it. Raises ArtifactError naming each file that breaks this: such an artifact is refused.
    """
    from quantize.export import MANIFEST, sha256_file

    root = Path(path)
    mpath = root / MANIFEST
    if mpath.is_symlink():
        raise ArtifactError(f"{root}: refused, {MANIFEST} is a symlink")
    if not mpath.is_file():
        return False
    try:
        m = json.loads(mpath.read_text(encoding="utf-8"))
        expected = {str(name): rec["sha256"] for name, rec in m.get("files", {}).items()}
        expected.update({str(n): h for n, h in m.get("report", {}).items() if n != "passed"})
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise ArtifactError(f"{root}: refused, {MANIFEST} is not a valid manifest ({type(e).__name__}); "
                            f"re-create the artifact with make quantize") from None
    bad = _unlisted(root, set(expected) | {MANIFEST})
    base = root.resolve()
    for name, sha in sorted(expected.items()):
        f = root / name
        if Path(name).is_absolute() or ".." in Path(name).parts or base not in f.resolve().parents:
            bad.append(f"{name} (its path leads outside the artifact)")
        elif f.is_symlink():
            continue  # named by _unlisted
        elif not f.is_file():
            bad.append(f"{name} (missing)")
        elif sha256_file(f) != sha:
            bad.append(f"{name} (sha256 differs from the manifest)")
    if bad:
        shown = bad[:10] + ([f"and {len(bad) - 10} more"] if len(bad) > 10 else [])
        raise ArtifactError(f"{root}: refused, the manifest does not verify: {', '.join(shown)}")
    return True


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


def _format(qcfg: dict, path: Path) -> tuple[str, int]:
    method = qcfg.get("quant_method")
    if method == "awq":
        version = str(qcfg.get("version", "")).lower()
        if version != "gemm":
            raise ArtifactError(f"{path}: AWQ version {version!r} is not readable here (gemm only)")
        return "awq", int(qcfg.get("bits", qcfg.get("w_bit", 0)))
    if method == "gptq":
        if qcfg.get("desc_act"):
            raise ArtifactError(f"{path}: desc_act: true GPTQ checkpoints are rejected by vLLM 0.32")
        return "gptq", int(qcfg["bits"])
    if method == "compressed-tensors":
        if qcfg.get("format") != "pack-quantized":
            raise ArtifactError(f"{path}: compressed-tensors format {qcfg.get('format')!r} is not readable here")
        groups = list(qcfg.get("config_groups", {}).values())
        return "compressed-tensors", int(groups[0]["weights"]["num_bits"])
    raise ArtifactError(f"{path}: quant_method {method!r} is not readable here (awq, gptq, compressed-tensors)")


def dequantized_state_dict(path: Path, dtype: torch.dtype = torch.float32) -> tuple[dict[str, torch.Tensor], dict]:
    """Artifact dir -> (state dict with every packed linear decoded to `.weight`, quantization_config)."""
    config = json.loads((Path(path) / "config.json").read_text())
    qcfg = config.get("quantization_config")
    if not qcfg:
        raise ArtifactError(f"{path}/config.json has no quantization_config")
    fmt, bits = _format(qcfg, Path(path))
    if fmt == "awq" and bits != 4:
        raise ArtifactError(f"{path}: bits {bits} is not supported by the AWQ GEMM reader (4 only)")
    tensors = read_tensors(path)
    marker = "." + PACKED_TENSOR[fmt]
    modules = [k.removesuffix(marker) for k in tensors if k.endswith(marker)]
    out: dict[str, torch.Tensor] = {}
    for m in modules:
        own = {k.removeprefix(f"{m}."): tensors.pop(k) for k in list(tensors) if k.startswith(f"{m}.")
               and k.removeprefix(f"{m}.") in _SUFFIXES[fmt]}
        if fmt == "awq":
            codes, scales, zeros = awq_gemm.unpack(own)
            if not qcfg.get("zero_point", True):
                zeros = torch.full_like(zeros, 8)  # vLLM ignores qzeros without zero points: (q - 8) * s
        elif fmt == "gptq":
            codes, scales, zeros = gptq.unpack(own, bits)
            if qcfg.get("sym", True):
                zeros = torch.full_like(zeros, 2 ** (bits - 1))  # vLLM ignores qzeros with sym
        else:
            codes, scales, zeros = compressed_tensors.unpack(own, bits)
        out[f"{m}.weight"] = dequantize(codes, scales, zeros).to(dtype)
    for name, t in tensors.items():
        out[name] = t.to(dtype) if t.is_floating_point() else t
    return out, qcfg


PACKED_TENSOR = {"awq": "qweight", "gptq": "qweight", "compressed-tensors": "weight_packed"}  # int32, 32/w_bit codes each

_SUFFIXES = {
    "awq": ("qweight", "qzeros", "scales"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx"),
}


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

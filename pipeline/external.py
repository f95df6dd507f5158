"""Another tool's 4-bit directory beside a comparison's variants (`compare --artifact DIR`).

Such a directory (AutoAWQ, GPTQModel, llm-compressor, AutoRound: no manifest of ours) is checked against the
comparison's base model before any work, scored by the eval stage as `eval --artifact DIR --base MODEL` scores
it, and described from its config.json's quantization_config: the tool that wrote it where its keys say so, its
layout, bits and group size.
"""

from __future__ import annotations

from pathlib import Path

from eval.artifact import quantization_format
from quantize.manifest import ArtifactError, read_json
from quantize.source import load as source

# What two models of one architecture must share for one to be the other quantized: any of these that differ
# means the directory was made from another model, and its KL against our base model would be meaningless
SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim")


def _text_config(config: dict) -> dict:
    """A config.json -> its language model's keys (a multimodal model's text_config over its own)."""
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, dict) else config


def base_config(base_spec: str) -> dict:
    """The base model's config.json (resolved as the eval resolves it: a local directory, the hub cache, a GGUF
    converted once)."""
    return read_json(source.resolve(base_spec).path / "config.json")


def mismatch(base: dict, other: dict) -> list[str]:
    """The SHAPE_KEYS whose values differ, as 'key X (base model Y)', for keys both configs give."""
    a, b = _text_config(base), _text_config(other)
    return [f"{k} {b[k]} (base model {a[k]})" for k in SHAPE_KEYS if k in a and k in b and a[k] != b[k]]


def check(dirs: list[Path], base_spec: str) -> None:
    """Each --artifact directory is one the eval can score against `base_spec`: ArtifactError naming the first
    that is not (no config.json, a layout the eval cannot read, or another base model)."""
    base = base_config(base_spec) if dirs else {}
    for d in dirs:
        if not (Path(d) / "config.json").is_file():
            raise ArtifactError(f"--artifact {d} is not a model directory (no config.json); give a vLLM-loadable "
                                f"4-bit directory, e.g. one AutoAWQ, GPTQModel, llm-compressor or AutoRound wrote")
        quantization_format(d)  # a layout the eval cannot decode is refused now, not after the variants' pass
        diff = mismatch(base, read_json(Path(d) / "config.json"))
        if diff:
            raise ArtifactError(f"--artifact {d} was not quantized from the comparison's base model {base_spec}: "
                                f"its config.json has {', '.join(diff)}; compare it with recipes of the model it "
                                f"was made from")


def tool(qcfg: dict) -> str | None:
    """The tool that wrote a quantization_config, from the keys only it writes -> 'AutoRound 0.5.1', or None."""
    if qcfg.get("autoround_version"):
        return f"AutoRound {qcfg['autoround_version']}"
    quantizer = (qcfg.get("meta") or {}).get("quantizer") or []
    for q in [quantizer] if isinstance(quantizer, str) else quantizer:  # GPTQModel: ["gptqmodel:2.2.0"]
        name, _, version = str(q).partition(":")
        if name.lower() == "gptqmodel":
            return f"GPTQModel {version}".strip()
    if qcfg.get("quant_method") == "compressed-tensors":  # llm-compressor's format, versioned by its library
        return f"llm-compressor (compressed-tensors {qcfg.get('version', '?')})"
    if qcfg.get("quant_method") == "awq" and str(qcfg.get("version", "")).lower() == "gemm":
        return "AutoAWQ"  # the GEMM version key is AutoAWQ's config
    return None


def describe(d: Path) -> dict:
    """A directory's quantization as the comparison's columns show it -> {tool, format, w_bit, group_size,
    zero_point} (None where config.json does not say)."""
    fmt, qcfg, bits = quantization_format(d)
    weights = next(iter((qcfg.get("config_groups") or {}).values()), {}).get("weights") or {}  # compressed-tensors
    group = qcfg.get("group_size", qcfg.get("q_group_size", weights.get("group_size")))
    if "zero_point" in qcfg:  # AWQ
        zero = bool(qcfg["zero_point"])
    elif "sym" in qcfg or "symmetric" in weights:  # GPTQ, compressed-tensors
        zero = not qcfg.get("sym", weights.get("symmetric"))
    else:
        zero = None
    return {"tool": tool(qcfg), "format": fmt.name, "format_title": fmt.title, "w_bit": bits, "group_size": group,
            "zero_point": zero}


def scored_alike(report, base_spec: str, eopts) -> bool:
    """Whether a report already in the directory scored it against this base model on this protocol (a
    comparison with --no-eval shows only such figures)."""
    if report is None or report.perplexity is None or report.base_model != base_spec:
        return False
    p, want = report.perplexity.protocol, eopts.perplexity
    return (p.dataset, p.seq_len, p.max_windows) == (want.dataset, want.seq_len, want.max_windows)

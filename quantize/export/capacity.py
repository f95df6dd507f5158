"""What serving the artifact costs in GPU memory, against its 16-bit base: weights, KV cache, sequences that fit.

All figures come from the model's config and the written files, none from a measurement:
- weights: the artifact's safetensors bytes; the base's = its parameters x 2 bytes (float16 / bfloat16).
- KV cache per token = 2 (K and V) x layers x KV heads x head dim x bytes per element (2 for float16, 1 for fp8).
- sequences that fit on a GPU of G GB at gpu_memory_utilization u: floor((u x G - weights) / (KV per token x
  max model length)). An upper bound: vLLM also holds activations, CUDA graphs and the sampler's buffers
  (typically 1-3 GB on a 7B model), so the real count is lower; use it to choose `max_num_seqs` and to compare.
GB are decimal (10^9 bytes), as GPUs are sold.
"""

from __future__ import annotations

from ..records import Capacity

GPU_GB = (24, 48, 80, 141)  # common cards: L4/3090/4090-class, L40S/A6000, A100/H100 80GB, H200
UTILIZATION = 0.9
KV_BYTES = {"float16": 2, "fp8": 1}


def kv_bytes_per_token(config: dict, element_bytes: int) -> int:
    """K and V of one token over every layer: 2 x layers x kv_heads x head_dim x element_bytes."""
    text = config.get("text_config") or config
    heads = text["num_attention_heads"]
    kv_heads = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    return 2 * text["num_hidden_layers"] * kv_heads * head_dim * element_bytes


def sequences(gpu_gb: float, weight_bytes: int, kv_per_seq: int, utilization: float = UTILIZATION) -> int:
    """Sequences of full length whose KV cache fits beside the weights (0 when the weights alone do not fit)."""
    free = utilization * gpu_gb * 1e9 - weight_bytes
    return max(0, int(free // kv_per_seq)) if kv_per_seq else 0


def facts(config: dict, max_model_len: int, artifact_weight_bytes: int, parameters: int) -> dict:
    """The deployment record (saved in the manifest under `capacity`, rendered in the model card)."""
    base_bytes = parameters * 2
    kv = {k: kv_bytes_per_token(config, b) for k, b in KV_BYTES.items()}
    fit = {f"{side}/{kvd}": {str(g): sequences(g, w, kv[kvd] * max_model_len) for g in GPU_GB}
           for side, w in (("base", base_bytes), ("artifact", artifact_weight_bytes)) for kvd in KV_BYTES}
    return {"max_model_len": max_model_len, "parameters": parameters, "base_weight_bytes": base_bytes,
            "artifact_weight_bytes": artifact_weight_bytes,
            "bits_per_weight": round(8 * artifact_weight_bytes / parameters, 3) if parameters else None,
            "size_vs_base": round(artifact_weight_bytes / base_bytes, 4) if base_bytes else None,
            "kv_bytes_per_token": kv, "kv_bytes_per_sequence": {k: v * max_model_len for k, v in kv.items()},
            "gpu_memory_utilization": UTILIZATION, "sequences_that_fit": fit}


def render(facts_record: Capacity | dict) -> list[str]:
    """The model card's deployment section from a `facts` record."""
    d = Capacity.of(facts_record)
    gb = lambda n: f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.2f} MB"  # noqa: E731
    kv, per_seq, fit = d.kv_bytes_per_token, d.kv_bytes_per_sequence, d.sequences_that_fit
    lines = ["## Deployment", "",
             f"Weights: **{gb(d.artifact_weight_bytes)}** against {gb(d.base_weight_bytes)} for the 16-bit base "
             f"({d.size_vs_base:.1%}; {d.bits_per_weight} bits per parameter over all "
             f"{d.parameters:,} parameters, 16-bit embeddings and norms included).", "",
             f"KV cache: {kv['float16']:,} bytes per token in float16 ({kv['fp8']:,} with an fp8 KV cache); at the "
             f"served max model length {d.max_model_len:,}: {gb(per_seq['float16'])} per sequence "
             f"({gb(per_seq['fp8'])} in fp8).", "",
             f"Full-length sequences that fit at `gpu_memory_utilization` {d.gpu_memory_utilization} "
             "(an upper bound: "
             "vLLM's activations and graphs take some of it; choose `max_num_seqs` from it):", "",
             "| GPU | base, float16 KV | base, fp8 KV | this artifact, float16 KV | this artifact, fp8 KV |",
             "|---:|---:|---:|---:|---:|"]
    for g in GPU_GB:
        cells = [fit[k][str(g)] for k in ("base/float16", "base/fp8", "artifact/float16", "artifact/fp8")]
        lines.append(f"| {g} GB | " + " | ".join(str(c) for c in cells) + " |")
    return lines + ["", "Figures from config.json and the files (`capacity` in manifest.json), not measured.", ""]

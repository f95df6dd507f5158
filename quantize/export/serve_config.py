"""The artifact's vLLM serve config: a YAML that `vllm serve DIR --config vllm-serve.yaml` reads.

Keys are vLLM's CLI flags' long names (`vllm/entrypoints/launchers/cli_args.py` make_arg_parser). The model
path is not in it: the directory may move, so the command names it. Everything comes from the recipe and the
pre-flight plan, so what a server runs is what pre-flight checked:

    quantization          the CUDA method pre-flight chose for every converted linear (awq_marlin, gptq_marlin, ...)
    served-model-name     serve.served_model_name, else the recipe name
    dtype                 the recipe's dtype
    max-model-len         serve.max_model_len, else the model's max_position_embeddings
    tensor-parallel-size  serve.tensor_parallel_size (pre-flight refuses one the shapes do not divide)
    kv-cache-dtype        serve.kv_cache_dtype, only when the recipe sets it
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import yaml

from .. import formats

SERVE_CONFIG = "vllm-serve.yaml"
DEFAULT_PORT = 8000
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


def has_chat_template(model_dir: Path) -> bool:
    """The tokenizer files carry a chat template (where transformers and vLLM look for one: a template file, or
    tokenizer_config.json's `chat_template`). vLLM's chat endpoint answers HTTP 400 without one (most base
    checkpoints, many GGUF files): those are asked on the completions endpoint."""
    d = Path(model_dir)
    if any((d / f).is_file() and (d / f).stat().st_size > 0 for f in CHAT_TEMPLATE_FILES):
        return True
    try:
        cfg = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and bool(cfg.get("chat_template"))


def endpoint(model_dir: Path) -> str:
    """The OpenAI endpoint a request to this model must use: chat with a chat template, completions without."""
    return CHAT if has_chat_template(model_dir) else COMPLETIONS


def why_endpoint(path: str) -> str:
    return ("the tokenizer has a chat template" if path == CHAT else
            "the tokenizer has no chat template (a base model): vLLM's chat endpoint would answer HTTP 400")


def request(path: str, served_name: str, url: str) -> str:
    """A curl command that asks the model one question on `path` (chat or completions)."""
    body = ({"model": served_name, "messages": [{"role": "user", "content": "What is the capital of France?"}],
             "max_tokens": 64} if path == CHAT else
            {"model": served_name, "prompt": "The capital of France is", "max_tokens": 64})
    return (f"curl -s {url}{path} -H 'Content-Type: application/json' \\\n"
            f"  -d {shlex.quote(json.dumps(body))}")


def quantization_method(fmt: str, cuda_kernels: list[str]) -> str:
    """Format + the CUDA kernel of every converted linear (pre-flight's) -> vLLM's --quantization value: a layer
    Marlin cannot take sends the whole model to the format's own kernel."""
    marlin, fallback = formats.get(fmt).served_as
    return marlin if cuda_kernels and all("marlin" in k for k in cuda_kernels) else fallback


def build(recipe, plan) -> dict:
    """Recipe + pre-flight Plan -> {flag long name: value} (insertion order = the order written)."""
    s = recipe.serve
    cfg = {"quantization": quantization_method(recipe.out_format, [lc.cuda_kernel for lc in plan.layers]),
           "served-model-name": recipe.served_name, "dtype": recipe.dtype,
           "max-model-len": s.max_model_len or plan.max_position_embeddings,
           "tensor-parallel-size": s.tensor_parallel_size}
    if cfg["max-model-len"] is None:
        del cfg["max-model-len"]  # the model does not say: vLLM derives it
    if s.kv_cache_dtype is not None:
        cfg["kv-cache-dtype"] = s.kv_cache_dtype
    return cfg


def render(cfg: dict) -> str:
    head = ("# vLLM serve config written by quantize from the recipe and pre-flight (preflight.json).\n"
            "# GPU:       vllm serve . --config vllm-serve.yaml          (from this directory)\n"
            "# CPU build: python -m vllm.entrypoints.openai.api_server --model . --config vllm-serve.yaml\n"
            "#            (plus --quantization <config.json's quant_method>: the CPU build has no Marlin override)\n")
    return head + yaml.safe_dump(cfg, sort_keys=False)


def read(artifact: Path) -> dict | None:
    """The artifact's serve config, or None for a directory that has none (another tool's)."""
    p = Path(artifact) / SERVE_CONFIG
    return yaml.safe_load(p.read_text()) if p.is_file() else None


def cpu_overrides(cfg: dict, checkpoint_method: str) -> dict:
    """Flags the CPU build needs on top of the config: it takes no Marlin method name (it checks
    --quantization against config.json's quant_method, with no override to awq_marlin / gptq_marlin as on CUDA),
    so the checkpoint's own method is passed; the command line wins over the config file."""
    return {"quantization": checkpoint_method} if cfg.get("quantization", checkpoint_method) != checkpoint_method else {}


def commands(cfg: dict, checkpoint_method: str, model: str = ".", port: int = DEFAULT_PORT,
             path: str = CHAT) -> dict[str, str]:
    """The commands a model card prints: serve on a CUDA host, serve on the CPU build with vLLM's own server
    (`cpu`; quantize's launcher is the card's first CPU command: `cpu_serve`), a request on `path`."""
    model_q = shlex.quote(model)
    cpu_args = (f"--model {model_q} --config {SERVE_CONFIG} --port {port} --gpu-memory-utilization 0.3"
                + "".join(f" --{k} {v}" for k, v in cpu_overrides(cfg, checkpoint_method).items()))
    return {
        "gpu": f"vllm serve {model_q} --config {SERVE_CONFIG} --port {port}",
        "cpu": f"VLLM_CPU_KVCACHE_SPACE=1 python -m vllm.entrypoints.openai.api_server {cpu_args}",
        "curl": request(path, cfg["served-model-name"], f"http://localhost:{port}"),
    }

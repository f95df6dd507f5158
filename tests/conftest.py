"""Shared fixtures: tiny models built from configs (no download), a tiny tokenizer trained on bundled text."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# pre-flight's deployability table from the hand-written rules: a vLLM child per tiny run would add 30-90 s each;
# tests/unit/test_deploy_agreement.py and test_deploy_pinned.py ask vLLM itself
os.environ.setdefault("QUANTIZE_DEPLOY", "rules")


CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def threads_running(*prefixes: str) -> list[threading.Thread]:
    """The threads whose names start with one of `prefixes` that still run. A pool's worker exits moments after
    handing its result back, so each is given that long (10 s at most) before it counts."""
    threads = [t for t in threading.enumerate() if t.name.startswith(prefixes)]
    for t in threads:
        t.join(timeout=10)
    return [t for t in threads if t.is_alive()]


def process_group(pgid: int) -> list[str]:
    """The live processes of process group pgid, as "pid command" (zombies are dead: they hold nothing)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, ...
            cmd = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # exited while being read
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(f"{stat.parent.name} {cmd[:120]}")
    return out


def build_tokenizer(out: Path, vocab_size: int = 512):
    """A byte-level BPE tokenizer trained on a slice of the bundled calibration text (fast, offline)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = (ROOT / "data" / "groups-merged.txt").read_text(encoding="utf-8")[:200_000]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text.split("\n\n"), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE  # vLLM's chat endpoint refuses a tokenizer without one
    fast.save_pretrained(out)
    return fast


TINY = {
    "llama": dict(cls="LlamaConfig", extra={}),
    "qwen2": dict(cls="Qwen2Config", extra={}),
    "qwen3": dict(cls="Qwen3Config", extra={"head_dim": 64}),
    "mistral": dict(cls="MistralConfig", extra={"sliding_window": None}),
    # a sliding-window layer then a global one, the window shorter than the calibration blocks
    "gemma3": dict(cls="Gemma3TextConfig", arch="Gemma3ForCausalLM",
                   extra={"head_dim": 64, "query_pre_attn_scalar": 64, "sliding_window": 16,
                          "layer_types": ["sliding_attention", "full_attention"]}),
    # mixtures of experts: 4 routed experts, top-2 (Qwen2-MoE adds a shared expert and its gate)
    "mixtral": dict(cls="MixtralConfig", extra={"sliding_window": None, "num_local_experts": 4,
                                                "num_experts_per_tok": 2}),
    "qwen2_moe": dict(cls="Qwen2MoeConfig", extra={"num_experts": 4, "num_experts_per_tok": 2,
                                                   "moe_intermediate_size": 128,
                                                   "shared_expert_intermediate_size": 256}),
    "qwen3_moe": dict(cls="Qwen3MoeConfig", extra={"num_experts": 4, "num_experts_per_tok": 2,
                                                   "moe_intermediate_size": 128, "head_dim": 64}),
}


def build_tiny_model(out: Path, kind: str = "llama", hidden: int = 256, intermediate: int = 512, layers: int = 2,
                     heads: int = 4, kv_heads: int = 2, vocab: int = 512, seed: int = 0,
                     tie: bool = False, extra: dict | None = None) -> Path:
    """A random-init decoder-only model saved as safetensors with a tokenizer; logits are far from uniform."""
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out, vocab)
    cfg_cls = getattr(transformers, TINY[kind]["cls"])
    cfg = cfg_cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=1024,
                  initializer_range=0.08, tie_word_embeddings=tie, bos_token_id=tok.bos_token_id,
                  eos_token_id=tok.eos_token_id, **{**TINY[kind]["extra"], **(extra or {})})
    cfg.architectures = [TINY[kind].get("arch", cfg_cls.__name__.replace("Config", "ForCausalLM"))]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # a few strong input channels, as real activations have: gives AWQ something to find
        for layer in model.model.layers:
            idx = torch.randperm(hidden)[:4]
            layer.input_layernorm.weight[idx] *= 8
            layer.post_attention_layernorm.weight[idx] *= 8
    model.to(torch.float16).save_pretrained(out)
    GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, do_sample=False).save_pretrained(out)
    return out


def write_recipe(path: Path, **keys) -> Path:
    import yaml

    keys.setdefault("name", path.stem)
    path.write_text(yaml.safe_dump(keys, sort_keys=False))
    return path


def tiny_recipe(tmp: Path, model_dir: Path, name: str = "tiny-awq", **over) -> Path:
    keys = dict(name=name, model=str(model_dir), method="awq", w_bit=4, q_group_size=64, zero_point=True,
                version="gemm", calibration=dict(dataset="groups-merged", n_samples=16, seq_len=64, seed=0),
                awq=dict(n_grid=10, clip_grid=10), dtype="float16", device="cpu", batch_size=4)
    keys.update(over)
    # a random-init tiny model's next-token distributions are nearly flat (perplexity ~1,000 of 512 tokens), so
    # its top-1 agreement says nothing: the KL / top-1 gates are tested on the real small model (test_eval.py)
    keys["eval"] = {"max_kl": None, "min_top1": None, **(keys.get("eval") or {})}
    return write_recipe(tmp / f"{name}.yaml", **keys)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_eval_artifact(tiny_llama, tmp_path_factory) -> tuple[Path, Path]:
    """(artifact, recipe): tiny Llama AWQ g64 whose recipe evaluates 4 windows and smoke-loads in vLLM.
    Shared by the eval and registry tests (whichever runs first evaluates it)."""
    from quantize import runner

    tmp = tmp_path_factory.mktemp("eval")
    recipe = tiny_recipe(tmp, tiny_llama, name="tiny-eval",
                         eval=dict(perplexity=dict(dataset="wikitext2", seq_len=256, max_windows=4),
                                   vllm=dict(max_tokens=8, min_token_agreement=0.3)))
    return runner.run(recipe, out_root=tmp / "a"), recipe


def registrable(tmp: Path, model_dir: Path, name: str, windows: int = 1) -> Path:
    """A tiny RTN artifact, perplexity evaluated, with a passing vLLM smoke recorded through write_report (the
    function eval uses): one the registry accepts without starting vLLM (its gate on vLLM is tested by the tests
    marked vllm)."""
    from pipeline.stages import evaluate, write_report
    from quantize import runner
    from quantize.recipe import EvalOptions
    from quantize.records import Smoke

    out = runner.run(tiny_recipe(tmp, model_dir, name=name, method="rtn"), out_root=tmp / "a")
    eopts = EvalOptions.model_validate({"perplexity": {"seq_len": 64, "max_windows": windows},
                                        "vllm": {"enabled": False}})
    report = evaluate(out, None, eopts)
    report.vllm_smoke = Smoke(passed=True, checks={"loaded": False}, errors=[], method="awq", token_agreement=1.0)
    report.passed = True
    write_report(out, report)
    return out


@pytest.fixture(scope="session")
def registrable_artifact(tiny_llama, tmp_path_factory) -> Path:
    return registrable(tmp_path_factory.mktemp("registrable"), tiny_llama, "writer")


KEPT_16BIT = "model.layers.0.mlp.down_proj"  # a linear the recipe keeps 16-bit, named as a user names it


@pytest.fixture(scope="session")
def kept_16bit_artifacts(tiny_llama, tmp_path_factory) -> dict[str, Path]:
    """format -> a tiny Llama artifact (round-to-nearest) whose recipe keeps KEPT_16BIT out of the conversion."""
    from quantize import runner

    tmp = tmp_path_factory.mktemp("kept-16bit")
    over = {"awq": {}, "gptq": dict(zero_point=False), "compressed-tensors": {}}
    return {fmt: runner.run(tiny_recipe(tmp, tiny_llama, name=f"keep-{fmt}", method="rtn", format=fmt,
                                        modules_to_not_convert=["lm_head", KEPT_16BIT], **kw), out_root=tmp / "a")
            for fmt, kw in over.items()}


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


def heldout_ids(model_dir: Path, n: int = 4, seq: int = 64) -> torch.Tensor:
    """Token windows of WikiText-2 (never used for calibration, which reads the pile mix) -> [n, seq]."""
    from transformers import AutoTokenizer

    from quantize import calib

    tok = AutoTokenizer.from_pretrained(model_dir)
    return calib.make_samples(calib.load_text("wikitext2").documents, tok, n, seq, seed=123)



def kl_divergence(ref, model, ids: torch.Tensor) -> float:
    """Mean per-token KL(ref || model) of next-token distributions on ids [n, seq]."""
    with torch.no_grad():
        a = torch.log_softmax(ref(ids).logits.float(), -1)
        b = torch.log_softmax(model(ids).logits.float(), -1)
    return (a.exp() * (a - b)).sum(-1).mean().item()


def triton_compare(module: str) -> list:
    """`<module>.compare(device)` of a Triton kernel's test: compiled on CUDA where there is one, else under Triton's
    CPU interpreter (TRITON_INTERPRET=1, in a subprocess: triton reads it when a kernel is defined) -> its results.
    The interpreter checks the arithmetic, not what the compiler makes of it: a kernel must also pass on CUDA."""
    import json
    import subprocess
    import sys

    if torch.cuda.is_available():
        import importlib

        return importlib.import_module(module).compare("cuda")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    code = f"import json; from {module} import compare; print(json.dumps(compare('cpu')))"
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def pytest_collection_modifyitems(config, items):
    """Tests that load a 4-bit artifact in vLLM skip, saying why, where vLLM cannot serve 4-bit weights (an
    AVX2-only CPU); those marked vllm_no_4bit or vllm_load_only run no 4-bit linear in vLLM, and still run."""
    from eval.smoke import vllm_unavailable

    why = vllm_unavailable()
    if not why:
        return
    skip = pytest.mark.skip(reason=f"vLLM cannot load 4-bit weights here: {why}")
    for item in items:
        if "vllm" in item.keywords and not {"vllm_no_4bit", "vllm_load_only"} & set(item.keywords):
            item.add_marker(skip)


def eval_main(argv: list[str]) -> int:
    """`quantize eval ARGS` in-process -> its exit code."""
    from pipeline.cli import main

    return main(["eval", *argv])

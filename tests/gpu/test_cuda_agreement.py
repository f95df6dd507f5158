"""vLLM's CUDA build (Marlin, Machete) against our own decoding of the same artifact: prompt logprobs agree within
the CPU test's bound (tests/integration/test_vllm_load.py) for every format x group size x symmetric/asymmetric x
act-order that vLLM serves, and a combination it refuses is named with vLLM's own reason.

Runs on a CUDA host with vLLM's CUDA build (`make venv` there): `.venv/bin/python -m pytest -m gpu tests/gpu -rs`.
Three shapes, each cut to two decoder layers of random-init weights (bench/build_checkpoint.py): Qwen2.5-7B (3584
in, 18944 intermediate: the tiles Marlin and Machete pick for a 7B), Gemma 3 270M (640 / 2048, head dim 256) and
SmolLM2-135M (576 / 1536: no group of 128 divides 576, so g32 and g64); the vocabulary is cut to the bundled
tokenizer's 49,152 ids (the 16-bit embedding and lm_head are what a 7B cut's artifacts would mostly hold, and
what a matrix of them would write to disk). Every artifact of a shape is loaded by one
vLLM process in turn (`run_vllm_many`), which also reports the kernel each quantized linear ran.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eval.agreement import hf_logprobs, prompt_logprob_delta
from eval.artifact import load_dequantized
from eval.vllm_run import run_vllm_many
from quantize import runner
from quantize.recipe.options import RecipeError
from tests.conftest import tiny_recipe

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device and vLLM's CUDA build")]

ROOT = Path(__file__).resolve().parents[2]
BOUND = 0.01  # mean |Δ logprob| over every (position, top-5 token): the CPU test's bound
# shape -> (group sizes, the 16-bit dtype it is quantized and served in: vLLM refuses float16 for Gemma 3)
SHAPES = {"qwen2.5-7b": ((32, 64, 128), "float16"), "gemma-3-270m": ((32, 64, 128), "bfloat16"),
          "smollm2-135m": ((32, 64), "float16")}
DEVICE = "cuda"


def combos(groups) -> list[tuple]:
    """(format, group, symmetric, act_order): what a recipe can ask for; vLLM's answer decides which load. "mixed"
    is a `mixed:` recipe (AWQ, compressed-tensors) based at the shape's coarsest size with every finer one allowed."""
    return [(fmt, g, sym, act) for fmt in ("awq", "gptq", "compressed-tensors") for g in groups
            for sym in (True, False) for act in (False, True)
            if not (fmt == "awq" and (sym or act))] + [  # the AWQ GEMM layout always has zero points, no act-order
        ("mixed", max(groups), False, False)]


CASES = [(shape, *c) for shape, (groups, _) in SHAPES.items() for c in combos(groups)]


def _name(fmt, g, sym, act) -> str:
    return f"{fmt}-g{g}-{'sym' if sym else 'asym'}{'-act' if act else ''}"


def _recipe(tmp: Path, model: Path, dtype: str, fmt: str, g: int, sym: bool, act: bool) -> Path:
    name = _name(fmt, g, sym, act)
    if fmt == "awq":
        return tiny_recipe(tmp, model, name=name, q_group_size=g, device=DEVICE, dtype=dtype)
    if fmt == "mixed":  # the budget: the base size's bits per weight (16-bit scale, 4-bit zero) + 0.10
        finer = [s for s in (64, 32) if s < g]
        return tiny_recipe(tmp, model, name=name, q_group_size=g, format="compressed-tensors", device=DEVICE,
                           dtype=dtype, mixed=dict(base_group=g, budget_bits_per_weight=4 + 20 / g + 0.10,
                                                   finer=finer))
    return tiny_recipe(tmp, model, name=name, method="gptq", format=fmt, q_group_size=g, zero_point=not sym,
                       gptq=dict(act_order=act), device=DEVICE, dtype=dtype)


def _prompts(n=3, length=24, vocab=4096):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


def _selected(request) -> set[tuple]:
    """The cases this session runs (`-k` may pick a few): only those are quantized and loaded."""
    return {tuple(item.callspec.params[k] for k in ("shape", "fmt", "g", "sym", "act"))
            for item in request.session.items
            if getattr(item, "originalname", None) == "test_cuda_vllm_matches_our_decoding"}


@pytest.fixture(scope="module")
def measured(request, tmp_path_factory) -> dict:
    """Each selected combination quantized, loaded by vLLM (one process per shape) and scored against our decoding:
    {(shape, fmt, g, sym, act): {"delta": ..., "kernels": ...}, {"refused": our recipe's message}
    or {"failed": vLLM's error}}."""
    os.environ["QUANTIZE_DEPLOY"] = "rules"  # pre-flight's table from the rules (checked equal to vLLM 0.26's)
    selected = _selected(request)
    out: dict = {}
    ids = _prompts()
    for shape, (groups, dtype) in SHAPES.items():
        cases = [c for c in combos(groups) if (shape, *c) in selected]
        if not cases:
            continue
        tmp = tmp_path_factory.mktemp(shape)
        ckpt = tmp / "ckpt"
        subprocess.run([sys.executable, str(ROOT / "bench/build_checkpoint.py"), "--config",
                        str(ROOT / "bench/configs" / shape), "--layers", "2", "--vocab", "49152", "--device", DEVICE,
                        "--out", str(ckpt)],
                       check=True)
        built = []
        for c in cases:
            try:
                built.append((c, runner.run(_recipe(tmp, ckpt, dtype, *c), out_root=tmp / "a")))
            except RecipeError as e:  # the recipe refuses what vLLM refuses (asymmetric GPTQ), saying so
                out[(shape, *c)] = {"refused": str(e)}
        results = run_vllm_many([a for _, a in built], ids, top_k=5, max_tokens=4, dtype=dtype, memory_fraction=0.3)
        for (c, art), res in zip(built, results):
            if "error" in res:  # vLLM did not serve it: a missing package or a crash is a failure, not a refusal
                out[(shape, *c)] = {"failed": res["error"]}
                continue
            model = load_dequantized(art, torch.float32).to(DEVICE)
            out[(shape, *c)] = {"delta": prompt_logprob_delta(res["prompt_logprobs"], hf_logprobs(model, ids)),
                                "kernels": res.get("linear_kernels")}
            del model
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
        for c in cases:  # each shape's matrix in the log as soon as it is measured, whatever the assertions say
            r = out[(shape, *c)]
            print("agreement", shape, *c, r.get("delta", {}).get("mean_abs_delta"),
                  r.get("kernels") or r.get("refused") or r.get("failed"), flush=True)
    return out


@pytest.mark.parametrize("shape,fmt,g,sym,act", CASES, ids=lambda v: str(v))
def test_cuda_vllm_matches_our_decoding(shape, fmt, g, sym, act, measured):
    r = measured[(shape, fmt, g, sym, act)]
    if "refused" in r:
        pytest.skip(f"our recipe refuses {shape} {_name(fmt, g, sym, act)} for vLLM's reason: {r['refused']}")
    if "failed" in r:
        pytest.fail(f"vLLM did not serve {shape} {_name(fmt, g, sym, act)}: {r['failed']}")
    d = r["delta"]
    assert d["n"] >= 3 * 23 * 5
    assert d["mean_abs_delta"] < BOUND, (d, r["kernels"])
    assert r["kernels"], r  # every quantized linear ran some 4-bit kernel

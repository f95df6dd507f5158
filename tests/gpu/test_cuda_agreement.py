"""vLLM's CUDA build (Marlin, Machete) against our own decoding of the same artifact: prompt logprobs agree within
the CPU test's bound (tests/integration/test_vllm_load.py) for every format x group size x symmetric/asymmetric x
act-order that vLLM serves, and a combination it refuses fails to load with vLLM's own reason.

Runs on a CUDA host with vLLM's CUDA build (`make venv` there): `.venv/bin/python -m pytest -m gpu tests/gpu`.
The model is the Qwen2.5-7B shape cut to two decoder layers (bench/build_checkpoint.py), random init; its linears
have the shapes the 7B serves with (3584 in, 18944 intermediate), which Marlin and Machete tile as they do for 7B.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eval.agreement import hf_logprobs, prompt_logprob_delta
from eval.artifact import load_dequantized
from eval.vllm_run import VllmError, run_vllm
from quantize import runner
from tests.conftest import tiny_recipe

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device and vLLM's CUDA build")]

ROOT = Path(__file__).resolve().parents[2]
BOUND = 0.01  # mean |Δ logprob| over every (position, top-5 token): the CPU test's bound

# (format, group, symmetric, act_order): what a recipe can ask for; vLLM's answer decides which load
COMBOS = [(fmt, g, sym, act) for fmt in ("awq", "gptq", "compressed-tensors") for g in (32, 64, 128)
          for sym in (True, False) for act in (False, True)
          if not (fmt == "awq" and (sym or act))]  # the AWQ GEMM layout always has zero points and no act-order


@pytest.fixture(scope="module")
def shape_7b_2layers(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ckpt") / "qwen7b-2l"
    subprocess.run([sys.executable, str(ROOT / "bench/build_checkpoint.py"), "--config",
                    str(ROOT / "bench/configs/qwen2.5-7b"), "--layers", "2", "--out", str(out)], check=True)
    return out


def _recipe(tmp: Path, model: Path, fmt: str, g: int, sym: bool, act: bool) -> Path:
    name = f"{fmt}-g{g}-{'sym' if sym else 'asym'}{'-act' if act else ''}"
    if fmt == "awq":
        return tiny_recipe(tmp, model, name=name, q_group_size=g, device="cuda")
    return tiny_recipe(tmp, model, name=name, method="gptq", format=fmt, q_group_size=g, zero_point=not sym,
                       gptq=dict(act_order=act), device="cuda")


def _prompts(n=3, length=24, vocab=4096):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


@pytest.mark.parametrize("fmt,g,sym,act", COMBOS, ids=lambda v: str(v))
def test_cuda_vllm_matches_our_decoding(fmt, g, sym, act, shape_7b_2layers, tmp_path):
    out = runner.run(_recipe(tmp_path, shape_7b_2layers, fmt, g, sym, act), out_root=tmp_path / "a")
    ids = _prompts()
    try:
        res = run_vllm(out, ids, top_k=5, max_tokens=4, memory_fraction=0.5)
    except VllmError as e:
        pytest.skip(f"vLLM refuses {fmt} g{g} {'sym' if sym else 'asym'} act-order {act}: {e}")
    model = load_dequantized(out, torch.float32).to("cuda")
    d = prompt_logprob_delta(res["prompt_logprobs"], hf_logprobs(model, ids))
    print(fmt, g, sym, act, d, res.get("kernels"))
    assert d["n"] >= 3 * 23 * 5
    assert d["mean_abs_delta"] < BOUND, (d, res.get("kernels"))

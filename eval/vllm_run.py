"""Load a directory in a real vLLM and return prompt logprobs and greedy generations, in a subprocess.

vLLM is started in a child process (it forks EngineCore workers, needs a `__main__` guard, and must be
shut down normally), so a crash or a refusal to load becomes a clear error in the parent, never a
hang or an orphaned process. The child writes JSON; the parent reads it.

    python -m eval.vllm_run --model DIR --prompts prompts.json --out result.json
prompts.json: {"token_ids": [[...], ...], "top_k": 5, "max_tokens": 8}
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path


class VllmError(RuntimeError):
    pass


def vllm_env(work: Path) -> dict[str, str]:
    """Environment for the vLLM CPU build: KV cache size, exact W4A16 numerics, caches under `work`."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CPU_INT4_W4A8", "0")
    env.setdefault("VLLM_CACHE_ROOT", str(work / "vllm-cache"))
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(work / "inductor"))
    env["TMPDIR"] = str(work)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")  # the kernel choice is logged at INFO
    return env


def run_vllm(model_dir: Path, token_ids: list[list[int]], top_k: int = 5, max_tokens: int = 8,
             dtype: str = "float16", timeout: float = 600, max_model_len: int = 512) -> dict:
    """Start vLLM on model_dir in a subprocess -> {prompt_logprobs, generations, quantization, load_s}."""
    with tempfile.TemporaryDirectory(prefix="vllm-run-") as work_s:
        work = Path(work_s)
        (work / "prompts.json").write_text(json.dumps(
            {"token_ids": token_ids, "top_k": top_k, "max_tokens": max_tokens, "dtype": dtype,
             "max_model_len": max_model_len}))
        cmd = [sys.executable, "-m", "eval.vllm_run", "--model", str(model_dir), "--prompts",
               str(work / "prompts.json"), "--out", str(work / "out.json")]
        try:
            proc = subprocess.run(cmd, env=vllm_env(work), capture_output=True, text=True, timeout=timeout,
                                  cwd=Path(__file__).resolve().parent.parent)
        except subprocess.TimeoutExpired as e:
            raise VllmError(f"vLLM did not finish within {timeout:.0f} s on {model_dir}") from e
        if proc.returncode != 0 or not (work / "out.json").is_file():
            log = (proc.stdout or "") + (proc.stderr or "")
            raise VllmError(f"vLLM failed on {model_dir} (exit {proc.returncode}):\n{root_cause(log)}")
        result = json.loads((work / "out.json").read_text())
        result["kernels"] = kernels_from_log((proc.stdout or "") + (proc.stderr or ""))
        return result


def kernels_from_log(text: str) -> list[str]:
    """vLLM's 'Using <Kernel> for <method>' lines -> ['CPUWNA16LinearKernel for AutoAWQMarlinLinearMethod', ...]."""
    found = re.findall(r"Using (\w+Kernel\w*) for ([\w -]+)", text)
    return sorted({f"{k} for {m.strip()}" for k, m in found})


def root_cause(stderr: str, keep: int = 12) -> str:
    """The lines of vLLM's stderr that say why it failed (its workers' errors), else the tail."""
    lines = stderr.strip().splitlines()
    hits = [ln for ln in lines if "Error" in ln or "error:" in ln or "cannot implement" in ln]
    return "\n".join((hits or lines)[-keep:])


def _child(model: str, prompts_path: str, out_path: str) -> None:
    spec = json.loads(Path(prompts_path).read_text())
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, dtype=spec["dtype"], enforce_eager=True, max_model_len=spec["max_model_len"],
              seed=0, max_num_seqs=8)
    load_s = time.perf_counter() - t0
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["token_ids"]]
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], logprobs=spec["top_k"],
                            prompt_logprobs=spec["top_k"])
    t1 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    gen_s = time.perf_counter() - t1
    result = {"load_s": load_s, "generate_s": gen_s, "prompt_logprobs": [], "generations": [], "gen_logprobs": []}
    for o in outputs:
        # prompt_logprobs[0] is None (no prediction for the first token); keep position -> {token: logprob}
        result["prompt_logprobs"].append(
            [None if d is None else {str(t): lp.logprob for t, lp in d.items()} for d in o.prompt_logprobs])
        c = o.outputs[0]
        result["generations"].append(list(c.token_ids))
        result["gen_logprobs"].append([{str(t): lp.logprob for t, lp in d.items()} for d in (c.logprobs or [])])
    cfg = llm.llm_engine.vllm_config if hasattr(llm.llm_engine, "vllm_config") else None
    qc = getattr(getattr(cfg, "model_config", None), "quantization", None)
    result["quantization"] = qc
    result["generated_tokens"] = sum(len(g) for g in result["generations"])
    Path(out_path).write_text(json.dumps(result))
    del llm


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    _child(a.model, a.prompts, a.out)

"""Load a directory in a real vLLM and return prompt logprobs and greedy generations, in a subprocess.

vLLM is started in a child process (it forks EngineCore workers, needs a `__main__` guard, and must be
shut down normally), so a crash or a refusal to load becomes a clear error in the parent, never a
hang or an orphaned process. The child writes JSON; the parent reads it.

    python -m eval.vllm_run --model DIR --prompts prompts.json --out result.json
prompts.json: {"token_ids": [[...], ...], "top_k": 5, "max_tokens": 8}
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from quantize.errors import UserError

from . import child


class VllmError(UserError, RuntimeError):
    pass


def allow_amx() -> bool:
    """Ask Linux for the AMX tile state in this process where the CPU has AMX -> whether it is granted.

    vLLM's CPU build (0.32) computes a bfloat16 4-bit linear with AMX tile instructions (its `cpu_gemm_wna16`,
    isa "amx") without asking for the tile state first (arch_prctl ARCH_REQ_XCOMP_PERM), and Linux stops a
    process that runs them unasked with SIGILL: the worker dies on the first request ("Illegal instruction")
    and a bfloat16 model such as Gemma never answers. torch's `_init_amx` asks. The grant is per process and
    cleared by exec, and vLLM spawns its engine and worker processes, each of which imports the main module of
    the command that started it (this one, or `eval.vllm_server`) as `__mp_main__`: that import asks in each.
    """
    init = getattr(torch.cpu, "_init_amx", None)
    supported = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(init is not None and supported is not None and supported() and init())


if __name__ in ("__main__", "__mp_main__"):  # a vLLM process: see allow_amx
    allow_amx()


# vLLM's gpu_memory_utilization for a child on a GPU: this process holds no model there while vLLM runs
GPU_MEMORY_FRACTION = 0.85


def vllm_env(work: Path) -> dict[str, str]:
    """Environment for a vLLM child: the CPU build's KV cache size and exact W4A16 numerics, caches under `work`,
    and on CUDA without flashinfer vLLM's own sampler."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CPU_INT4_W4A8", "0")
    env.setdefault("VLLM_CACHE_ROOT", str(work / "vllm-cache"))
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(work / "inductor"))
    env["TMPDIR"] = str(work)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")  # the kernel choice is logged at INFO
    if cuda_build() and importlib.util.find_spec("flashinfer") is None:
        # vLLM's CUDA sampler imports flashinfer unless told not to; the CUDA stack leaves that optional package out
        env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    return env


def run_vllm(model_dir: Path, token_ids: list[list[int]], top_k: int = 5, max_tokens: int = 8,
             dtype: str = "float16", timeout: float = 600, max_model_len: int = 512,
             memory_fraction: float | None = None) -> dict:
    """Start vLLM on model_dir in a subprocess -> {prompt_logprobs, generations, quantization, device, load_s}.

    memory_fraction: vLLM's gpu_memory_utilization. Default: 0.3 on the CPU build (it reserves that share of
    host RAM and refuses to start when other processes hold it), 0.85 on a GPU (this process holds no model
    there while vLLM runs).
    """
    if memory_fraction is None:
        memory_fraction = GPU_MEMORY_FRACTION if cuda_build() else 0.3
    with tempfile.TemporaryDirectory(prefix="vllm-run-") as work_s:
        work = Path(work_s)
        (work / "prompts.json").write_text(json.dumps(
            {"token_ids": token_ids, "top_k": top_k, "max_tokens": max_tokens, "dtype": dtype,
             "max_model_len": max_model_len, "gpu_memory_utilization": memory_fraction}))
        cmd = [sys.executable, "-m", "eval.vllm_run", "--model", str(model_dir), "--prompts",
               str(work / "prompts.json"), "--out", str(work / "out.json")]
        try:
            proc = child.run(cmd, vllm_env(work), timeout=timeout, cwd=Path(__file__).resolve().parent.parent)
        except subprocess.TimeoutExpired as e:
            raise VllmError(f"vLLM did not finish within {timeout:.0f} s on {model_dir}") from e
        result = whole_json(work / "out.json")
        log = (proc.stdout or "") + (proc.stderr or "")
        if result is None or not (proc.returncode == 0 or teardown_abort(proc.returncode, log)):
            raise VllmError(f"vLLM failed on {model_dir} (exit {proc.returncode}):\n{root_cause(log)}")
        result["kernels"] = kernels_from_log(log)
        return result


def teardown_abort(returncode: int, log: str) -> bool:
    """Whether a child that wrote its whole result then died the way a thread forced to unwind at interpreter
    exit kills it (SIGABRT after "terminate called without an active exception"): the result stands. `shut_down`
    is meant to leave no such thread; this stays for one that vLLM starts and does not stop."""
    return returncode == -signal.SIGABRT and "terminate called without an active exception" in log


def whole_json(path: Path) -> dict | None:
    """A vLLM child's result file, or None where it is missing or not whole JSON (the child died writing it)."""
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except json.JSONDecodeError:
        return None


def cuda_build() -> bool:
    """Whether this torch is a CUDA build with a device (vLLM then serves on CUDA, not the CPU)."""
    return torch.cuda.is_available()


def kernels_from_log(text: str) -> list[str]:
    """vLLM's 'Using <Kernel> for <method>' lines -> ['CPUWNA16LinearKernel for AutoAWQMarlinLinearMethod', ...]."""
    found = re.findall(r"Using (\w+Kernel\w*) for ([\w -]+)", text)
    return sorted({f"{k} for {m.strip()}" for k, m in found})


def root_cause(log: str, keep: int = 12) -> str:
    """The lines of vLLM's output that say why it failed, else the tail.

    Error lines are kept, and so are the indented lines under a pydantic "N validation error(s) for X" line:
    they hold the reason (e.g. "Value error, ... is not supported for quantization method awq"), which the
    error line itself does not. Very long lines (echoed arguments) are cut.
    """
    lines = log.strip().splitlines()
    hits: list[str] = []
    under_validation = False
    for ln in lines:
        body = _strip_prefix(ln)
        if re.search(r"\d+ validation errors? for", body):
            under_validation = True
            hits.append(ln)
        elif under_validation and body[:1] in (" ", "\t") and body.strip():
            if not body.strip().startswith("For further information"):
                hits.append(ln)
        else:
            under_validation = False
            if "Error" in ln or "error:" in ln or "cannot implement" in ln:
                hits.append(ln)
    hits = list(dict.fromkeys(hits))  # workers repeat the same error
    return "\n".join(_cut(x) for x in (hits or lines)[-keep:])


def _strip_prefix(line: str) -> str:
    """vLLM prefixes worker output with '(EngineCore pid=N) ' ; what follows is the message."""
    return re.sub(r"^\(\w+(?: pid=\d+)?\)\s?", "", line)


def _cut(line: str, width: int = 600) -> str:
    line = re.sub(r"input_value=.*?, input_type=", "input_value=..., input_type=", line)
    return line if len(line) <= width else line[:width] + " ..."


def shut_down(*llms, wait_s: float = 10) -> None:
    """Stop each `vllm.LLM`'s engine and let vLLM's background threads end, before the interpreter exits.

    Left to interpreter exit, the engine goes down while Python finalizes, and vLLM's daemon threads in this
    process (the sync client's output thread in a zmq poll, the engine-core monitor) wake to a finalizing
    interpreter: a thread then forced to unwind through libzmq's C++ aborts the process ("terminate called
    without an active exception", SIGABRT) after the result was written. `engine_core.shutdown()` is vLLM's
    own: it stops the engine processes and sends the output thread its shutdown message."""
    for llm in llms:
        llm.llm_engine.engine_core.shutdown()
    deadline = time.monotonic() + wait_s
    for t in threading.enumerate():
        if t.daemon and t is not threading.current_thread():
            t.join(timeout=max(0.0, deadline - time.monotonic()))


def _child(model: str, prompts_path: str, out_path: str) -> None:
    spec = json.loads(Path(prompts_path).read_text())
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, dtype=spec["dtype"], enforce_eager=True, max_model_len=spec["max_model_len"],
              seed=0, max_num_seqs=8, gpu_memory_utilization=spec["gpu_memory_utilization"])
    load_s = time.perf_counter() - t0
    from vllm.platforms import current_platform

    device = torch.cuda.get_device_name(0) if current_platform.is_cuda() else current_platform.device_type
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["token_ids"]]
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], logprobs=spec["top_k"],
                            prompt_logprobs=spec["top_k"])
    t1 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    gen_s = time.perf_counter() - t1
    result = {"load_s": load_s, "generate_s": gen_s, "device": device, "prompt_logprobs": [], "generations": [], "gen_logprobs": []}
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
    shut_down(llm)


if __name__ == "__main__":
    child.watch_parent()  # before vLLM starts its engine: the group dies with whoever started this run
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    _child(a.model, a.prompts, a.out)

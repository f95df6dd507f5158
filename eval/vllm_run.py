"""Load a directory in a real vLLM and return prompt logprobs and greedy generations, in a subprocess.

vLLM is started in a child process (it forks EngineCore workers, needs a `__main__` guard, and must be
shut down normally), so a crash or a refusal to load becomes a clear error in the parent, never a
hang or an orphaned process. The child writes JSON; the parent reads it.

    python -m eval.vllm_run --prompts prompts.json --out result.json
prompts.json: {"models": [DIR, ...], "token_ids": [[...], ...], "top_k": 5, "max_tokens": 8, ...}
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

from quantize import files
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
    [res] = run_vllm_many([model_dir], token_ids, top_k, max_tokens, dtype, timeout, max_model_len, memory_fraction,
                          in_process_engine=False)
    if "error" in res:
        raise VllmError(res["error"])
    return res


def run_vllm_many(model_dirs: list[Path], token_ids: list[list[int]], top_k: int = 5, max_tokens: int = 8,
                  dtype: str = "float16", timeout: float = 600, max_model_len: int = 512,
                  memory_fraction: float | None = None, in_process_engine: bool = True) -> list[dict]:
    """Each directory loaded in turn by one vLLM child -> per directory what `run_vllm` returns, or {"error": why}
    where vLLM refused or failed it (the rest still run).

    One child imports vLLM once; with `in_process_engine` its engine runs in that process (vLLM's
    VLLM_ENABLE_V1_MULTIPROCESSING=0) instead of a process of its own per model: a long matrix of small
    artifacts costs one start-up, not one each. `timeout` is per directory.
    """
    if memory_fraction is None:
        memory_fraction = GPU_MEMORY_FRACTION if cuda_build() else 0.3
    with tempfile.TemporaryDirectory(prefix="vllm-run-") as work_s:
        work = Path(work_s)
        (work / "prompts.json").write_text(json.dumps(
            {"models": [str(m) for m in model_dirs], "token_ids": token_ids, "top_k": top_k,
             "max_tokens": max_tokens, "dtype": dtype, "max_model_len": max_model_len,
             "gpu_memory_utilization": memory_fraction}))
        env = vllm_env(work)
        if in_process_engine:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        cmd = [sys.executable, "-m", "eval.vllm_run", "--prompts", str(work / "prompts.json"),
               "--out", str(work / "out.json")]
        try:
            proc = child.run(cmd, env, timeout=timeout * len(model_dirs), cwd=Path(__file__).resolve().parent.parent)
        except subprocess.TimeoutExpired:
            proc = None
        done = (whole_json(work / "out.json") or {}).get("results", [])
        logs = _per_model(proc.stdout or "", len(model_dirs)) if proc else [""] * len(model_dirs)
        errs = _per_model(proc.stderr or "", len(model_dirs)) if proc else [""] * len(model_dirs)
        out = []
        for i, m in enumerate(model_dirs):
            log = logs[i] + errs[i]
            res = done[i] if i < len(done) else None
            if proc is None and res is None:
                out.append({"error": f"vLLM did not finish within {timeout:.0f} s per directory on {m}"})
            elif i > len(done):
                out.append({"error": f"vLLM never reached {m}: its process ended on an earlier directory"})
            elif res is None or "error" in res:
                why = res["error"] if res else f"exit {proc.returncode}"
                out.append({"error": f"vLLM failed on {m} ({why}):\n{root_cause(log)}"})
            elif i == len(model_dirs) - 1 and not (proc.returncode == 0 or teardown_abort(proc.returncode, log)):
                out.append({"error": f"vLLM failed on {m} (exit {proc.returncode}):\n{root_cause(log)}"})
            else:
                out.append({**res, "kernels": kernels_from_log(log)})
        return out


MARK = "@@ quantize vllm_run model "  # the child's line before each model's load: splits its output per model


def _per_model(text: str, n: int) -> list[str]:
    """The child's output cut at its MARK lines -> one part per model (whatever came before the first goes with
    the first; a model never reached gets "")."""
    parts = [""] * n
    i = 0
    for line in text.splitlines(keepends=True):
        if line.startswith(MARK):
            i = int(line[len(MARK):].split()[0])
        parts[min(i, n - 1)] += line
    return parts


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


def _child(prompts_path: str, out_path: str) -> None:
    spec = json.loads(Path(prompts_path).read_text())
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.platforms import current_platform

    import_s = time.perf_counter() - t0
    device = torch.cuda.get_device_name(0) if current_platform.is_cuda() else current_platform.device_type
    results: list[dict] = []
    for i, model in enumerate(spec["models"]):
        for stream in (sys.stdout, sys.stderr):
            print(f"{MARK}{i} {model}", file=stream, flush=True)
        t1 = time.perf_counter()
        llm = None
        try:
            llm = LLM(model=model, dtype=spec["dtype"], enforce_eager=True, max_model_len=spec["max_model_len"],
                      seed=0, max_num_seqs=8, gpu_memory_utilization=spec["gpu_memory_utilization"])
            result = _ask(llm, spec, SamplingParams, TokensPrompt)
            if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":  # the model is in this process
                result["linear_kernels"] = llm.apply_model(linear_kernels)[0]
            result.update(load_s=(import_s if i == 0 else 0.0) + result.pop("init_s") - t1, device=device)
        except Exception as e:  # noqa: BLE001 - vLLM's refusal of one directory is that directory's result
            print(f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
            result = {"error": type(e).__name__}
        results.append(result)
        files.atomic_write_text(Path(out_path), json.dumps({"results": results}))
        if llm is not None:
            shut_down(llm)
            del llm
        if len(spec["models"]) > 1:
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()  # vLLM's own reset between engines in one process


def linear_kernels(model) -> dict[str, int]:
    """The kernel class each quantized linear of a loaded vLLM model runs, counted: {"MacheteLinearKernel": 196}.
    vLLM logs its choice once per process and method, so in a process that loads several models the log does not
    say it for each; the layers do (the method's `kernel`, or a compressed-tensors scheme's)."""
    found: dict[str, int] = {}
    for m in model.modules():
        owner = getattr(m, "scheme", None) or getattr(m, "quant_method", None)
        kernel = getattr(owner, "kernel", None)
        if kernel is not None:
            found[type(kernel).__name__] = found.get(type(kernel).__name__, 0) + 1
    return found


def _ask(llm, spec: dict, SamplingParams, TokensPrompt) -> dict:
    """Prompt logprobs and greedy generations of one loaded `LLM`."""
    init_s = time.perf_counter()
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["token_ids"]]
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], logprobs=spec["top_k"],
                            prompt_logprobs=spec["top_k"])
    outputs = llm.generate(prompts, params, use_tqdm=False)
    result = {"init_s": init_s, "generate_s": time.perf_counter() - init_s, "prompt_logprobs": [],
              "generations": [], "gen_logprobs": []}
    for o in outputs:
        # prompt_logprobs[0] is None (no prediction for the first token); keep position -> {token: logprob}
        result["prompt_logprobs"].append(
            [None if d is None else {str(t): lp.logprob for t, lp in d.items()} for d in o.prompt_logprobs])
        c = o.outputs[0]
        result["generations"].append(list(c.token_ids))
        result["gen_logprobs"].append([{str(t): lp.logprob for t, lp in d.items()} for d in (c.logprobs or [])])
    cfg = llm.llm_engine.vllm_config if hasattr(llm.llm_engine, "vllm_config") else None
    result["quantization"] = getattr(getattr(cfg, "model_config", None), "quantization", None)
    result["generated_tokens"] = sum(len(g) for g in result["generations"])
    return result


if __name__ == "__main__":
    child.watch_parent()  # before vLLM starts its engine: the group dies with whoever started this run
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    _child(a.prompts, a.out)

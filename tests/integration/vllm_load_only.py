"""Start a real vLLM (CPU build) on a directory and report how it loaded each linear, without generating.

This runs where vLLM cannot compute a 4-bit linear (an AVX2-only CPU): the engine starts and loads every
weight, which is where a checkpoint whose config and tensors disagree is refused. A child process, as in
`eval.vllm_run`; the report is read inside vLLM's worker through `LLM.apply_model`.

    python -m tests.integration.vllm_load_only DIR OUT.json
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from eval import child
from eval.vllm_run import VllmError, root_cause, shut_down, vllm_env

ROOT = Path(__file__).resolve().parents[2]


def probe_input(in_features: int, dtype) -> "torch.Tensor":
    """The fixed input [2, in_features] an unquantized linear is run on to read its weight back."""
    import torch

    return torch.randn(2, in_features, generator=torch.Generator().manual_seed(0)).to(dtype)


def linear_methods(model) -> dict[str, dict]:
    """vLLM model -> {linear: {method, params: {name: dtype}, output}}; `output` (an unquantized linear's result
    on `probe_input`, as nested lists) checks that vLLM computes with the file's values: its CPU build may
    prepack such a weight into oneDNN and leave the parameter empty, so the weight itself cannot be read back.
    Runs inside the worker, so it must be importable there by this module's name."""
    import torch

    out = {}
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None or not name.rsplit(".", 1)[-1].endswith("_proj"):
            continue
        params = dict(module.named_parameters(recurse=False))
        output = None
        if type(method).__name__ == "UnquantizedLinearMethod":
            with torch.no_grad():
                x = probe_input(module.input_size_per_partition, module.params_dtype)
                output = method.apply(module, x).double().tolist()
        out[name] = {"method": type(method).__name__,
                     "params": {k: str(p.dtype).removeprefix("torch.") for k, p in sorted(params.items())},
                     "output": output}
    return out


def load(model_dir: Path, timeout: float = 600) -> dict[str, dict]:
    """Start vLLM on model_dir in float16 in a child process -> linear_methods of the loaded model."""
    with tempfile.TemporaryDirectory(prefix="vllm-load-") as work_s:
        work = Path(work_s)
        env = vllm_env(work)
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # apply_model sends a function to the worker
        cmd = [sys.executable, "-m", "tests.integration.vllm_load_only", str(model_dir), str(work / "out.json")]
        proc = child.run(cmd, env, timeout=timeout, cwd=ROOT)
        if proc.returncode != 0 or not (work / "out.json").is_file():
            raise VllmError(f"vLLM failed on {model_dir} (exit {proc.returncode}):\n"
                            f"{root_cause(proc.stdout + proc.stderr)}")
        return json.loads((work / "out.json").read_text())


def _child(model_dir: str, out: str) -> None:
    from vllm import LLM

    # imported by name: a function of __main__ cannot be pickled for the worker
    from tests.integration.vllm_load_only import linear_methods as report

    llm = LLM(model=model_dir, dtype="float16", enforce_eager=True, max_model_len=256, max_num_seqs=1,
              gpu_memory_utilization=0.1)
    Path(out).write_text(json.dumps(llm.apply_model(report)[0]))
    shut_down(llm)


if __name__ == "__main__":
    child.watch_parent()
    _child(sys.argv[1], sys.argv[2])

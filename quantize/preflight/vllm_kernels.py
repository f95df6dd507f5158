"""Child process: ask the installed vLLM which kernel it would run for each quantized module on a target GPU.

Run as `python -m quantize.preflight.vllm_kernels` with `{"queries": [query, ...]}` (JSON, see `deploy.query`) on
stdin; prints one line `DEPLOY_ANSWER <json>` (vLLM logs to stdout too, so the parent matches that prefix). Never
imported by the package itself: it imports vLLM and changes what vLLM's platform answers, which only a throw-away
process may do.

How the answer is obtained: vLLM's own code does every step, with the target given explicitly.
- The checkpoint's `quantization_config` goes through vLLM's method resolution (`ModelConfig._verify_quantization`,
  called on a stand-in holding only the fields it reads), then the method's `QuantizationConfig.from_config`.
- The config then goes through `maybe_update_config` as vLLM's loader does, reading the headers of a checkpoint
  whose quantized modules are the query's (`_as_loaded`).
- Each module is built as vLLM builds it (`QKVParallelLinear`, `MergedColumnParallelLinear`, `RowParallelLinear`,
  the fused MoE factory) on the meta device, so vLLM's partitioning and its `get_quant_method` / `create_weights`
  (where `choose_mp_linear_kernel` or the MoE oracle picks the kernel) run unchanged; the kernel is read back from
  the built module, a ValueError / NotImplementedError is vLLM's refusal.
It answers under vLLM 0.26 (the CUDA build, also on a machine without a GPU, where its platform is unknown) and
0.32 (the CPU build): a symbol the releases keep in different places is looked up where each keeps it
(`_MOE_FACTORY`); one a release lacks is named in the answer (`humming_priority`: 0.26 has no rule ranking Humming
ahead of Marlin).
What is patched, and why (nothing else):
- `current_platform`'s class is swapped for a CUDA platform whose `get_device_capability` returns the target: every
  capability question in vLLM's selection code (`is_cuda`, `is_device_capability`, `has_device_capability`, the
  Marlin / Machete / Humming checks, the MoE backend list) goes through it, and the CPU build has no CUDA platform
  class to import (cuda.py loads CUDA-only compiled ops). Its `import_kernels` is a no-op: the CPU build's ops were
  loaded by its own platform, loading them again aborts. Its `num_compute_units` answers a fixed SM count: Marlin
  sizes a (meta) workspace with it.
- The config's module-level `get_safetensors_params_metadata` answers for `_as_loaded`, while it runs only.
- `parallel_state._TP` (and the DP / PCP / EP / PP groups) are stand-ins with the target tensor-parallel size and
  rank 0: the layers read the TP size from there, and no process group exists without GPUs.
- Every vLLM module the selection needs is imported before the swap: some import CUDA-only extensions when they
  see a CUDA platform at import time.
Optional kernel packages (conch-triton-kernels, humming) count as they are installed in this environment; the
answer records which were present.
"""

from __future__ import annotations

import itertools
import json
import sys
from importlib.util import find_spec
from types import SimpleNamespace

PREFIX = "DEPLOY_ANSWER "
_SERIAL = itertools.count()


def _target_platform(platform_cls, enum, capability_cls, target: list[int]):
    """A CUDA platform class answering `target` ([major, minor], changed in place between cells)."""

    class TargetCuda(platform_cls):
        _enum = enum.CUDA
        device_type = "cuda"
        device_name = "cuda"
        dispatch_key = "CUDA"

        @classmethod
        def get_device_capability(cls, device_id: int = 0):
            return capability_cls(*target)

        @classmethod
        def import_kernels(cls) -> None:
            pass

        @classmethod
        def num_compute_units(cls, device_id: int = 0) -> int:
            return 132  # sizes Marlin's workspace (on the meta device) only; no kernel choice reads it


    return TargetCuda


def _method(me_quant, model_config_cls, qcfg: dict) -> str:
    """vLLM's own choice of quantization method for a checkpoint's quantization_config (no --quantization)."""
    stand_in = SimpleNamespace(quantization=None, hf_config=None, allow_deprecated_quantization=False,
                               model_arch_config=SimpleNamespace(quantization_config=qcfg))
    model_config_cls._verify_quantization(stand_in)
    return stand_in.quantization


def _build(mod: dict, tp: int, dtype, qc, L, moe_factory, prefix: str):
    """One module of the query, built as vLLM builds it -> (kernel name, vLLM's method class name).

    prefix: the module's name, under a layer index never used before (vLLM registers every MoE layer's name and
    refuses a duplicate)."""
    kw = dict(quant_config=qc, params_dtype=dtype, prefix=prefix)
    kind = mod["kind"]
    if kind == "experts":
        runner = moe_factory(num_experts=mod["experts"], top_k=mod["top_k"], hidden_size=mod["hidden"],
                             intermediate_size=mod["intermediate"], tp_size=tp, **kw)
        layer = next(m for m in runner.modules() if hasattr(m, "quant_method"))
        qm = layer.quant_method
        experts = getattr(qm, "experts_cls", None)
        return (experts.__name__ if experts else type(qm).__name__), type(qm).__name__
    if kind == "qkv":
        layer = L.QKVParallelLinear(mod["hidden"], mod["head_dim"], mod["heads"], mod["kv_heads"], bias=False, **kw)
    elif kind == "merged":
        layer = L.MergedColumnParallelLinear(mod["in"], list(mod["outs"]), bias=False, **kw)
    elif kind == "column":
        layer = L.ColumnParallelLinear(mod["in"], mod["out"], bias=False, **kw)
    else:
        layer = L.RowParallelLinear(mod["in"], mod["out"], bias=False, **kw)
    qm = layer.quant_method
    # MP-kernel methods hold `kernel`; compressed-tensors keeps its scheme (and the scheme's kernel) on the layer
    kernel = getattr(qm, "kernel", None) or getattr(getattr(layer, "scheme", None), "kernel", None)
    return (type(kernel).__name__ if kernel is not None else type(qm).__name__), type(qm).__name__


def _as_loaded(qc, prefixes: list[str]) -> None:
    """What vLLM's loader does to a quantization config before building the model: `maybe_update_config` reads
    the checkpoint's safetensors headers (GPTQ lists the modules holding integer tensors, and vLLM 0.26 builds a
    GPTQ linear missing from that list unquantized). The headers are those of a checkpoint whose quantized modules
    are exactly the query's: each module's own (vLLM-side, fused) name with an int32 qweight."""
    import sys

    home = sys.modules[type(qc).__module__]
    read = getattr(home, "get_safetensors_params_metadata", None)
    if read is None:  # this config reads no checkpoint headers
        qc.maybe_update_config("checkpoint")
        return
    home.get_safetensors_params_metadata = lambda *a, **k: {
        **{f"{p}.qweight": {"dtype": "I32"} for p in prefixes}, **{f"{p}.scales": {"dtype": "F16"} for p in prefixes}}
    try:
        qc.maybe_update_config("checkpoint")
    finally:
        home.get_safetensors_params_metadata = read


def _cell(v: "_Vllm", query: dict, method: str, qc_cls, tp: int, dtype_name: str, cap: int) -> dict:
    """Every module of the query at one (capability, TP, dtype) -> {modules: {name: kernel or refusal}, refused}."""
    torch = v.torch
    dtype = getattr(torch, dtype_name)
    out: dict = {"modules": {}, "refused": None}
    prefixes = {mod["name"]: f"model.layers.{next(_SERIAL)}.{mod['name']}" for mod in query["modules"]}
    try:
        qc = qc_cls.from_config(dict(query["quantization_config"]))
        _as_loaded(qc, list(prefixes.values()))
        if cap < qc.get_min_capability():  # what VllmConfig._get_quantization_config refuses
            raise ValueError(f"{method} needs compute capability {qc.get_min_capability()}")
        if dtype not in qc.get_supported_act_dtypes():
            raise ValueError(f"{dtype_name} is not supported for quantization method {method}")
    except Exception as e:  # noqa: BLE001 - vLLM refuses the checkpoint's config whatever the module
        out["refused"] = f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"
        return out
    for mod in query["modules"]:
        try:
            with torch.device("meta"), v.set_vc(v.vc):
                kernel, via = _build(mod, tp, dtype, qc, v.L, v.moe_factory, prefixes[mod["name"]])
            out["modules"][mod["name"]] = {"kernel": kernel, "method": via}
        except Exception as e:  # noqa: BLE001 - whatever vLLM raises while building the module, it would raise at load
            out["modules"][mod["name"]] = {"refused": f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"}
    return out


# Where each vLLM release keeps a symbol the selection needs, newest first: (module, attribute)
_MOE_FACTORY = (("vllm.model_executor.layers.fused_moe.layer", "FusedMoEFactory"),  # 0.32
                ("vllm.model_executor.layers.fused_moe.layer", "FusedMoE"))  # 0.26: the same factory, older name
# 0.32 moves Humming ahead of Marlin where it prefers it (capability 9.0); 0.26 has no such rule (Humming last)
_HUMMING_PRIORITY = (("vllm.model_executor.layers.quantization.utils.humming.priority", "prioritize_humming"),)


def _first(places):
    """The first of `places` this vLLM has, or None."""
    from importlib import import_module

    for module, attr in places:
        try:
            return getattr(import_module(module), attr)
        except (ImportError, AttributeError):
            continue
    return None


class _Vllm:
    """vLLM's modules the selection needs, imported under vLLM's own platform, then the platform swapped."""

    def __init__(self):
        import logging

        import torch
        import vllm
        import vllm.distributed.parallel_state as ps
        import vllm.model_executor.layers.linear as linear
        from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
        from vllm.model_executor.kernels import linear as kernels
        from vllm.model_executor.layers import quantization as me_quant
        from vllm.model_executor.layers.fused_moe.oracle import int_wna16
        from vllm.platforms import current_platform
        from vllm.platforms.interface import DeviceCapability, Platform, PlatformEnum

        logging.getLogger("vllm").setLevel(logging.ERROR)
        for name in me_quant.QUANTIZATION_METHODS:  # every import a method needs, under the CPU platform
            me_quant.get_quantization_config(name)
        self.torch, self.version, self.ps, self.L = torch, vllm.__version__, ps, linear
        self.model_config, self.set_vc = ModelConfig, set_current_vllm_config
        self.me_quant, self.moe_factory = me_quant, _first(_MOE_FACTORY)
        if self.moe_factory is None:
            raise ImportError(f"vLLM {vllm.__version__} has none of {[f'{m}.{a}' for m, a in _MOE_FACTORY]}")
        self.cuda_kernels = kernels._POSSIBLE_KERNELS[PlatformEnum.CUDA]
        self.prioritize_humming = _first(_HUMMING_PRIORITY)
        self.moe_backends = int_wna16._get_priority_backends
        self.target = [0, 0]
        current_platform.__class__ = _target_platform(Platform, PlatformEnum, DeviceCapability, self.target)
        # built once the platform is CUDA: a vLLM whose own platform is unknown (the CUDA build on a machine
        # without a GPU) cannot infer a device for it before
        self.vc = VllmConfig()
        ps._DP = ps._PCP = ps._EP = ps._PP = SimpleNamespace(world_size=1, rank_in_group=0)

    def set_target(self, capability: str, tp: int) -> int:
        self.target[:] = [int(x) for x in capability.split(".")]
        self.ps._TP = SimpleNamespace(world_size=tp, rank_in_group=0)
        return self.target[0] * 10 + self.target[1]

    def priority(self, cap_int: int) -> dict:
        """vLLM's kernel lists in its own order of preference (fastest first) at this capability."""
        linear = self.cuda_kernels if self.prioritize_humming is None else \
            self.prioritize_humming(self.cuda_kernels, cap_int)
        return {"linear": [k.__name__ for k in linear],
                "moe": [b.value for b in self.moe_backends()]}


def answer(v: _Vllm, query: dict) -> dict:
    """One query (a format's quantization_config and modules) -> every (capability, TP, dtype) cell."""
    cells, priority = [], {}
    for cap in query["capabilities"]:
        cap_int = v.set_target(cap, 1)
        priority[cap] = v.priority(cap_int)
        try:
            method = _method(v.me_quant, v.model_config, dict(query["quantization_config"]))
            qc_cls, why = v.me_quant.get_quantization_config(method), None
        except Exception as e:  # noqa: BLE001 - vLLM cannot resolve a method for this checkpoint
            method, qc_cls, why = None, None, f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"
        for tp in query["tp_sizes"]:
            v.set_target(cap, tp)
            for dt in query["dtypes"]:
                cell = {"modules": {}, "refused": why} if qc_cls is None else _cell(v, query, method, qc_cls, tp, dt,
                                                                                      cap_int)
                cells.append({"capability": cap, "tp": tp, "dtype": dt, "method": method, **cell})
    return {"vllm_version": v.version, "cells": cells, "priority": priority,
            "optional_kernels": {p: find_spec(p) is not None for p in ("conch", "humming")},
            "humming_priority": v.prioritize_humming is not None}


def main() -> int:
    request = json.loads(sys.stdin.read())
    v = _Vllm()
    answers = [answer(v, q) for q in request["queries"]]
    print(PREFIX + json.dumps({"answers": answers}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

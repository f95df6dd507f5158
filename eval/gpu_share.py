"""Whether another process holds the GPU memory a vLLM child is about to ask for, and which process it is.

vLLM refuses to start (or runs out of memory) when less than its `gpu_memory_utilization` share of the card is
free, typically because a vLLM left behind by an earlier run still holds it. A run says so at its start, naming
the holders' process ids where NVML answers (through `nvidia-smi`), instead of failing an hour later in
the eval's vLLM stage.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from dataclasses import dataclass

import torch

from .vllm_run import GPU_MEMORY_FRACTION

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Holder:
    pid: int
    used_bytes: int | None  # None where NVML does not say (e.g. inside a container without its pid namespace)
    name: str = ""


def busy_message(free: int, total: int, share: float, holders: list[Holder], own_pid: int) -> str | None:
    """The warning when less than `share` of the card is free -> the text, else None.

    free, total: bytes (cudaMemGetInfo). holders: the card's compute processes; this process is left out."""
    if total <= 0 or free >= share * total:
        return None
    others = sorted((h for h in holders if h.pid != own_pid), key=lambda h: -(h.used_bytes or 0))
    gib = 1 << 30
    named = ", ".join(f"pid {h.pid}" + (f" ({h.name})" if h.name else "")
                      + (f" holds {h.used_bytes / gib:.1f} GiB" if h.used_bytes is not None else "")
                      for h in others)
    who = f"held by {named}" if named else "the holding process is not visible from here (NVML named none)"
    return (f"only {free / gib:.1f} of {total / gib:.1f} GiB free on the GPU vLLM will use, {who}; vLLM asks for "
            f"{share:.0%} of the card and will fail to start: stop that process (a vLLM left behind by an earlier "
            f"run?) or free the GPU")


def holders(uuid: str) -> list[Holder]:
    """The compute processes on the GPU with this UUID, as NVML reports them through `nvidia-smi` (it ships with
    the driver; no Python binding needed), or [] where it does not answer."""
    return _smi_holders(uuid)


def _nvml_uuid(uuid: str) -> str:
    """torch's device UUID -> NVML's form ('GPU-' prefixed)."""
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


def _smi_holders(uuid: str) -> list[Holder]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "--query-compute-apps=gpu_uuid,pid,used_memory,process_name",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return parse_smi(out, uuid)


def parse_smi(out: str, uuid: str) -> list[Holder]:
    """nvidia-smi's compute-apps CSV (gpu_uuid, pid, used_memory MiB, process_name) -> this GPU's holders."""
    found = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",", 3)]
        if len(parts) < 3 or parts[0].lower() != _nvml_uuid(uuid).lower() or not parts[1].isdigit():
            continue
        used = int(parts[2]) << 20 if parts[2].isdigit() else None  # "[N/A]" without the rights to read it
        found.append(Holder(int(parts[1]), used, parts[3] if len(parts) > 3 else ""))
    return found


def starts_vllm(eopts) -> bool:
    """Whether an eval with these options (`EvalOptions`) starts vLLM: its smoke stage, or lm-eval tasks scored
    through lm-eval's vLLM backend."""
    return eopts.enabled and (eopts.vllm.enabled or (eopts.lm_eval.vllm and bool(eopts.lm_eval.tasks)))


def warn_before_eval(eopts) -> str | None:
    """At a run's start: the busy message (also logged) when its eval will start vLLM on a GPU another process
    holds, else None. GPU 0 of those visible: the one a vLLM child starts on."""
    return warn_if_busy(GPU_MEMORY_FRACTION) if starts_vllm(eopts) else None


def warn_if_busy(share: float, index: int = 0) -> str | None:
    """On a CUDA host: log (warning) and return the busy message for GPU `index`, else None."""
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info(index)
    uuid = str(torch.cuda.get_device_properties(index).uuid)
    msg = busy_message(free, total, share, holders(uuid), os.getpid())
    if msg:
        log.warning("%s", msg)
    return msg

"""What a report shows people about where and how long it ran: the machine in words, timings in seconds."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch


def machine() -> str:
    """e.g. "x86_64, AMD EPYC 9654 96-Core Processor, 2 cores, no GPU"."""
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return ", ".join(filter(None, [platform.machine(), _cpu_model(), f"{os.cpu_count()} cores", gpu]))


def _cpu_model() -> str | None:
    """The processor's model name (Linux: /proc/cpuinfo), or None where the system does not say (platform's
    `processor()` repeats the architecture on Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    cpu = platform.processor()
    return cpu if cpu and cpu != platform.machine() else None


def seconds_text(timings: dict | None, missing: str = "not recorded (no manifest of ours in the directory)") -> str:
    """{"load": 1.234, "hash": 0.032} -> "load 1.2 s, hash 0.032 s" (the order kept), for people rather than for
    parsers (report.json keeps the numbers); None (a directory another tool wrote has no manifest to take the
    quantize stage's timings from) -> `missing`."""
    if timings is None:
        return missing
    def text(v) -> str:
        return (f"{v:.1f}" if abs(v) >= 1 else f"{v:.2g}") + " s" if isinstance(v, (int, float)) else str(v)
    return ", ".join(f"{k} {text(v)}" for k, v in timings.items())

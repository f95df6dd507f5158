"""Where a run's GPU time goes: torch.profiler around a callable, summarised by kernel and by kind of kernel.

    with KernelProfile() as kp:
        runner.run(...)
    summary = kp.summary(wall_s)   # JSON-ready

The summary holds, for the device kernels (CUDA; none on a CPU run): the sum of their durations per kind (GEMM,
attention, Triton, solver, copies, elementwise and reductions, other), the time during which at least one kernel
ran (the union of their intervals: overlapping streams are counted once), that time's share of `wall_s`, and the
top kernels by total duration with their call counts. What the kinds mean is in `KINDS`: a kernel goes to the
first kind whose pattern its name matches.
"""

from __future__ import annotations

import re
from collections import defaultdict

import torch

KINDS: tuple[tuple[str, str], ...] = (
    ("copy", r"^Memcpy|^Memset|memcpy|memset"),
    ("triton_ours", r"sweep_block|clip_|_clip|awq_|fake_quant"),
    ("attention", r"flash|fmha|attention|sdpa|softmax"),
    ("gemm", r"gemm|nvjet|cutlass|xmma|cublas|gemv|matmul|splitK"),
    ("solver", r"potrf|trsm|syrk|trsv|chol|cusolver|getrf|laswp"),
    ("elementwise_reduce", r"elementwise|vectorized|reduce|unrolled|index|scatter|gather|cat|copy|fill|sort"),
)


def kind_of(name: str) -> str:
    """A kernel's kind by its name (the first of `KINDS` whose pattern matches), else "other"."""
    for kind, pattern in KINDS:
        if re.search(pattern, name, re.IGNORECASE):
            return kind
    return "other"


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end] intervals (any unit in, the same unit out)."""
    total, end_max = 0.0, None
    for start, end in sorted(intervals):
        if end_max is None or start > end_max:
            total += end - start
            end_max = end
        elif end > end_max:
            total += end - end_max
            end_max = end
    return total


class KernelProfile:
    """torch.profiler over a block (CPU activity always, CUDA where available), summarised by `summary`."""

    def __init__(self, top: int = 40):
        self.top = top
        acts = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(activities=acts)

    def __enter__(self) -> "KernelProfile":
        self.prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.prof.__exit__(*exc)

    def kernels(self) -> list[tuple[str, float, float]]:
        """Every device kernel or copy the block ran -> (name, start µs, end µs)."""
        out = []
        for e in self.prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                out.append((e.name, float(e.time_range.start), float(e.time_range.end)))
        return out

    def summary(self, wall_s: float) -> dict:
        ks = self.kernels()
        per_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        per_kind: dict[str, float] = defaultdict(float)
        for name, start, end in ks:
            per_name[name][0] += 1
            per_name[name][1] += (end - start) / 1e6
            per_kind[kind_of(name)] += (end - start) / 1e6
        busy = busy_seconds([(s, e) for _, s, e in ks]) / 1e6
        top = sorted(per_name.items(), key=lambda kv: -kv[1][1])[: self.top]
        return {
            "wall_s": round(wall_s, 3),
            "kernels": len(ks),
            "kernel_seconds": round(sum(v for v in per_kind.values()), 3),
            "busy_s": round(busy, 3),
            "busy_share_of_wall": round(busy / wall_s, 4) if wall_s > 0 else None,
            "by_kind_s": {k: round(v, 3) for k, v in sorted(per_kind.items(), key=lambda kv: -kv[1])},
            "top": [{"name": n[:160], "kind": kind_of(n), "calls": c, "seconds": round(s, 4)} for n, (c, s) in top],
            "kinds": {k: p for k, p in KINDS},
        }

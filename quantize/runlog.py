"""A structured record of one run's timings, filled by the runner, the capture loop and the methods; and the
stopwatch (`Timings`) that times a run's stages and logs each.

The log lines say the same for people; this is for programs (benchmarks, reports) that would otherwise parse
them. Every field is plain data: `to_dict()` is JSON-serialisable.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

log = logging.getLogger(__name__)


@dataclass
class StageRecord:
    """One method stage of one recipe in one decoder layer: GPTQ's per linear group {"hessian", "sweep"},
    AWQ's {"scale_search", "clip", "quantize"}."""

    recipe: str
    stage: str  # GPTQ: the stage's linears joined by "+" ("self_attn.q_proj+self_attn.k_proj+..."); AWQ: "awq"
    seconds: dict[str, float]


@dataclass
class LayerRecord:
    """One decoder layer of the pass (index from 0): its wall seconds, the pass's parts (device upload, FP
    forward, the jobs), each method stage's seconds. On CUDA every part ends at a device synchronisation."""

    index: int
    seconds: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)  # "to_device", "fp_forward", "jobs"
    stages: list[StageRecord] = field(default_factory=list)


@dataclass
class RunLog:
    """What `runner.run` / `run_many` did, in seconds: per stage, per decoder layer; the peak device memory.

    stages: "preflight", "calibrate" (awq, gptq), "load", "quantize", "export" (all artifacts of the run).
    layers: one record per decoder layer the pass worked on, in order (a resumed pass: from its checkpoint on).
    peak_allocated_bytes / peak_reserved_bytes: torch.cuda's peaks at the end of the pass on a CUDA device
    (since the process started or the caller last reset them), None elsewhere.
    device: where the pass ran: the device, the compute dtype and the CUDA allocator settings (None off CUDA).
    export_parts: the export stage's parts summed over the run's artifacts (`export.artifact.write_artifact`).
    preflight_parts: the pre-flight stage's parts: "config" (its first read imports transformers' model code),
    "checkpoint" (weight files' headers against the model; the tokenizer where calibration does not load it),
    "plan" (shapes, formats, the deployability table), "eval inputs" (where the caller checks them), "device"
    (the device and its kernels).
    """

    stages: dict[str, float] = field(default_factory=dict)
    layers: list[LayerRecord] = field(default_factory=list)
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    device: dict = field(default_factory=dict)
    export_parts: dict[str, float] = field(default_factory=dict)
    preflight_parts: dict[str, float] = field(default_factory=dict)

    def layer(self, index: int) -> LayerRecord:
        """The record of decoder layer `index`, created on first use."""
        if not self.layers or self.layers[-1].index != index:
            found = next((r for r in self.layers if r.index == index), None)
            if found is not None:
                return found
            self.layers.append(LayerRecord(index))
        return self.layers[-1]

    def stage(self, index: int, recipe: str, stage: str, **seconds: float) -> None:
        """Record a method stage's seconds in decoder layer `index`."""
        self.layer(index).stages.append(StageRecord(recipe, stage, {k: round(v, 4) for k, v in seconds.items()}))

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Timings:
    """Seconds per stage, and per part of a stage that keeps a stopwatch (`laps`)."""

    stages: dict[str, float] = field(default_factory=dict)
    parts: dict[str, dict[str, float]] = field(default_factory=dict)

    @contextmanager
    def stage(self, name: str):
        log.info("stage %s: start", name)
        t0 = time.perf_counter()
        yield
        self.stages[name] = round(time.perf_counter() - t0, 3)
        log.info("stage %s: done in %.1f s", name, self.stages[name])
        if self.parts.get(name):
            log.info("stage %s: %s", name, ", ".join(f"{k} {v:.1f} s" for k, v in self.parts[name].items()))

    def laps(self, stage: str) -> Callable[[str], None]:
        """A stopwatch over `stage`'s parts: lap(name) adds the seconds since the previous lap (or since now) to
        parts[stage][name]."""
        last = [time.perf_counter()]

        def lap(name: str) -> None:
            now, mine = time.perf_counter(), self.parts.setdefault(stage, {})
            mine[name] = round(mine.get(name, 0.0) + now - last[0], 3)
            last[0] = now

        return lap

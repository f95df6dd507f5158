"""What a run on a CPU without AVX-512 should expect, said once at its start.

On such a processor the default recipe's quantize stage takes minutes, and vLLM's CPU build loads its AVX2 library,
which has no 4-bit kernel, so the eval's vLLM smoke test is skipped. A newcomer's first `make quantize` otherwise
shows neither until it ends: the start line names the processor, the measured time and the skipped smoke.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from eval import smoke
from quantize.export import cpu_serve

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Measured:
    """One recorded `make quantize` of the default recipe, and the box it ran on."""

    recipe: str
    box: str
    quantize_s: float  # the quantize stage alone
    whole_s: float  # the whole command, eval included
    record: str


# The default recipe on a 2-core AMD EPYC with AVX2 only, nothing else running, fresh clone, eval on
AVX2_DEFAULT = Measured(recipe="smollm2-awq-g64", box="2-core AVX2-only box", quantize_s=342.0, whole_s=619.0,
                        record="bench/results/cpu-make-quantize-avx2-2026-12-04.json")


def _cores() -> int:
    """The cores this process may run on (what torch's threads share)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call outside Linux
        return os.cpu_count() or 1


def _minutes(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m} min {s:02d} s"


def cpu_line(cpu: dict | None, cores: int, smoke_skipped: str | None, measured: Measured = AVX2_DEFAULT) -> str | None:
    """The start line for a CPU run -> None where the processor has AVX-512 or does not say what it has.

    cpu: `quantize.export.cpu_serve.facts()`; smoke_skipped: why the eval's vLLM smoke will be skipped, or None
    where it will run or the run does not evaluate."""
    if cpu is None or cpu["avx512"]:
        return None
    line = (f"this CPU ({cpu['model'] or 'model not reported'}, {cores} cores, no AVX-512: vLLM's CPU build runs its "
            f"AVX2 library): the default recipe {measured.recipe} measured {measured.quantize_s:.0f} s for the "
            f"quantize stage and {_minutes(measured.whole_s)} for the whole `make quantize` with its eval on a "
            f"{measured.box} ({measured.record})")
    if smoke_skipped:
        line += f"; the vLLM smoke test will be skipped: {smoke_skipped}"
    return line


def announce(recipe, evaluates: bool, device) -> None:
    """Log `cpu_line` for a run of `recipe` when it computes on the CPU, `device` (one line; call it once per
    run)."""
    if device.type != "cpu":
        return
    cpu = cpu_serve.facts()
    if cpu is None or cpu["avx512"]:
        return  # the vLLM probe below takes seconds: asked only where the answer is said
    skipped = None
    if evaluates and recipe.eval.vllm.enabled:
        skipped = smoke.vllm_unavailable()
    line = cpu_line(cpu, _cores(), skipped)
    if line:
        log.info(line)

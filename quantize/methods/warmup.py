"""Triton's kernels compiled by a side process while the run's pre-flight, calibration and load go on.

On a host whose Triton cache is empty (a fresh container), a CUDA run's first layer compiles every kernel its
method launches: AWQ's candidate and clip-search kernels cost the first decoder layer seconds, GPTQ's sweep
less (docs/BENCHMARKS.md). What Triton compiles depends only on the launch's dtypes, constants and
whether each integer argument is 1 or a multiple of 16, and the recipe and the model's config.json fix all of
those before any weight is read. So a CUDA run starts a process (`python -m quantize.methods.warmup`) that
launches each kernel its recipes will use once, on a few rows with the real linears' column counts and dtypes,
which puts the same entries in Triton's on-disk cache; the run's first launch of each kernel waits for the
process's word that it is there (`wait`), then loads it instead of compiling it.

Nothing computed depends on this: a kernel the process did not compile (a shape it did not foresee) is compiled
by the run as before, and a process that fails or is slow is logged and left behind (`WAIT_BUDGET_S`).
`QUANTIZE_TRITON_WARMUP=off` turns it off. Runs over several ranks (torchrun) do without it.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from ..errors import UserError

log = logging.getLogger(__name__)

ENV = "QUANTIZE_TRITON_WARMUP"  # off: no side process
WAIT_BUDGET_S = 120.0  # the run waits for the side process at most this long in all, then compiles on its own
FINISH_S = 10.0  # a side process with every key released has this long to write its last line
PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # holds the `quantize` package, for the child's sys.path


def enabled() -> bool:
    """Whether the environment allows the side process (QUANTIZE_TRITON_WARMUP unset, on or off)."""
    value = os.environ.get(ENV, "on")
    if value not in ("on", "off"):
        raise UserError(f"{ENV}={value!r} is neither on nor off: set it to off to run without the side process "
                        f"that compiles Triton kernels, or unset it")
    return value == "on"


def key(module: str, group: int) -> str:
    """The name a kernel's launches are awaited by: its module and the group size (a comparison's variants differ
    in the group size, and the pass reaches them one after the other)."""
    return f"{module}:{group}"


def key_of(launch: dict) -> str:
    return key(launch["module"], launch["group"])


class Warmup:
    """The side process compiling `launches` (started by `start`) and what the run has heard from it."""

    def __init__(self, launches: list[dict], device: str = "cuda"):
        self.launches, self.device = launches, device
        self.ready = {key_of(x): threading.Event() for x in launches}
        self.proc: subprocess.Popen | None = None
        self.reader: threading.Thread | None = None
        self.waited = 0.0
        self.compiled_s: float | None = None  # the process's own seconds, once it has finished
        self.failed: list[str] = []

    def command(self) -> list[str]:
        return [sys.executable, "-m", "quantize.methods.warmup"]

    def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (str(PACKAGE_ROOT), os.environ.get("PYTHONPATH", "")) if p)}
        self.proc = subprocess.Popen(self.command(), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        self.proc.stdin.write(json.dumps({"device": self.device, "launches": self.launches}))
        self.proc.stdin.close()
        self.reader = threading.Thread(target=self._read, name="triton-warmup", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            word, _, rest = line.strip().partition(" ")
            if word == "ready" and rest in self.ready:
                self.ready[rest].set()
            elif word == "failed":
                self.failed.append(rest)
            elif word == "done":
                self.compiled_s = float(rest)
        for e in self.ready.values():  # the process is gone: nothing more will come
            e.set()

    def wait(self, key: str) -> None:
        """Return once the side process has compiled the launches of `key`, has stopped, or the run has waited
        WAIT_BUDGET_S in all (then the process is stopped: the run compiles what is left itself)."""
        event = self.ready.get(key)
        if event is None or event.is_set():
            return
        t0 = time.perf_counter()
        if not event.wait(max(0.0, WAIT_BUDGET_S - self.waited)):
            log.warning("Triton warm-up: still compiling after %.0f s; the run compiles its kernels itself",
                        WAIT_BUDGET_S)
            self.stop()
        self.waited += time.perf_counter() - t0

    def stop(self) -> None:
        """End the side process: one that has released every key has only its `done` line left to write and is let
        finish (FINISH_S at most), so the run's log gives its seconds; one still compiling is killed."""
        if self.proc is not None and self.proc.poll() is None and all(e.is_set() for e in self.ready.values()):
            try:
                self.proc.wait(timeout=FINISH_S)
            except subprocess.TimeoutExpired:
                pass
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()
        if self.reader is not None:
            self.reader.join()
        for e in self.ready.values():
            e.set()


_ACTIVE: Warmup | None = None


def wait(module: str, group: int) -> None:
    """Before a launch of the Triton kernel in quantize.methods.<module>: wait for the side process's compile of
    it (at once after the first launch)."""
    if _ACTIVE is not None:
        _ACTIVE.wait(key(module, group))


def gpus_shared() -> bool:
    """Whether NVML reports every GPU in the default compute mode, where a second process may hold a context
    beside the run's. In an exclusive mode the first process to open the GPU keeps it, and the side process may
    come first; without NVML nothing is known. Either way the run does without the side process."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    if nvml.nvmlInit_v2() != 0:
        return False
    try:
        count, handle, mode = ctypes.c_uint(), ctypes.c_void_p(), ctypes.c_int()
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return False
        for i in range(count.value):
            if nvml.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(handle)) != 0 or \
                    nvml.nvmlDeviceGetComputeMode(handle, ctypes.byref(mode)) != 0 or mode.value != 0:
                return False  # 0: NVML_COMPUTEMODE_DEFAULT
        return count.value > 0
    finally:
        nvml.nvmlShutdown()


def usable() -> bool:
    """Whether a CUDA run here can use the side process: triton installed and compiling (not its CPU
    interpreter), and every GPU shared (`gpus_shared`)."""
    return os.environ.get("TRITON_INTERPRET") != "1" and \
        importlib.util.find_spec("triton") is not None and gpus_shared()


@contextmanager
def started(launches: list[dict], device: str = "cuda"):
    """Within: the side process compiles `launches` (`methods.launches.plan`; none: no process); at the end it is
    stopped if it is still running, and what it did is logged."""
    global _ACTIVE
    if not launches:
        yield None
        return
    w = Warmup(launches, device)
    try:
        w.start()
    except OSError as e:  # no process, or one gone before it read its launches: the run compiles as before
        log.debug("Triton warm-up: not started (%s)", e)
        w.stop()
        yield None
        return
    _ACTIVE = w
    try:
        yield w
    finally:
        _ACTIVE = None
        w.stop()
        log.info("Triton warm-up: %d launches in a side process%s; the pass waited %.2f s for it%s", len(launches),
                 f" ({w.compiled_s:.1f} s)" if w.compiled_s is not None else " (not finished)", w.waited,
                 f"; failed: {'; '.join(w.failed)}" if w.failed else "")


def run_launches(launches: list[dict], device: str = "cuda") -> None:
    """The side process's work: each launch in order; `ready KEY` once the last launch of KEY is done (or
    `failed KEY why`), `done SECONDS` at the end, one line each on stdout."""
    t0 = time.perf_counter()
    last = {key_of(x): i for i, x in enumerate(launches)}
    for i, launch in enumerate(launches):
        key = key_of(launch)
        try:
            module = importlib.import_module(f"quantize.methods.{launch['module']}")
            module.warm(launch, launch["rows"], launch["cols"], getattr(torch, launch["dtype"]), torch.device(device))
        except Exception as e:  # noqa: BLE001 - reported to the run, which compiles this one itself
            print(f"failed {key} {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", flush=True)
        if last[key] == i:
            print(f"ready {key}", flush=True)
    if device != "cpu":
        torch.cuda.synchronize()
    print(f"done {time.perf_counter() - t0:.3f}", flush=True)


if __name__ == "__main__":
    job = json.loads(sys.stdin.read())
    run_launches(job["launches"], job["device"])

"""Compile the GPTQ sweep's Triton kernel in a child process while this one starts up (CUDA hosts only).

On a machine whose Triton cache is empty the first GPTQ layer waits for the compile (H200, 7B shape: first
layer 2.6 s with the compile on the main thread, 4.0 s on the warm-up thread, 1.1 s with a warm cache). The
command line (`python -m quantize run|compare`) calls `spawn` before it imports torch; the child imports what it
needs (not transformers), makes the same small GPTQ calls as the warm-up (`warmup.sweeps`) and exits, leaving
the compiled kernel in Triton's on-disk cache, where the run finds it: importing torch and transformers takes
the parent several seconds, and the compile finishes within them. Measured (docs/BENCHMARKS.md, GPU path
settings): the run always found the kernel ready and loaded it, and the cold first layer took 1.6 s against 1.8 s
with the compile on the warm-up thread; most of its remaining one-time cost is elsewhere.

This module imports only the standard library: `spawn` must run before torch is imported. The child is
skipped where it could do harm or no good: no NVIDIA device node, `CUDA_VISIBLE_DEVICES` empty, a GPU in an
exclusive compute mode (a second process's context would make the run's fail), `QUANTIZE_PRECOMPILE=0`, or a
command other than run/compare. Whatever the child does, the run's result is the same: it only fills a cache.
"""

from __future__ import annotations

import atexit
import glob
import logging
import os
import subprocess
import sys
import tempfile
import time

log = logging.getLogger(__name__)

ENV = "QUANTIZE_PRECOMPILE"  # 0/false/no/off: never start the child; unset, empty, 1/true/yes/on: start it
OFF, ON = ("0", "false", "no", "off"), ("", "1", "true", "yes", "on")
COMMANDS = ("run", "compare")
WAIT_S = 120.0  # longest wait for the child before the run compiles the kernel itself

_child: subprocess.Popen | None = None
_stderr = None
_started = 0.0
# the last child's: exit code, seconds from its start to the end of `wait`, how long `wait` blocked, what it said
outcome: dict | None = None


def gpu_visible() -> bool:
    """An NVIDIA driver is present and CUDA_VISIBLE_DEVICES (when set) names a device; nothing is initialised."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    driver = bool(glob.glob("/dev/nvidia[0-9]*")) or os.path.exists("/dev/nvidiactl")
    return driver and (visible is None or visible.strip() not in ("", "-1"))


def spawn(argv: list[str]) -> subprocess.Popen | None:
    """Start the compile child for these command-line arguments (`sys.argv[1:]`) -> it, or None if skipped."""
    global _child, _stderr, _started
    if _child is not None or not argv or argv[0] not in COMMANDS:
        return None
    setting = os.environ.get(ENV, "1").strip().lower()
    if setting not in OFF + ON:
        print(f"error: {ENV}={os.environ[ENV]!r} is not understood; set it to 0 to turn the GPTQ kernel pre-compile "
              f"off, or to 1 (the default) to keep it", file=sys.stderr)
        raise SystemExit(2)
    if setting in OFF or not gpu_visible():
        return None
    _stderr = tempfile.TemporaryFile()
    _started = time.perf_counter()
    # the child imports this package from where the parent did (a source tree run from elsewhere included)
    home = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [home, os.environ.get("PYTHONPATH")])))
    _child = subprocess.Popen([sys.executable, "-m", "quantize.precompile", *argv], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=_stderr, env=env)
    atexit.register(_stop)  # a run that fails early does not leave the child compiling behind it
    return _child


def wait(timeout: float = WAIT_S) -> None:
    """Block until the child (if any) has exited, at most `timeout` s; log what it said if it failed."""
    global _child, _stderr, outcome
    child = _child
    if child is None:
        return
    t0 = time.perf_counter()
    try:
        rc = child.wait(timeout)
    except subprocess.TimeoutExpired:
        log.warning("the GPTQ kernel pre-compile is still running after %.0f s; the run compiles it itself", timeout)
        outcome = {"rc": None, "waited_s": round(time.perf_counter() - t0, 3), "said": "timed out"}
        _stop()
        return
    _stderr.seek(0)
    said = _stderr.read().decode(errors="replace").strip()[-2000:]
    outcome = {"rc": rc, "age_s": round(time.perf_counter() - _started, 3),
               "waited_s": round(time.perf_counter() - t0, 3), "said": said}
    if rc != 0:
        log.warning("the GPTQ kernel pre-compile failed (exit %d; the run compiles it itself): %s", rc, said)
    else:
        log.info("GPTQ kernel pre-compile: %s (child started %.1f s ago; waited %.2f s for it)",
                 said.splitlines()[-1] if said else "done", outcome["age_s"], outcome["waited_s"])
    _stderr.close()
    _child = _stderr = None


def _stop() -> None:
    global _child, _stderr
    if _child is not None and _child.poll() is None:
        _child.kill()
        _child.wait()
    if _stderr is not None:
        _stderr.close()
    _child = _stderr = None


def exclusive_compute() -> bool | None:
    """Whether any GPU of the host is in an exclusive compute mode (one context per device) -> None if unknown.
    (Any: nvidia-smi numbers devices physically, CUDA_VISIBLE_DEVICES may renumber them.)"""
    try:
        p = subprocess.run(["nvidia-smi", "--query-gpu=compute_mode", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    modes = p.stdout.lower().split()
    return None if p.returncode != 0 or not modes else any(m != "default" for m in modes)


def main(argv: list[str], allow_cpu: bool = False) -> int:
    """The child: the run's GPTQ specs from the same arguments, then the warm-up's sweep calls on its device.

    A recipe or device problem is the run's to report: the child says why it compiled nothing and exits 0.
    allow_cpu: run the calls on the CPU too (tests; Triton under its interpreter). Imports stop short of the
    runner (transformers): that would cost the child seconds it needs to finish first.
    """
    import torch

    from . import warmup
    from .cli import _parser
    from .engine import DTYPES, gptq_spec
    from .preflight import pick_device
    from .recipe import load_variants

    try:
        args = _parser().parse_args(argv)
        names = [args.recipe] if args.cmd == "run" else args.recipes
        recipes = [v for n in names for v in load_variants(n)]
        device = pick_device(recipes[0])  # the run's own choice
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the run reports these itself
        print(f"nothing compiled: {e}", file=sys.stderr)
        return 0
    specs = [gptq_spec(r, DTYPES[r.dtype]) for r in recipes if r.method == "gptq"]
    cuda = device.type == "cuda"
    if not specs or not (cuda or allow_cpu):
        print(f"nothing to compile ({len(specs)} GPTQ recipes, device {device})", file=sys.stderr)
        return 0
    if cuda and exclusive_compute() is not False:
        print("skipped: the GPU's compute mode is exclusive or unknown", file=sys.stderr)
        return 0
    t0 = time.perf_counter()
    warmup.sweeps(device, specs)
    if cuda:
        torch.cuda.synchronize(device)
    print(f"compiled the GPTQ sweep for {len(specs)} recipe(s) on {device} in {time.perf_counter() - t0:.2f} s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

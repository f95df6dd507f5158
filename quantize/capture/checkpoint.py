"""Per-layer checkpoints of a layer-by-layer pass, so a killed or crashed run resumes where it stopped.

A checkpoint directory (`<out_root>/.<name>.checkpoint/`) holds, for every finished layer, what each job
produced (codes, scales, zeros, the other tensors it changed, its stats) and, for the next layer, the inputs
the pass carries (the FP chain and each job's private chain). Each save writes new files under temporary
names, renames them, and only then rewrites `state.json`, the commit point: a kill at any moment leaves the
previous consistent state. A fingerprint of everything that determines the results (recipes, calibration
tokens, model, code version) guards resumption: a checkpoint of a different run is discarded, never mixed in.
Saves happen after a layer when `every_s` seconds have passed since the last one (0 = after every layer), so
fast GPU runs do not spend their time writing activations. Loads use torch.load(weights_only=True).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import pickle
import shutil
import time
from functools import partial
from pathlib import Path

import torch

from ..files import DiskFullError, atomic_write, atomic_write_text, disk_full_errno, human_bytes

log = logging.getLogger(__name__)

# What reading a damaged checkpoint raises: bad JSON, missing keys, a truncated or garbled torch file.
_UNREADABLE = (ValueError, KeyError, TypeError, OSError, EOFError, RuntimeError, pickle.UnpicklingError)

STATE = "state.json"


def fingerprint(parts: dict) -> str:
    """Everything that determines a run's results (JSON-serialisable) -> sha256 hex."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


class Checkpointer:
    """Saves and restores the state of `capture.run_shared` between layers."""

    def __init__(self, directory: Path, fingerprint: str, every_s: float):
        self.dir = Path(directory)
        self.fingerprint = fingerprint
        self.every_s = every_s
        self._last_save = time.monotonic()
        self._saved_upto = 0  # layers [0, _saved_upto) are in the checkpoint

    def resume(self, jobs) -> tuple[int, list | None, dict[int, list] | None]:
        """-> (first layer still to do, FP-chain inputs, private chains by job position); (0, None, None) if none."""
        state_path = self.dir / STATE
        if not state_path.is_file():
            return 0, None, None
        try:
            state = json.loads(state_path.read_text())
            if state.get("fingerprint") != self.fingerprint:
                log.warning("checkpoint %s belongs to a different run (recipe, calibration, model or code changed); "
                            "discarding it and starting from layer 1", self.dir)
                self.clear()
                return 0, None, None
            snapshots = [torch.load(self.dir / name, weights_only=True) for name in state["layer_files"]]
            carry = torch.load(self.dir / state["carry"], weights_only=True)
            start, inputs, chains = state["next_layer"], carry["inputs"], carry["chains"]
        except _UNREADABLE as e:  # everything is read before any job is touched
            log.warning("checkpoint %s cannot be read (%s: %s); discarding it and starting from layer 1", self.dir,
                        type(e).__name__, " ".join(str(e).split())[:200])
            self.clear()
            return 0, None, None
        for snaps in snapshots:
            for job, snap in zip(jobs, snaps):
                job.restore(snap)
        self._saved_upto = start
        log.info("resuming from checkpoint %s: layers 1-%d already done (saved %s)", self.dir, start,
                 state.get("saved_at"))
        return start, inputs, chains

    def due(self, index: int, n_layers: int) -> bool:
        """A save is due after layer `index` (never after the last: the export follows at once)."""
        return index + 1 < n_layers and time.monotonic() - self._last_save >= self.every_s

    def save(self, index: int, jobs, inputs: list, chains: dict[int, list]) -> None:
        """Save what the jobs produced for layers [_saved_upto, index] and the inputs carried to the next.

        A full disk stops the run (DiskFullError): the last complete checkpoint is kept for the rerun."""
        try:
            self._save_state(index, jobs, inputs, chains)
        except Exception as e:  # noqa: BLE001 - torch reports a full disk as a RuntimeError
            code = disk_full_errno(e)
            if code is None:
                raise
            what = "disk is full" if code == errno.ENOSPC else "disk quota is exceeded"
            free = human_bytes(shutil.disk_usage(self.dir).free)
            kept = f"layers 1-{self._saved_upto} stay saved" if self._saved_upto else "no layer was saved yet"
            raise DiskFullError(
                f"the {what} on {self.dir.parent.resolve()} while saving the resume checkpoint {self.dir} after layer "
                f"{index + 1} ({os.strerror(code)}; {free} free now); {kept}, and a rerun resumes from there. Free "
                f"space on that disk (or set checkpoint_every_s: null in the recipe to save none), then rerun") from e

    def _save_state(self, index: int, jobs, inputs: list, chains: dict[int, list]) -> None:
        t0 = time.perf_counter()
        self.dir.mkdir(parents=True, exist_ok=True)
        lo, hi = self._saved_upto, index + 1
        state_path = self.dir / STATE
        state = json.loads(state_path.read_text()) if state_path.is_file() else {"layer_files": []}
        layer_file = f"layers-{lo:05d}-{hi:05d}.pt"
        atomic_write(self.dir / layer_file, partial(torch.save, [job.snapshot(lo, hi) for job in jobs]))
        carry_file = f"carry-{hi:05d}.pt"
        atomic_write(self.dir / carry_file, partial(torch.save, {"inputs": inputs, "chains": chains}))
        old_carry = state.get("carry")
        state = {"fingerprint": self.fingerprint, "next_layer": hi, "layer_files": [*state["layer_files"], layer_file],
                 "carry": carry_file, "saved_at": time.strftime("%Y-%m-%d %H:%M:%S")}
        atomic_write_text(state_path, json.dumps(state, indent=1))  # the commit point
        if old_carry and old_carry != carry_file:
            (self.dir / old_carry).unlink(missing_ok=True)
        self._saved_upto = hi
        self._last_save = time.monotonic()
        log.info("checkpoint: layers 1-%d saved to %s in %.1f s", hi, self.dir, time.perf_counter() - t0)

    def clear(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

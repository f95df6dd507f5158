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

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

STATE = "state.json"


def fingerprint(parts: dict) -> str:
    """Everything that determines a run's results (JSON-serialisable) -> sha256 hex."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _save(obj, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(obj, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
        state = json.loads(state_path.read_text())
        if state.get("fingerprint") != self.fingerprint:
            log.warning("checkpoint %s belongs to a different run (recipe, calibration, model or code changed); "
                        "discarding it and starting from layer 1", self.dir)
            self.clear()
            return 0, None, None
        for name in state["layer_files"]:
            snaps = torch.load(self.dir / name, weights_only=True)
            for job, snap in zip(jobs, snaps):
                job.restore(snap)
        carry = torch.load(self.dir / state["carry"], weights_only=True)
        self._saved_upto = state["next_layer"]
        log.info("resuming from checkpoint %s: layers 1-%d already done (saved %s)", self.dir, state["next_layer"],
                 state["saved_at"])
        return state["next_layer"], carry["inputs"], carry["chains"]

    def due(self, index: int, n_layers: int) -> bool:
        """A save is due after layer `index` (never after the last: the export follows at once)."""
        return index + 1 < n_layers and time.monotonic() - self._last_save >= self.every_s

    def save(self, index: int, jobs, inputs: list, chains: dict[int, list]) -> None:
        """Save what the jobs produced for layers [_saved_upto, index] and the inputs carried to the next."""
        t0 = time.perf_counter()
        self.dir.mkdir(parents=True, exist_ok=True)
        lo, hi = self._saved_upto, index + 1
        state_path = self.dir / STATE
        state = json.loads(state_path.read_text()) if state_path.is_file() else {"layer_files": []}
        layer_file = f"layers-{lo:05d}-{hi:05d}.pt"
        _save([job.snapshot(lo, hi) for job in jobs], self.dir / layer_file)
        carry_file = f"carry-{hi:05d}.pt"
        _save({"inputs": inputs, "chains": chains}, self.dir / carry_file)
        old_carry = state.get("carry")
        state = {"fingerprint": self.fingerprint, "next_layer": hi, "layer_files": [*state["layer_files"], layer_file],
                 "carry": carry_file, "saved_at": time.strftime("%Y-%m-%d %H:%M:%S")}
        tmp = state_path.with_name(f".{STATE}.tmp")
        tmp.write_text(json.dumps(state, indent=1))
        os.replace(tmp, state_path)  # the commit point
        if old_carry and old_carry != carry_file:
            (self.dir / old_carry).unlink(missing_ok=True)
        self._saved_upto = hi
        self._last_save = time.monotonic()
        log.info("checkpoint: layers 1-%d saved to %s in %.1f s", hi, self.dir, time.perf_counter() - t0)

    def clear(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

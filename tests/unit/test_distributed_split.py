"""How work is split over ranks: contiguous shares of batches and rows, the greedy owner assignment, how another
rank's error is rebuilt, and which commands refuse torchrun. Nothing joins a process group here
(tests/integration/test_distributed.py runs real ranks)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from quantize.capture.distributed import DistributedError, Dist, _portable
from quantize.preflight.checks import PreflightError

ROOT = Path(__file__).resolve().parents[2]


def _dist(rank: int, world: int) -> Dist:
    return Dist(rank, world, rank, torch.device("cpu"))


def test_shares_cover_every_item_once_in_order():
    for n, world in [(16, 2), (5, 3), (2, 4), (0, 2)]:
        spans = [_dist(r, world).span(n) for r in range(world)]
        assert [i for s in spans for i in s] == list(range(n))
        assert max(map(len, spans)) - min(map(len, spans)) <= 1


def test_owners_balance_the_cost_and_agree_across_ranks():
    costs = [8.0, 1.0, 1.0, 4.0, 4.0, 2.0]
    owners = [[d.owner(c) for c in costs] for d in (_dist(0, 2), _dist(1, 2))]
    assert owners[0] == owners[1]  # every rank computes the same assignment without talking
    loads = [sum(c for c, o in zip(costs, owners[0]) if o == r) for r in (0, 1)]
    assert loads == [10.0, 10.0]


def test_another_ranks_error_keeps_its_class_and_names_the_rank():
    e = _portable(PreflightError("recipe asks for device: cuda"), 1)
    assert isinstance(e, PreflightError) and str(e) == "rank 1: recipe asks for device: cuda" and e.from_rank == 1

    class Odd(Exception):
        def __init__(self, a, b):
            super().__init__(a, b)
    e = _portable(Odd("x", "y"), 2)
    assert isinstance(e, DistributedError) and str(e).startswith("rank 2: ") and "Odd" in str(e)


def test_only_run_is_spread_over_ranks():
    """In a process torchrun started, another command is refused; the worker leaves through `distributed.leave`,
    so its exit code and its flushed message are what the launcher sees."""
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "0", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    p = subprocess.run([sys.executable, "-m", "pipeline", "list"], env=env, capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip() == ("error: `list` runs in one process; only `run` is spread over ranks: "
                                "start it without torchrun")

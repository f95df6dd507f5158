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


class _Store:
    """The launcher's key-value store as `explain` uses it; `interrupt_on` checks raise a stop request first."""

    def __init__(self, published: str | None, interrupt_on: int = 0):
        self.published, self.calls, self.interrupt_on = published, 0, interrupt_on
        self.set_to: str | None = None

    def check(self, keys):
        self.calls += 1
        if self.calls <= self.interrupt_on:
            raise KeyboardInterrupt("SIGTERM")
        return self.published is not None

    def get(self, key):
        return self.published.encode()

    def set(self, key, value):
        self.set_to = value


def _explain_with(store: _Store, e: BaseException, monkeypatch) -> BaseException:
    import signal

    from quantize.capture import distributed

    monkeypatch.setattr(distributed, "_store", lambda: store)
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            out = _dist(0, 2).explain(e)
        except KeyboardInterrupt:
            raise AssertionError("a stop request during the lookup replaced the message") from None
        # the rank is stopping: the launcher's SIGTERM now changes nothing
        assert all(signal.getsignal(s) is signal.SIG_IGN for s in saved)
        os.kill(os.getpid(), signal.SIGTERM)
        return out
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def test_torchruns_sigterm_during_the_lookup_keeps_the_failing_ranks_message(monkeypatch):
    """Rank 1 fails and exits; rank 0 sees the connection close and looks up rank 1's message while torchrun's
    SIGTERM arrives: rank 0 still stops with rank 1's message, not as interrupted."""
    store = _Store("rank 1: decoder layer 2: injected failure", interrupt_on=1)
    out = _explain_with(store, RuntimeError("Connection closed by peer"), monkeypatch)
    assert isinstance(out, DistributedError) and str(out) == "rank 1: decoder layer 2: injected failure"
    assert out.from_rank == 1 and store.calls == 2


def test_a_ranks_own_error_is_published_for_the_others(monkeypatch):
    store = _Store(None)
    e = ValueError("bad input")
    assert _explain_with(store, e, monkeypatch) is e
    assert store.set_to == "rank 0: bad input"

"""Quantizing with several processes launched by torchrun: one per GPU (NCCL), or CPU workers (gloo).

Data parallel: the calibration batches are split into contiguous shares, one per rank; each rank runs a layer on
its share only. What the methods need whole travels in batch order, so every rank sees the tensors one process
would see (`gather`); GPTQ's Hessians are sums of per-rank partial sums XᵀX with their token counts (`all_sum`).
Weight parallel: each unit of work (an AWQ scale group, a linear's clip and rounding, a slice of a GPTQ problem's
rows) is computed once, by its owner (`owner`: least loaded so far by cost, ties to the lowest rank, the same
answer on every rank), and broadcast (`share`).

Failures: every broadcast carries its sender's status first. A sender whose work raised sends the exception
instead of the data, and every rank raises it with the sender's rank in its message: all ranks stop with the
failing rank's message, and none waits for data that will not come. Phases that every rank runs on its own
(pre-flight, loading) end in `agree`: an all-gathered status, so a failure on one rank stops all. An error
raised anywhere else is published in the launcher's key-value store before its rank exits (`explain`); the
others then fail in their next collective (the peer's connections close) or are stopped by torchrun, and each
stops with the published message instead of its own. The process group has a timeout (QUANTIZE_DIST_TIMEOUT_S)
for what none of this covers (a rank that hangs).
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from ..errors import UserError

log = logging.getLogger(__name__)

TIMEOUT_ENV = "QUANTIZE_DIST_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 1800  # a rank waits this long for a peer (a 72B layer's work takes seconds, not minutes)


class DistributedError(UserError, RuntimeError):
    """Another rank failed; the message is that rank's (prefixed by its number)."""


FAILURE_KEY = "quantize/failure"  # in the launcher's store: the first failing rank's message
FAILURE_WAIT_S = 10.0  # how long a rank whose peer vanished waits for that peer's message


def world_size() -> int:
    """The number of ranks torchrun started (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclass
class Failed:
    """The exception a unit of work raised on this rank, kept until it is this rank's turn to send."""

    error: BaseException


@dataclass
class _Tensor:
    """Where a tensor sits in a value sent by `share`: its shape, dtype and whether it lives on the CPU."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    cpu: bool


@dataclass
class Dist:
    """This process's place among the ranks. device: the compute device (cuda:LOCAL_RANK, or the CPU)."""

    rank: int
    world: int
    local_rank: int
    device: torch.device
    loads: list[float] = field(default_factory=list)  # cost owned so far, per rank (`owner`)

    def __post_init__(self):
        self.loads = self.loads or [0.0] * self.world

    # ---- the split of work

    def span(self, n: int) -> range:
        """This rank's share of n items (calibration batches, rows): contiguous, sizes differing by at most one."""
        return range(n * self.rank // self.world, n * (self.rank + 1) // self.world)

    def owner(self, cost: float) -> int:
        """The rank that computes a unit of work of this cost: the least loaded so far (greedy balancing; every rank
        makes the same calls in the same order, so all agree without talking)."""
        r = min(range(self.world), key=lambda i: (self.loads[i], i))
        self.loads[r] += cost
        return r

    # ---- moving results

    def attempt(self, fn: Callable[[], Any]) -> Any:
        """fn() -> its value, or Failed(exception) to be sent at this rank's turn (see `share`)."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - every rank must learn of it, whatever it is
            return Failed(e)

    def share(self, src: int, value: Any = None) -> Any:
        """value on rank src (tensors inside lists, tuples and dicts, and plain data) -> the same on every rank.

        Tensors arrive on the device they left from (the receiver's own cuda:LOCAL_RANK, or the CPU), bit for bit.
        A Failed value is raised on every rank instead.
        """
        tensors: list[torch.Tensor] = []
        if self.rank == src:
            header = ("failed", _portable(value.error, src)) if isinstance(value, Failed) else \
                ("ok", _skeleton(value, tensors))
        else:
            header = None
        box = [header]
        dist.broadcast_object_list(box, src=src, device=torch.device("cpu"))
        kind, body = box[0]
        if kind == "failed":
            if self.rank == src:
                raise value.error
            raise body
        metas: list[_Tensor] = []
        _collect(body, metas)
        received = []
        for meta in sorted(metas, key=lambda m: m.index):
            received.append(self._broadcast_tensor(src, tensors[meta.index] if self.rank == src else None, meta))
        return _fill(body, received)

    def _broadcast_tensor(self, src: int, t: torch.Tensor | None, meta: _Tensor) -> torch.Tensor:
        """Bytes, not values: every dtype travels (gloo has no bfloat16 sum, but any bytes broadcast)."""
        dev = torch.device("cpu") if meta.cpu else self.device
        nbytes = int(torch.Size(meta.shape).numel()) * torch.empty((), dtype=meta.dtype).element_size()
        if self.rank == src:
            buf = t.detach().contiguous().reshape(-1).view(torch.uint8).to(dev)
        else:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        if nbytes:
            dist.broadcast(buf, src=src)
        return buf.view(meta.dtype).reshape(meta.shape) if self.rank != src else t

    def spread(self, fn: Callable[[list], list], items: list, chunk: int = 1) -> list:
        """fn(items) computed in shares: the items cut into chunks of `chunk`, each rank calling fn on a contiguous
        run of whole chunks -> every result, in order, on every rank. fn must map each item on its own (the
        same result whatever else is in its call), as AWQ's per-candidate losses do."""
        share = self.span(-(-len(items) // chunk))
        mine = self.attempt(lambda: fn(items[share.start * chunk : share.stop * chunk]) if len(share) else [])
        return [x for part in self.gather(mine) for x in part]

    def gather(self, local: Any) -> list[Any]:
        """Every rank's value (this one's `local`, possibly Failed) -> the list of all ranks' values, in rank order."""
        return [self.share(r, local if r == self.rank else None) for r in range(self.world)]

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        """The element-wise sum over ranks, in place, the same bits on every rank (two ranks: one addition, which
        commutes; more: NCCL and gloo add in an order fixed by the group, not by timing)."""
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def agree(self, fn: Callable[[], Any]) -> Any:
        """fn() run on every rank; when it raised on any, every rank raises the first failing rank's error."""
        out = self.attempt(fn)
        mine = ("failed", _portable(out.error, self.rank)) if isinstance(out, Failed) else ("ok", None)
        statuses: list = [None] * self.world
        dist.all_gather_object(statuses, mine)
        for r, (kind, err) in enumerate(statuses):
            if kind == "failed":
                if r == self.rank:
                    raise out.error
                raise err
        return out

    def explain(self, e: BaseException) -> BaseException:
        """The error this rank stops with, given the one it caught: another rank's published message when that
        rank failed first (what this rank caught is then a consequence: a closed connection, torchrun's SIGTERM);
        else e itself, published for the others.

        From here on this rank is stopping: a stop request that arrives now (torchrun sends SIGTERM to every rank
        once one has exited, often just after the closed connection that brought this rank here) is the same
        cause arriving twice, and must not replace the message being looked up, nor the one printed after."""
        while True:
            try:
                _ignore_stop_requests()
                return self._explain(e)
            except KeyboardInterrupt:  # a stop request delivered before the handlers were replaced
                continue

    def _explain(self, e: BaseException) -> BaseException:
        if getattr(e, "from_rank", None) is not None:  # every rank raised it together (`share`, `agree`)
            return e
        store = _store()
        if store is None:
            return e
        consequence = isinstance(e, (KeyboardInterrupt, dist.DistBackendError)) or \
            any(w in str(e).lower() for w in ("connection closed", "connection reset", "broken pipe", "timed out"))
        deadline = time.monotonic() + (FAILURE_WAIT_S if consequence else 0.0)
        while True:
            if store.check([FAILURE_KEY]):
                msg = store.get(FAILURE_KEY).decode()
                if not msg.startswith(f"rank {self.rank}:"):
                    err = DistributedError(msg)
                    err.from_rank = int(msg.split(":", 1)[0].removeprefix("rank "))
                    return err
                return e
            if time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        if not consequence:
            store.set(FAILURE_KEY, f"rank {self.rank}: {e}")
        return e


def _ignore_stop_requests() -> None:
    """SIGINT and SIGTERM ignored from now until the process ends (the command line restores its own handlers
    just before the worker exits through `leave`)."""
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_IGN)


def _store():
    """The process group's key-value store (torchrun's), or None when there is none to reach."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def _portable(e: BaseException, rank: int) -> BaseException:
    """e as the other ranks raise it: its own class with the message prefixed by the rank, when that class can be
    rebuilt from a message (every user error of ours can), else DistributedError."""
    msg = f"rank {rank}: {e}"
    try:
        out = type(e)(msg)
        if str(out) != msg:
            out = DistributedError(f"{msg} ({type(e).__name__})")
    except Exception:  # noqa: BLE001 - a class that needs other arguments
        out = DistributedError(f"{msg} ({type(e).__name__})")
    out.from_rank = rank
    return out


def _skeleton(value: Any, tensors: list[torch.Tensor]) -> Any:
    """value with every tensor replaced by a _Tensor placeholder (the tensors appended to `tensors`)."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return _Tensor(len(tensors) - 1, tuple(value.shape), value.dtype, value.device.type == "cpu")
    if isinstance(value, (list, tuple)):
        return type(value)(_skeleton(v, tensors) for v in value)
    if isinstance(value, dict):
        return {k: _skeleton(v, tensors) for k, v in value.items()}
    return value


def _collect(body: Any, out: list[_Tensor]) -> None:
    if isinstance(body, _Tensor):
        out.append(body)
    elif isinstance(body, (list, tuple)):
        for v in body:
            _collect(v, out)
    elif isinstance(body, dict):
        for v in body.values():
            _collect(v, out)


def _fill(body: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(body, _Tensor):
        return tensors[body.index]
    if isinstance(body, (list, tuple)):
        return type(body)(_fill(v, tensors) for v in body)
    if isinstance(body, dict):
        return {k: _fill(v, tensors) for k, v in body.items()}
    return body


def init_from_env() -> Dist | None:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) -> Dist; None for
    a single process (the one-process path stays exactly as it is). gloo carries CPU tensors, NCCL CUDA ones when
    CUDA is visible; each rank computes on cuda:LOCAL_RANK."""
    world = world_size()
    if world <= 1:
        return None
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    if cuda:
        if local >= torch.cuda.device_count():
            raise DistributedError(f"rank {rank}: LOCAL_RANK {local} but only {torch.cuda.device_count()} CUDA devices "
                                   f"are visible; start at most that many processes per node (--nproc-per-node, GPUS=)")
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)))
        dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", timeout=timeout)
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    log.info("rank %d of %d (local rank %d) on %s", rank, world, local, device)
    return Dist(rank, world, local, device)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def leave(code: int) -> NoReturn:
    """End a torchrun worker with `code`, skipping Python's finalization. gloo's worker threads drop each finished
    operation's tensors a moment after the caller has seen it complete, taking the GIL to do so; when that moment
    falls into the interpreter's finalization the thread is killed mid-unwind and the process aborts (SIGABRT
    after a complete run, so torchrun reports a failure and the other node's launcher waits on it; docs/DISTRIBUTED.md
    has the measurement). Every file the run wrote is closed by now; the logs are flushed here."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

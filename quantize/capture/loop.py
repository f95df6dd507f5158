"""Layer-by-layer calibration loop. Knows decoder layers and linears; knows nothing about AWQ or GPTQ.

The model stays on the CPU. Only the embeddings (to make the first layer's inputs) and then one decoder
layer at a time move to the compute device, so a model far larger than the accelerator's memory only
needs one layer plus the calibration activations there.

This module is the pass: what each job is handed per layer (`LayerData`), the chains of inputs carried from
layer to layer, the switch to float32 where half precision overflows, checkpoints. Running a layer and catching
its linears' inputs is `forward.py`'s.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn as nn
from ..errors import UserError
from ..source.arch import Arch, decoder_layers
from .device import Uploader, clock, release_cache
from .forward import first_layer_inputs, forward_with_features
from .replay import OutputReplay
from .distributed import Dist
from ..progress import Progress
from ..runlog import RunLog

log = logging.getLogger(__name__)


@dataclass
class LayerData:
    """What an algorithm gets for one decoder layer."""

    index: int
    layer: nn.Module  # on the compute device, in the compute dtype
    inputs: list[torch.Tensor]  # per batch: [b, seq, hidden], the layer's inputs
    kwargs: list[dict]  # per batch: keyword arguments the layer is called with (positions, mask)
    features: dict[str, torch.Tensor] = field(default_factory=dict)  # linear name -> its input [tokens, in]
    # for a job with its own chain that asks for them (`LayerJob.wants_fp_features`): the inputs the same linears
    # see in the unquantized model on the FP model's layer inputs, rows in the order of `features`' batches
    fp_features: dict[str, torch.Tensor] = field(default_factory=dict)
    # for a job with its own chain that asks for them (`LayerJob.wants_fp_outputs`): per batch, what this layer
    # outputs in the unquantized model on the FP model's inputs [b, seq, hidden]; read-only (the next layer's
    # FP inputs)
    fp_outputs: list[torch.Tensor] = field(default_factory=list)
    # what a job computed from the unmodified layer and the FP inputs alone, kept for the other jobs of the layer
    # that see the same (propagate "fp"): name -> value, the name holding everything else the value depends on.
    # None where no other job will ask (one job, or a job with its own chain): nothing is kept.
    shared: dict | None = None
    # for a job with its own chain: the job declares linears finished (`OutputReplay.freeze`) and their outputs are
    # computed once per batch for its later forwards of this layer and the chain's; None for other jobs
    replay: OutputReplay | None = None


def _map(obj, fn):
    """fn applied to every tensor inside obj (tensor / tuple / list / dict); everything else unchanged."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_map(o, fn) for o in obj)
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    return obj


def _to(obj, device):
    return _map(obj, lambda t: t.to(device))


class LayerJob(Protocol):
    """One recipe's work in a shared layer-by-layer pass (see `run_shared`).

    propagate: "fp" - this layer's inputs are the FP model's (shared by every such job);
    "quantized" - the outputs of the previous layer as this job left it (a private chain);
    "none" - needs no calibration inputs at all (round-to-nearest).
    wants_fp_features: a "quantized" job that also needs what its linears would see in the unquantized model
    (GPTQ with an FP target): the FP forward runs for it and `LayerData.fp_features` holds those inputs.
    wants_fp_outputs: a "quantized" job that needs the unquantized layer's outputs (SignRound's target): the FP
    forward runs for it and `LayerData.fp_outputs` holds them.
    """

    propagate: str
    wants_features: bool
    wants_fp_features: bool
    wants_fp_outputs: bool
    seconds: float

    def process(self, data: LayerData) -> None: ...

    def keep(self, index: int, layer: nn.Module) -> None: ...


class NumericalError(UserError, FloatingPointError):
    """NaN/inf that upcasting cannot cure; the message names the layer and the cause."""


def _cast(obj, dtype: torch.dtype, memo: dict | None = None):
    """Floating tensors inside obj (tensor / tuple / list / dict) -> dtype; everything else unchanged.
    memo: tensor id -> its cast, so a tensor held in several places is cast once and stays shared."""
    memo = {} if memo is None else memo

    def cast(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in memo:
            memo[id(t)] = (t, t.to(dtype) if t.is_floating_point() else t)  # t kept: its id stays unique
        return memo[id(t)][1]

    return _map(obj, cast)


def _finite(tensors) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def run_shared(
    model: nn.Module,
    arch: Arch,
    samples: torch.Tensor | None,
    device: torch.device,
    compute_dtype: torch.dtype,
    batch_size: int,
    feature_names: list[str],
    jobs: Sequence[LayerJob],
    checkpointer=None,
    runlog: RunLog | None = None,
    dist: Dist | None = None,
) -> tuple[list[str], dict[str, float]]:
    """One pass over the decoder layers serving several jobs (recipes) that share a model and calibration.

    Each layer moves to `device` once. The FP forward (layer outputs and linear inputs) is computed once for
    every job that propagates "fp" or wants the FP linear inputs or outputs; a job with a private chain gets its
    own inputs. With one job the layer is processed in place; with several, each job works on its own copy, so
    every job sees the unmodified layer and computes exactly what it would compute alone. `job.keep(i, layer)`
    receives the layer as the job left it.
    checkpointer: a `checkpoint.Checkpointer`; the pass resumes after its last saved layer and saves as it goes.
    runlog: receives each layer's seconds and the parts of them (`runlog.LayerRecord`).
    dist: several ranks (`distributed.Dist`): each layer's forwards run on this rank's share of the batches and
    their outputs (and the linears' inputs) are gathered in batch order, so every job sees what one process sees.
    NaN/inf: a layer with non-finite weights stops the run naming it; activations that overflow in half
    precision (Qwen in fp16) switch the pass to float32 from that layer on.
    -> (notes saying where that happened, seconds per part of the pass summed over layers)
    """
    layers = decoder_layers(model, arch)
    p = _SharedPass(arch, device, compute_dtype, feature_names, jobs, Uploader(layers, device), runlog, dist)
    start_at = 0
    if any(j.propagate != "none" for j in jobs):
        p.inputs, p.layer_kwargs = first_layer_inputs(model, arch, samples, device, compute_dtype, batch_size)
        p.chains = {n: p.inputs for n, j in enumerate(jobs) if j.propagate == "quantized"}  # by position in jobs
        if not _finite(p.inputs):
            raise NumericalError("the embeddings give NaN/inf for the calibration tokens: the checkpoint's "
                                 "embedding weights are damaged")
    if checkpointer is not None:
        start_at, saved_inputs, saved_chains = checkpointer.resume(jobs)
        if start_at:
            p.restore(saved_inputs, saved_chains)
    start = time.perf_counter()
    try:
        _layers(p, layers, start_at, start, checkpointer, jobs, device)
    finally:
        p.uploader.close()
    seconds = {k: round(v, 3) for k, v in p.seconds.items()}
    log.info("pass seconds: %s", seconds)
    if p.uploader.released:
        log.info("unmapped %.2f GB of the checkpoint's host pages once their layers were on %s",
                 p.uploader.released / 1e9, device)
    return p.notes, seconds


def _layers(p: "_SharedPass", layers, start_at: int, start: float, checkpointer, jobs, device) -> None:
    p.uploader.request(start_at, p.dtype)
    progress = Progress(len(layers), "quantize", log, "layer", start=start_at)
    for i in range(start_at, len(layers)):
        t0 = time.perf_counter()
        p.layer(i)
        done, total = i + 1, len(layers)
        eta = (time.perf_counter() - start) / (done - start_at) * (total - done)
        seconds = time.perf_counter() - t0
        progress.step(f"layer {done}/{total} done in {seconds:.1f} s (eta {eta:.0f} s)", f"{seconds:.1f} s/layer")
        if p.runlog is not None:
            p.runlog.layer(i).seconds = round(seconds, 4)
        if checkpointer is not None and checkpointer.due(i, total):
            t1 = time.perf_counter()
            checkpointer.save(i, jobs, _to(p.inputs, "cpu"), {n: _to(c, "cpu") for n, c in p.chains.items()})
            p.seconds["checkpoint"] += time.perf_counter() - t1  # every job's codes so far: grows with the variants
        if device.type == "cuda":
            release_cache(device, reused=p.replayed)
    progress.close()


class _SharedPass:
    """The state `run_shared` carries from layer to layer: FP-chain inputs, private chains, the compute dtype."""

    def __init__(self, arch: Arch, device: torch.device, dtype: torch.dtype, feature_names: list[str], jobs,
                 uploader: Uploader, runlog: RunLog | None = None, dist: Dist | None = None):
        self.arch, self.device, self.dtype, self.names, self.jobs = arch, device, dtype, feature_names, jobs
        self.uploader, self.runlog, self.dist = uploader, runlog, dist
        self.inputs: list[torch.Tensor] = []
        self.index = 0  # the layer being worked on
        self.layer_kwargs: list[list[dict]] = []  # per layer, per batch
        self.kwargs: list[dict] = []  # the current layer's
        self.chains: dict[int, list[torch.Tensor]] = {}
        self.replayed = 0  # the most bytes one job's replay kept in the last layer (the next asks for the same)
        self.notes: list[str] = []
        self.seconds = {"to_device": 0.0, "fp_forward": 0.0, "jobs": 0.0, "checkpoint": 0.0}  # summed over layers

    def restore(self, inputs: list, chains: dict) -> None:
        """Carry state from a checkpoint (in float32 if the saved pass had been upcast)."""
        self.inputs = _to(inputs, self.device) if self.inputs else self.inputs
        self.chains = {int(n): _to(c, self.device) for n, c in chains.items()}
        saved = next(iter([*self.inputs, *(c[0] for c in self.chains.values())]), None)
        if saved is not None and saved.dtype != self.dtype:
            self._upcast(None)

    def _upcast(self, why: str | None) -> None:
        """Continue the pass in float32: inputs, chains and layer kwargs (rotary tables, masks) are cast."""
        if why is not None:
            if self.dtype == torch.float32:
                raise NumericalError(f"{why} even in float32: the source weights or the calibration text produce "
                                     f"non-finite values; check the checkpoint (e.g. for NaN weights)")
            log.warning("%s in %s; continuing in float32 from here (half-precision overflow, as Qwen in fp16 "
                        "shows)", why, str(self.dtype).removeprefix("torch."))
            self.notes.append(f"{why} in {str(self.dtype).removeprefix('torch.')}: pass continued in float32")
        self.dtype = torch.float32
        self.inputs = _cast(self.inputs, torch.float32)
        self.layer_kwargs = _cast(self.layer_kwargs, torch.float32, {})  # shared tensors stay shared
        if self.layer_kwargs:
            self.kwargs = self.layer_kwargs[self.index]
        self.chains = {n: _cast(c, torch.float32) for n, c in self.chains.items()}

    def _check_weights(self, i: int, layer: nn.Module) -> None:
        params = list(layer.named_parameters())
        finite = torch.stack([torch.isfinite(t).all() for _, t in params]).tolist() if params else []
        bad = [n for (n, _), ok in zip(params, finite) if not ok]  # one read back to the host, not one per tensor
        if bad:
            raise NumericalError(f"decoder layer {i + 1}: {', '.join(bad)} contain NaN/inf in the source "
                                 f"checkpoint; it cannot be quantized (re-export or repair the model)")

    def _finite_run(self, why: str, module: nn.Module, run: Callable[[], object], tensors: Callable) -> object:
        """run() -> its result; when tensors(result) hold NaN/inf, continue the pass in float32 (inputs, chains,
        kwargs and `module`) and run again; a second failure raises NumericalError naming `why`."""
        result = run()
        if not _finite(tensors(result)):
            self._upcast(why)
            module.to(self.device, torch.float32)
            result = run()
            if not _finite(tensors(result)):
                self._upcast(why)  # raises: already float32
        return result

    def _fp_forward(self, i: int, layer: nn.Module, names: list[str]):
        return self._finite_run(f"decoder layer {i + 1}: NaN/inf in its activations", layer,
                                lambda: self._forward(layer, self.inputs, names),
                                lambda r: [*r[0], *r[1].values()])

    def layer(self, i: int) -> None:
        """Get layer i's device copy, serve every job, drop the copy; advance the chains."""
        t0 = self._clock()
        self.index = i
        self.kwargs = self.layer_kwargs[i] if self.layer_kwargs else []
        layer = self.uploader.get(i, self.dtype)  # a device copy: the model's own layer stays where it is
        self.uploader.request(i + 1, self.dtype)
        self._check_weights(i, layer)  # on the device: a pass over the weights there is cheap
        t1 = self._clock()
        self.seconds["to_device"] += t1 - t0
        jobs = self.jobs
        fp_jobs = [j for j in jobs if j.propagate == "fp"]
        # the jobs that read the FP forward's linear inputs; each but the last gets its own copy
        fp_users = [n for n, j in enumerate(jobs) if (j.wants_features and j.propagate == "fp") or j.wants_fp_features]
        fp_outs, fp_feats, fp_shared = None, {}, {}
        if fp_jobs or fp_users or any(j.wants_fp_outputs for j in jobs):
            fp_outs, fp_feats = self._fp_forward(i, layer, self.names if fp_users else [])
        t2 = self._clock()
        self.seconds["fp_forward"] += t2 - t1
        self.replayed = 0
        for n, job in enumerate(jobs):
            tj = time.perf_counter()
            if next(layer.parameters()).dtype != self.dtype:  # an earlier job's chain upcast the pass
                layer.to(self.device, self.dtype)
            feats: dict[str, torch.Tensor] = {}
            fp_ref: dict[str, torch.Tensor] = {}
            if n in fp_users:
                mine = fp_feats if n == fp_users[-1] else {k: t.clone() for k, t in fp_feats.items()}
                if job.propagate == "fp":
                    feats = mine
                else:
                    fp_ref = mine
            if job.wants_features and job.propagate != "fp":
                _, feats = self._forward(layer, self.chains[n], self.names)
            work = layer if len(jobs) == 1 else copy.deepcopy(layer)
            replay = OutputReplay(work) if job.propagate == "quantized" else None
            job.process(LayerData(i, work, self.chains.get(n, self.inputs), self.kwargs, feats,
                                  shared=fp_shared if job.propagate == "fp" and len(fp_jobs) > 1 else None,
                                  fp_features=fp_ref, fp_outputs=fp_outs if job.wants_fp_outputs else [],
                                  replay=replay))
            del feats, fp_ref
            if job.propagate == "quantized":
                try:
                    self._advance_chain(i, n, work)
                finally:
                    replay.close()
                self.replayed = max(self.replayed, replay.peak)
            job.keep(i, work)
            del work
            job.seconds += time.perf_counter() - tj
        del fp_feats, fp_shared
        t3 = self._clock()
        self.seconds["jobs"] += t3 - t2
        log.debug("layer %d parts: to_device %.4f s, fp_forward %.4f s, jobs %.4f s", i + 1, t1 - t0, t2 - t1,
                  t3 - t2)
        if self.runlog is not None:
            self.runlog.layer(i).parts = {"to_device": round(t1 - t0, 4), "fp_forward": round(t2 - t1, 4),
                                          "jobs": round(t3 - t2, 4)}
        del layer  # results and overrides hold what the jobs made of it; nothing is copied back
        if fp_outs is not None:
            self.inputs = fp_outs

    def _clock(self) -> float:
        return clock(self.device)

    def _forward(self, layer: nn.Module, inputs: list[torch.Tensor], names: list[str]):
        """`forward_with_features` over every batch; with several ranks each runs its share and the results are
        gathered in batch order (the same tensors, bit for bit: each batch is computed alone either way)."""
        if self.dist is None:
            return forward_with_features(layer, inputs, self.kwargs, names)
        mine = self.dist.span(len(inputs))
        local = self.dist.attempt(lambda: forward_with_features(layer, inputs[mine.start : mine.stop],
                                                                self.kwargs[mine.start : mine.stop], names)
                                  if len(mine) else ([], {}))  # more ranks than batches: some have none
        parts = self.dist.gather(local)
        outs = [o for outs_r, _ in parts for o in outs_r]
        feats = {n: torch.cat([f[n] for _, f in parts if f]) for n in names}
        return outs, feats

    def _advance_chain(self, i: int, n: int, work: nn.Module) -> None:
        self.chains[n] = self._finite_run(f"decoder layer {i + 1} (quantized, job {n + 1}): NaN/inf in its outputs",
                                          work, lambda: self._forward(work, self.chains[n], [])[0],
                                          lambda outs: outs)

"""Which kernel a method's layer job runs: torch's or a Triton kernel's, from the recipe's `advanced` settings and
the device (the launches that compile them ahead are `launches.plan`'s)."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable

import torch

from . import warmup
from . import awq_grid, awq_search, gptq_sweep as sweeps
from .awq_search import FakeQuant
from .gptq_sweep import Sweep
from ..errors import UserError


class KernelUnavailable(UserError, RuntimeError):
    """A kernel the recipe asks for cannot run here; the message names the setting to change."""


def check_kernels(recipe, device: torch.device) -> None:
    """Pre-flight: a kernel the recipe asks for by name (`triton`) runs on `device`, else KernelUnavailable naming
    the setting, before any weight is loaded (the layer loop would find out only at its first layer)."""
    adv = recipe.advanced
    for setting, choose in ((adv.gptq.kernel, gptq_sweep), (adv.awq.clip_kernel, awq_clip),
                            (adv.awq.search_kernel, awq_fake_quant)):
        if setting == "triton":
            choose("triton", device)


def gptq_sweep(kernel: str, device: torch.device) -> Sweep:
    """The GPTQ column sweep for `kernel` (auto | torch | triton) on `device`: auto = the Triton kernel on CUDA
    when triton imports, else torch's. Both give the same codes; Triton's is the fast one on a GPU."""
    module = _triton_module("gptq_triton", kernel, device, "advanced.gptq.kernel")
    if module is None:
        return sweeps.TORCH_SWEEP

    def sweep(W, W0, A, t, scales, zeros, gidx, g, spec):
        warmup.wait("gptq_triton", spec.group)  # a side process may be compiling it (`warmup`)
        return module.sweep_triton(W, W0, A, t, scales, zeros, gidx, g, spec)
    return Sweep("triton", sweep)


def awq_clip(kernel: str, device: torch.device) -> Callable:
    """AWQ's clip search for `kernel` (auto | torch | triton) on `device`, with `awq_grid.search_clip`'s
    signature: auto = the Triton kernel (`methods.awq_clip_triton`) on CUDA when triton imports, else torch's.
    The kernel takes power-of-two groups of 16 to 128 columns; other weights go to torch's search."""
    module = _triton_module("awq_clip_triton", kernel, device, "advanced.awq.clip_kernel")
    if module is None:
        return awq_grid.search_clip

    def search(w, gram, spec, n_grid=20, max_shrink=0.5, per_side=False):
        if module.supports(w, spec.group):
            warmup.wait("awq_clip_triton", spec.group)
            return module.search_clip_triton(w, gram, spec, n_grid, max_shrink, per_side)
        return awq_grid.search_clip(w, gram, spec, n_grid, max_shrink, per_side)
    return search


def awq_fake_quant(kernel: str, device: torch.device) -> FakeQuant:
    """How AWQ's scale search fake-quantizes its candidates for `kernel` (auto | torch | triton) on `device`: auto =
    the Triton kernel (`methods.awq_fq_triton`, the torch function's values bit for bit) on CUDA when triton
    imports, else torch's. The kernel takes power-of-two groups of 16 to 128 columns; other weights go to torch."""
    module = _triton_module("awq_fq_triton", kernel, device, "advanced.awq.search_kernel")
    if module is None:
        return awq_search.TORCH_FQ

    def candidate(w, s, spec):
        if module.supports(w, spec.group):
            warmup.wait("awq_fq_triton", spec.group)
            return module.scaled_fake_quant_triton(w, s, spec)
        return awq_search.TORCH_FQ.candidate(w, s, spec)

    def delta(w, s, spec, out):
        if module.supports(w, spec.group) and out.stride(1) == 1:
            warmup.wait("awq_fq_triton", spec.group)
            return module.scaled_fake_quant_triton(w, s, spec, delta=True, out=out)
        return awq_search.TORCH_FQ.delta(w, s, spec, out)
    return FakeQuant("triton", candidate, delta)


def awq_search_dtype(setting: str, device: torch.device, compute_dtype: torch.dtype) -> torch.dtype | None:
    """The dtype AWQ's scale search runs its inspected blocks' forwards in (under torch.autocast), or None for the
    compute dtype itself. setting (`advanced.awq.search_dtype`): compute -> None; bfloat16 -> bfloat16 unless the
    compute dtype is bfloat16 already; auto -> bfloat16 where the compute dtype is float32 on a CPU with AMX tiles,
    whose bf16 matmuls run several times faster than its float32 ones (docs/BENCHMARKS.md, "The scale search's
    block forwards in bfloat16 on a CPU with AMX"), and the compute dtype elsewhere (no CPU without AMX has been measured to gain; a GPU run computes in 16 bits as it is).
    Only the loss that ranks the candidate ratios moves; the statistics, clip search and rounding stay as they are.
    """
    if setting == "compute":
        return None
    if setting == "bfloat16":
        return None if compute_dtype == torch.bfloat16 else torch.bfloat16
    if setting != "auto":
        raise ValueError(f"advanced.awq.search_dtype {setting!r} is unknown; use auto, compute or bfloat16")
    return torch.bfloat16 if device.type == "cpu" and compute_dtype == torch.float32 and cpu_has_amx() else None


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles the OS lets torch use (oneDNN then runs bf16 matmuls on them)."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)  # torch's own check (private: absent -> no AMX)
    try:
        return bool(probe()) if probe is not None else False
    except RuntimeError:
        return False


def _triton_module(name: str, kernel: str, device: torch.device, setting: str):
    """methods.<name> (a Triton kernel's module) when `kernel` (auto | torch | triton) asks for it and it can run
    on `device`; None for torch's. triton asked for and unable to run: KernelUnavailable naming `setting`."""
    if kernel == "torch":
        return None
    if kernel not in ("auto", "triton"):
        raise ValueError(f"{setting} {kernel!r} is unknown; use auto, torch or triton")
    interpret = kernel == "triton" and os.environ.get("TRITON_INTERPRET") == "1"  # CPU emulation, for tests
    if device.type != "cuda" and not interpret:
        why = f"the tensors are on {device.type}; the Triton kernel needs CUDA (or TRITON_INTERPRET=1)"
    else:
        try:
            return importlib.import_module(f".{name}", __package__)  # imports triton, which is optional
        except ImportError as e:
            why = f"triton does not import ({e})"
    if kernel == "triton":
        raise KernelUnavailable(f"{setting} triton was asked for but cannot run: {why}; set {setting}: torch or auto")
    return None

"""Checks a decoder runs on one linear's tensors before it reads them: a directory another tool wrote (or one
damaged since) is refused with the tensor named and its shape beside the one its layout needs, not with an
indexing error from deep inside the unpacking."""

from __future__ import annotations

import torch


class TensorError(ValueError):
    """One tensor of a packed linear that its layout cannot hold; `tensor` is its suffix (qweight, scales, ...)."""

    def __init__(self, tensor: str, problem: str):
        super().__init__(problem)
        self.tensor = tensor


def need(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The tensor `name` of a linear; TensorError when the file does not hold it."""
    if name not in tensors:
        raise TensorError(name, f"is missing (the linear holds {', '.join(sorted(tensors))})")
    return tensors[name]


def expect(tensors: dict[str, torch.Tensor], name: str, shape: tuple[int, ...], why: str) -> None:
    """TensorError unless tensors[name] has `shape`; why: where that shape comes from, for the message."""
    got = tuple(tensors[name].shape)
    if got != tuple(shape):
        raise TensorError(name, f"has shape {list(got)}, expected {list(shape)} from {why}")


def integer(tensors: dict[str, torch.Tensor], name: str) -> None:
    """TensorError unless tensors[name] holds integers (packed codes, zero points and group indices do)."""
    if tensors[name].is_floating_point():
        raise TensorError(name, f"is {str(tensors[name].dtype).removeprefix('torch.')}, not packed int32 codes")


def groups_divide(name: str, in_f: int, n_group: int) -> None:
    """TensorError unless n_group contiguous groups split in_f input features evenly."""
    if n_group == 0 or in_f % n_group:
        raise TensorError(name, f"does not fit: {in_f} input features do not split evenly into {n_group} groups")


def check_g_idx(tensors: dict[str, torch.Tensor], name: str, in_f: int, n_group: int,
                source: str) -> torch.Tensor | None:
    """A linear's group index [in] (each input feature's group), checked against in_f (which `source` gives);
    None when the layout stores none."""
    g_idx = tensors.get(name)
    if g_idx is None:
        return None
    integer(tensors, name)
    expect(tensors, name, (in_f,), f"{source} ({in_f} input features)")
    if in_f and not (0 <= int(g_idx.min()) and int(g_idx.max()) < n_group):
        raise TensorError(name, f"names groups {int(g_idx.min())}..{int(g_idx.max())}, but the scales hold {n_group}")
    return g_idx


def contiguous(g_idx: torch.Tensor | None, in_f: int, n_group: int) -> bool:
    """Whether a group index is the plain i // group_size (no activation-order permutation); True for none."""
    if g_idx is None:
        return True
    if in_f % n_group:
        return False
    return torch.equal(g_idx.to(torch.int64), torch.arange(in_f, device=g_idx.device) // (in_f // n_group))

"""Small irreps utilities used at construction time (never inside ``forward``)."""
from __future__ import annotations

import warnings
from typing import FrozenSet, List, Optional, Tuple, Union

import torch
from e3nn import o3

IrrepsLike = Union[str, o3.Irreps]


def as_irreps(value: IrrepsLike, name: str) -> o3.Irreps:
    """Parse ``value`` into ``o3.Irreps``, with an error naming the argument."""
    try:
        return o3.Irreps(value)
    except (ValueError, TypeError, AssertionError) as exc:
        raise ValueError(f"{name} must be e3nn irreps (e.g. '8x0e + 4x1o'), got {value!r}") from exc


def support(value: Optional[IrrepsLike], name: str, irreps: o3.Irreps) -> Optional[FrozenSet[Tuple[int, int]]]:
    """The degrees and parities ``(l, p)`` of the irreps ``value`` (multiplicities ignored), None when ``value`` is
    None or covers every irrep of ``irreps``."""
    if value is None:
        return None
    kept = frozenset((ir.l, ir.p) for _, ir in as_irreps(value, name))
    if not any((ir.l, ir.p) in kept for mul, ir in irreps if mul > 0):  # all zero: rarely what was meant
        shown = o3.Irreps([(1, (l, p)) for l, p in sorted(kept)])
        warnings.warn(f"{name} {shown} shares no irrep with {irreps}: every value there is taken as zero, and the "
                      "layer's output is zero", stacklevel=3)
    return None if all((ir.l, ir.p) in kept for _, ir in irreps) else kept


def entries(irreps: o3.Irreps) -> List[Tuple[int, int, int]]:
    """``(mul, l, p)`` of every entry, in order, skipping zero multiplicities."""
    return [(mul, ir.l, ir.p) for mul, ir in irreps if mul > 0]


def starts(sizes: List[int]) -> List[int]:
    """Where each of consecutive pieces of ``sizes`` begins: ``[0, s0, s0 + s1, ...]`` (one per piece)."""
    return [sum(sizes[:k]) for k in range(len(sizes))]


def entry_starts(irreps_entries: List[Tuple[int, int, int]]) -> List[int]:
    """The first column of every entry ``(mul, l, p)`` in the flat features."""
    return starts([mul * (2 * l + 1) for mul, l, _ in irreps_entries])


def split_entries(x: torch.Tensor, irreps_entries: List[Tuple[int, int, int]]) -> List[torch.Tensor]:
    """Split ``x [B, dim]`` into ``[B, mul, 2l+1]`` views, one per entry."""
    sizes = [mul * (2 * l + 1) for mul, l, _ in irreps_entries]
    parts = x.split(sizes, dim=-1)
    return [part.reshape(x.shape[0], mul, 2 * l + 1) for part, (mul, l, _) in zip(parts, irreps_entries)]

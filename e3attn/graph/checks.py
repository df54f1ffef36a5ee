r"""Validation of the arguments of :mod:`e3attn.graph`: numbers, flags, positions and periodic cells.

Every check raises ``ValueError`` (``TypeError`` for a cell that is not a tensor) naming the argument and what
was expected.
"""
from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Optional, Tuple

import numpy as np
import torch

# radius_graph_pbc refuses cells with more periodic images than this within r_max of a point
_MAX_IMAGES = 2**20


def _scalar(value):
    """A one-element tensor or NumPy array as its Python number; anything else unchanged."""
    if (isinstance(value, torch.Tensor) and value.numel() == 1) or (isinstance(value, np.ndarray) and value.size == 1):
        return value.item()
    return value


def check_r_max(r_max, dtype: torch.dtype) -> float:
    """``r_max`` as a float: a positive finite real number (never a bool) whose square is a normal
    number of ``dtype``, so that squared distances near it are finite and keep their precision."""
    value = _scalar(r_max)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, Real) or not 0.0 < float(value) < math.inf:
        raise ValueError(f"r_max must be a positive finite number, got {r_max!r}")
    r, info = float(value), torch.finfo(dtype)
    smallest, largest = math.sqrt(info.tiny), math.sqrt(info.max)
    if not smallest <= r < largest:
        raise ValueError(
            f"r_max={r:g} is out of range for {dtype} positions: the distances are compared squared, and "
            f"r_max**2 must be a normal finite {dtype} number, so {smallest:.4g} <= r_max < {largest:.4g}"
        )
    return r


def check_flag(value, name: str) -> bool:
    value = _scalar(value)
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return bool(value)


def check_max_num_neighbors(value) -> Optional[int]:
    value = _scalar(value)
    if value is not None and (isinstance(value, (bool, np.bool_)) or not isinstance(value, Integral) or value < 0):
        raise ValueError(f"max_num_neighbors must be None or a non-negative int, got {value!r}")
    return None if value is None else int(value)


def check_spread(pos, r: float) -> float:
    """The largest coordinate magnitude of ``pos`` (array or tensor); refuses non-finite positions (the
    value check of :func:`~e3attn._checks.check_pos`, also under ``torch.compile``) and clouds the search
    cannot represent in units of ``r`` (it works on float64 coordinates divided by about ``r``)."""
    largest = float(max(-pos.min(), pos.max())) if pos.shape[0] else 0.0
    if not math.isfinite(largest):
        raise ValueError("pos contains NaN or infinite values")
    if largest / r > 2.0**1000:
        raise ValueError(
            f"pos has coordinates up to {largest:.3g}, more than 2**1000 times r_max={r:g}: in units of r_max the "
            "neighbour search would overflow float64"
        )
    return largest


def check_cell(cell: torch.Tensor, pbc, pos: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``cell`` as ``[Bc, 3, 3]`` and ``pbc`` as bool ``[Bp, 3]``, with ``Bc, Bp`` 1 (shared) or ``B``."""
    if not isinstance(cell, torch.Tensor):
        raise TypeError(f"cell must be a torch.Tensor of shape [3, 3] or [B, 3, 3], got {type(cell).__name__}")
    if cell.shape[-2:] != (3, 3) or cell.dim() not in (2, 3):
        raise ValueError(f"cell must have shape [3, 3] or [B, 3, 3] (rows = lattice vectors), got {list(cell.shape)}")
    if cell.dtype != pos.dtype or cell.device != pos.device:
        raise ValueError(
            f"cell must have the dtype and device of pos ({pos.dtype}, {pos.device}), got {cell.dtype}, {cell.device}"
        )
    pbc = torch.as_tensor(pbc, device=pos.device)
    if pbc.dtype != torch.bool:
        raise ValueError(f"pbc must hold booleans, got dtype {pbc.dtype}")
    if pbc.dim() == 0:
        pbc = pbc.expand(3)
    if pbc.shape[-1:] != (3,) or pbc.dim() > 2:
        raise ValueError(f"pbc must have shape [3] or [B, 3], got {list(pbc.shape)}")
    cell, pbc = cell.reshape(-1, 3, 3), pbc.reshape(-1, 3)
    if cell.shape[0] != pbc.shape[0] and 1 not in (cell.shape[0], pbc.shape[0]):
        raise ValueError(f"cell has {cell.shape[0]} graphs but pbc has {pbc.shape[0]}")
    return cell, pbc


def check_images(inverse_spacing: torch.Tensor, pbc: torch.Tensor, r: float) -> None:
    """Refuse cells with more than :data:`_MAX_IMAGES` images within ``r`` of a point, before allocating.

    ``inverse_spacing[g, k]`` is one over the distance between the lattice planes of graph ``g``
    along direction ``k``; a point reaches :math:`\\lceil r / d_k \\rceil` planes on either side.
    """
    per_direction = torch.where(pbc, 2 * torch.ceil(r * inverse_spacing) + 1, torch.ones_like(inverse_spacing))
    images = per_direction.prod(1)
    graph = int(images.argmax())
    if float(images[graph]) > _MAX_IMAGES:
        k = int(inverse_spacing[graph].argmax())
        spacing = 1 / float(inverse_spacing[graph, k])
        raise ValueError(
            f"cell of graph {graph}: its lattice planes along direction {k} are {spacing:.3g} apart, so "
            f"r_max={r:g} reaches {float(images[graph]):.3g} periodic images of every point (at most 2**20 are "
            "supported): the cell is (nearly) singular or far smaller than r_max"
        )


def check_cells_away(far: float, dtype: torch.dtype) -> None:
    """Image shifts must be exact integers in ``dtype``: points at most ``1 / (4 eps)`` cells from the origin
    (``far``: the largest fractional coordinate in magnitude)."""
    limit = 0.25 / torch.finfo(dtype).eps
    if far > limit:
        raise ValueError(
            f"pos has points {far:.3g} cells away from the origin; the integer image shifts stay exact in "
            f"{dtype} up to {limit:.3g} cells: wrap pos into the cell first"
        )

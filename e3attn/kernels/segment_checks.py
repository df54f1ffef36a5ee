r"""Checks of the node kernels' arguments (:mod:`e3attn.kernels.segment_ops`, :mod:`e3attn.kernels.softmax_ops`):
the kernels index without bounds checks, so every shape, dtype, device and index table they read is checked here
first, with an error naming the argument. Index tables are checked once per tensor and version
(``e3attn._remembered``)."""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, List, Optional, Tuple

import numpy as np
import torch

from .cpu import _array
from .._remembered import checked, remember

__all__ = ["arguments_checked_by_caller", "check_blocks", "check_segments", "check_shape", "common_dtype",
           "node_arguments"]

# set while a backward formula of segment_ops runs (the operators it calls take the forward's checked inputs and
# gradients of the forward's outputs: autograd gives those their shapes, dtypes and devices) and within
# arguments_checked_by_caller: the operators of segment_ops check nothing
_TRUSTED = contextvars.ContextVar("e3attn_segment_arguments_trusted", default=False)


@contextlib.contextmanager
def arguments_checked_by_caller() -> Iterator[None]:
    """Within this context the operators of :mod:`e3attn.kernels.segment_ops` do not check their arguments: for a
    caller that runs a graph traced from e3attn's layer, whose operators' arguments the graph derives from inputs
    the caller has checked (the edges' node indices in range, as ``e3attn._checks.check_edge_index`` checks them). The
    kernels index without bounds checks, so nothing else belongs in it. A traced graph's operators get new tensors
    at every call, so their checks, remembered per tensor in eager mode, would otherwise read ``rowptr`` and
    ``index`` at every call of every operator."""
    token = _TRUSTED.set(True)
    try:
        yield
    finally:
        _TRUSTED.reset(token)


def check_segments(rowptr: torch.Tensor, num_edges: int, num_nodes: int, device: torch.device) -> None:
    """Check what the kernels rely on in ``rowptr`` (they index without bounds checks): on the CPU its values too,
    once per tensor and version (a model reuses one ``rowptr`` for all its layers and both directions); on a GPU
    its shape, dtype and device only (reading its values would wait for the device: the layer builds it)."""
    if (rowptr.dim() != 1 or rowptr.dtype != torch.int64 or rowptr.device != device
            or rowptr.shape[0] != num_nodes + 1):
        raise ValueError(f"rowptr must be a 1-d int64 tensor [{num_nodes + 1}] (one more than the nodes) on "
                         f"{device}, got {rowptr.dtype} {list(rowptr.shape)} on {rowptr.device}")
    if device.type == "cpu" and checked(rowptr, num_edges) is None:
        array = _array(rowptr)
        if array[0] != 0 or array[-1] != num_edges or np.any(np.diff(array) < 0):
            raise ValueError(f"rowptr must rise from 0 to the number of edges ({num_edges})")
        remember(rowptr, num_edges, True)


def check_shape(name: str, t: torch.Tensor, shape: Tuple[int, ...], device: torch.device) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")


def node_arguments(edge_rows: Optional[torch.Tensor], y: Optional[torch.Tensor], z: Optional[torch.Tensor],
                    lt: Optional[torch.Tensor], blocks: torch.Tensor, rowptr: torch.Tensor, dims: List[int]):
    """Check the arguments of a node kernel against ``dims = [heads, hidden, paths, z width, L size]``:
    ``a [E, heads * hidden]`` (flattened), ``y [E, paths]``, ``z [N, z width]``, ``lt [L size]`` (None ones
    skipped), ``blocks`` and ``rowptr``; the block table as Python integers."""
    heads, hidden, paths, zwidth, lsize = dims
    nodes = rowptr.shape[0] - 1
    num = next((t.shape[0] for t in (edge_rows, y) if t is not None), 0)
    common_dtype(**{"a": edge_rows, "y": y, "z": z, "lt": lt})
    device = next(t for t in (edge_rows, y, z, lt) if t is not None).device
    for name, t, shape in (("a", edge_rows, (num, heads * hidden)), ("y", y, (num, paths)), ("z", z, (nodes, zwidth)),
                           ("lt", lt, (lsize,))):
        if t is not None:
            check_shape(name, t, shape, device)
    check_segments(rowptr, num, nodes, device)
    return check_blocks(blocks, dims)


def check_blocks(blocks: torch.Tensor, dims: List[int]) -> List[List[int]]:
    """The block table as Python integers, after checking that it stays inside ``dims``."""
    heads, hidden, paths, zwidth, lsize = dims
    if blocks.dtype != torch.int64 or blocks.dim() != 2 or blocks.shape[1] != 6 or blocks.device.type != "cpu":
        raise ValueError(f"blocks must be an int64 CPU tensor [B, 6], got {blocks.dtype} {list(blocks.shape)} on "
                         f"{blocks.device}")
    if heads < 1 or min(dims) < 0:
        raise ValueError(f"dims must be [heads >= 1, hidden, paths, z width, L size] >= 0, got {list(dims)}")
    table = checked(blocks, tuple(dims))
    if table is not None:
        return table
    table = blocks.tolist()
    for poff, k, dim_l, width, loff, zoff in table:
        if min(poff, k, dim_l, width, loff, zoff) < 0 or poff + k * dim_l > paths or (
                loff + heads * width * hidden * k > lsize or zoff + heads * width * dim_l > zwidth):
            raise ValueError(f"blocks does not fit dims {list(dims)} (paths, z width, L size): "
                             f"row {[poff, k, dim_l, width, loff, zoff]}")
    remember(blocks, tuple(dims), table)
    return table


def common_dtype(**tensors: Optional[torch.Tensor]) -> torch.dtype:
    """The one floating dtype (float32 or float64) of the given tensors (None ones ignored)."""
    given = {name: t.dtype for name, t in tensors.items() if t is not None}
    dtypes = set(given.values())
    if len(dtypes) != 1 or not dtypes <= {torch.float32, torch.float64}:
        raise ValueError(f"{', '.join(given)} must share one dtype, float32 or float64, got "
                         f"{', '.join(f'{k}: {v}' for k, v in given.items())}")
    return dtypes.pop()

r"""Vectorised cell list in plain PyTorch: the neighbour search of GPUs without torch_cluster, and of
the boxes vesin cannot grid (see :mod:`e3attn.graph.search`).

Points are binned into cubic cells of side :math:`s \ge r`, so two points closer than
:math:`r` lie in the same or in adjacent cells. Cells are identified by one integer key
(graph index and the three cell coordinates), sources are sorted by key, and every
query point scans the :math:`3^3` cells around its own. Only occupied cells are stored
(sorted unique keys looked up with ``searchsorted``), so memory is linear in the number
of points however sparse the cloud, and candidates are generated in chunks of bounded
size. Every step is a tensor operation, so the same code runs on CPU and CUDA.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

__all__ = ["squared_norm", "ragged_arange", "cell_list_pairs"]

# cell keys must stay below 2**62 so that key + offset never overflows int64
_MAX_KEY = 2**62


def squared_norm(v: torch.Tensor) -> torch.Tensor:
    r"""Row-wise squared norm of ``[M, 3]`` vectors, summed in a fixed order.

    .. math:: \|v\|^2 = (v_x v_x + v_y v_y) + v_z v_z

    Args:
        v: ``[M, 3]`` vectors.

    Returns:
        ``[M]`` in the dtype of ``v``.

    Example::

        >>> squared_norm(torch.tensor([[1.0, 2.0, 2.0]]))
        tensor([9.])
    """
    return v[:, 0] * v[:, 0] + v[:, 1] * v[:, 1] + v[:, 2] * v[:, 2]


def ragged_arange(starts: torch.Tensor, counts: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""Concatenate the integer ranges ``[starts[k], starts[k] + counts[k])``.

    .. math:: \mathrm{values} = \bigoplus_k \left(s_k, s_k + 1, \dots, s_k + c_k - 1\right)

    Args:
        starts: ``[K]`` integer start of every range.
        counts: ``[K]`` non-negative integer length of every range.

    Returns:
        ``(segment, values)``: two ``[sum(counts)]`` int64 tensors, the range index
        ``k`` of every entry and the entry itself, in order.

    Example::

        >>> ragged_arange(torch.tensor([5, 0, 2]), torch.tensor([2, 0, 3]))
        (tensor([0, 0, 2, 2, 2]), tensor([5, 6, 2, 3, 4]))
    """
    total = int(counts.sum())
    segment = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts, output_size=total)
    first = torch.cumsum(counts, 0) - counts  # position of every range's first entry
    values = torch.arange(total, device=counts.device) + (starts - first).index_select(0, segment)
    return segment, values


def _cell_keys(x: torch.Tensor, graph: torch.Tensor, num_graphs: int, cell_size: float) -> Tuple[torch.Tensor, int]:
    """One int64 key per point for its (graph, cell), with an empty cell on every side of every graph's
    block, and the number of cells per axis."""
    lo = torch.full((num_graphs, 3), float("inf"), dtype=x.dtype, device=x.device)
    lo = lo.scatter_reduce(0, graph[:, None].expand(-1, 3), x, reduce="amin")
    rel = x - lo[graph]  # >= 0: cells are counted from each graph's own corner
    extent = float(rel.max()) if rel.numel() else 0.0
    while True:  # coarser cells for absurdly sparse clouds, so that keys fit in int64
        dims = int(extent / cell_size) + 3
        if num_graphs * dims**3 < _MAX_KEY:
            break
        cell_size *= 2.0
    c = torch.floor(rel / cell_size).long() + 1
    return ((graph * dims + c[:, 0]) * dims + c[:, 1]) * dims + c[:, 2], dims


def cell_list_pairs(
    query: torch.Tensor,
    source: torch.Tensor,
    r: float,
    query_batch: Optional[torch.Tensor] = None,
    source_batch: Optional[torch.Tensor] = None,
    *,
    max_candidates: int = 2**22,
) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""All (query, source) pairs of the same graph closer than ``r``.

    .. math:: \{(q, s) : \mathrm{batch}_q = \mathrm{batch}_s,\ \|x_q - y_s\|^2 < r^2\}

    The squared distance is evaluated in the dtype of the inputs and cells are assigned
    in float64, so a pair whose distance is within rounding of ``r`` may be missed:
    callers that need an exact cutoff search with a slightly larger radius and test
    the candidates themselves. The pairs come in no particular order.

    Args:
        query: ``[Nq, 3]`` floating positions.
        source: ``[Ns, 3]`` positions, same dtype and device.
        r: search radius, ``> 0``.
        query_batch: ``[Nq]`` int64 graph index of every query point, or ``None``.
        source_batch: ``[Ns]`` int64 graph index of every source point, or ``None``.
        max_candidates: bound on the candidate pairs tested at once (memory).

    Returns:
        ``(q, s)``: two int64 tensors ``[P]`` indexing ``query`` and ``source``.

    Example::

        >>> x = torch.tensor([[0.0, 0, 0], [0.5, 0, 0], [3.0, 0, 0]])
        >>> cell_list_pairs(x, x, 1.0)
        (tensor([0, 0, 1, 1, 2]), tensor([0, 1, 0, 1, 2]))
    """
    nq, device = query.shape[0], query.device
    empty = torch.zeros(0, dtype=torch.long, device=device)
    if nq == 0 or source.shape[0] == 0:
        return empty, empty
    if query_batch is None or source_batch is None:
        query_batch = torch.zeros(nq, dtype=torch.long, device=device)
        source_batch = torch.zeros(source.shape[0], dtype=torch.long, device=device)
    graphs, graph = torch.unique(torch.cat([query_batch, source_batch]), return_inverse=True)
    keys, dims = _cell_keys(torch.cat([query, source]).double(), graph, graphs.numel(), float(r))
    query_keys, source_keys = keys[:nq], keys[nq:]

    source_keys, source_order = torch.sort(source_keys, stable=True)
    cells, counts = torch.unique_consecutive(source_keys, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts

    # the 27 neighbour cells of every occupied query cell, as (start, count) ranges of sorted sources
    d = torch.arange(-1, 2, device=device)
    offsets = ((d[:, None, None] * dims + d[None, :, None]) * dims + d[None, None, :]).reshape(-1)
    query_cells, query_cell = torch.unique(query_keys, return_inverse=True)
    wanted = query_cells[:, None] + offsets
    slot = torch.searchsorted(cells, wanted).clamp_(max=cells.numel() - 1)
    found = cells[slot] == wanted
    range_start = starts[slot]
    range_count = torch.where(found, counts[slot], torch.zeros_like(slot))

    # candidates per query point, split into chunks of at most ~max_candidates
    per_point = range_count.sum(1)[query_cell]
    chunk = torch.div(torch.cumsum(per_point, 0) - per_point, max_candidates, rounding_mode="floor")
    sizes = torch.unique_consecutive(chunk, return_counts=True)[1].tolist()
    out_q, out_s = [], []
    lo = 0
    for size in sizes:
        cell = query_cell[lo : lo + size]
        segment, position = ragged_arange(range_start[cell].reshape(-1), range_count[cell].reshape(-1))
        q = torch.div(segment, offsets.numel(), rounding_mode="floor").add_(lo)
        s = source_order.index_select(0, position)
        keep = squared_norm(query.index_select(0, q) - source.index_select(0, s)) < r * r
        out_q.append(q.masked_select(keep))
        out_s.append(s.masked_select(keep))
        lo += size
    return torch.cat(out_q), torch.cat(out_s)

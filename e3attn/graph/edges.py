r"""Edges from candidate pairs: the exact cutoff test in the dtype of the positions and the (dst, src, shift)
order, on NumPy arrays (CPU) or tensors (other devices), for :mod:`e3attn.graph`."""
from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np
import torch

from e3attn.graph.cells import squared_norm
from e3attn._checks import check_batch

def _graph_index(batch: Optional[torch.Tensor], pos: torch.Tensor) -> Optional[torch.Tensor]:
    check_batch(batch, pos.shape[0])
    if batch is None:
        return None
    if batch.device != pos.device:
        raise ValueError(f"batch must be on the device of pos ({pos.device}), got {batch.device}")
    return batch.long()


def _margin(dtype: torch.dtype) -> float:
    """The relative rounding of a squared distance in ``dtype`` (a few units of its last place), generously."""
    return max(1e-4, 64 * torch.finfo(dtype).eps)


# ---------------------------------------------------------------- arrays: NumPy on the CPU, torch elsewhere
# On the CPU the graph is assembled with NumPy (light per operation: torch's OpenMP regions stall when
# other processes keep the cores busy) and sorted by e3attn.graph.csr, whose threads take small groups of work
# in turn. The functions below take NumPy arrays or torch tensors alike.


def _on_host(pos: torch.Tensor) -> bool:
    """Whether the graph of ``pos`` is assembled with NumPy (CPU; NumPy has no bfloat16)."""
    return pos.device.type == "cpu" and pos.dtype != torch.bfloat16


def _arrays(host: bool, *tensors: Optional[torch.Tensor]) -> list:
    """``tensors`` as NumPy arrays (zero copy) when ``host``, else unchanged; ``None`` stays ``None``."""
    return [t.numpy() if host and t is not None else t for t in tensors]


def _tensor(array) -> torch.Tensor:
    return torch.from_numpy(array) if isinstance(array, np.ndarray) else array


def _graph_labels(batch: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The distinct graph labels of ``batch``, sorted, and every point's graph ``0, 1, ...``."""
    if batch.device.type != "cpu":
        return torch.unique(batch, return_inverse=True)
    labels, graph = np.unique(batch.numpy(), return_inverse=True)
    return torch.from_numpy(labels), torch.from_numpy(graph.reshape(-1))


def _nonzero(mask):
    """The indices of the true entries of a 1-D mask."""
    return np.flatnonzero(mask) if isinstance(mask, np.ndarray) else mask.nonzero().squeeze(1)


def _arange(like, start: int, stop: int):
    if isinstance(like, np.ndarray):
        return np.arange(start, stop)
    return torch.arange(start, stop, device=like.device)


def _int64(values):
    return values.astype(np.int64) if isinstance(values, np.ndarray) else values.long()


def _cast(values, like):
    """``values`` in the dtype of ``like`` (themselves when they have it)."""
    return values.astype(like.dtype, copy=False) if isinstance(values, np.ndarray) else values.to(like.dtype)


def _settle(distances, sure_below: float, exact):
    """The candidate pairs that are not edges, as indices: ``exact(index)`` tests the pairs ``index``
    (all when ``None``); with the search's float64 ``distances`` only those not ``sure_below`` the
    cutoff need it."""
    if distances is None:
        return _nonzero(~exact(None))
    unsure = _nonzero(distances >= sure_below)
    return unsure[~exact(unsure)] if len(unsure) else unsure


def _without(rows: list, drop) -> list:
    """``rows`` (arrays of equal length) without the entries ``drop`` (sorted indices), in place and in
    any order: the last entries move into the holes, O(len(drop))."""
    if len(drop) == 0:
        return rows
    length = rows[0].shape[0]
    kept = length - len(drop)
    tail = _arange(drop, kept, length)
    fillers = tail[~(np if isinstance(drop, np.ndarray) else torch).isin(tail, drop)]
    holes = drop[drop < kept]
    for row in rows:
        row[holes] = row[fillers]
    return [row[:kept] for row in rows]


def _shorter_than(pos, pairs, r: float):
    """The exact test of every row ``(i, j)`` of ``pairs``: ``|pos[i] - pos[j]|^2 < r^2`` in ``pos.dtype``."""
    ends = pos[pairs.reshape(-1)].reshape(-1, 2, 3)
    return squared_norm(ends[:, 0] - ends[:, 1]) < r * r


def _shift_vectors(shift, cell, pair_graph):
    """``shift @ cell`` of every pair in the dtype of ``cell`` (``[1, 3, 3]`` shared, else ``[B, 3, 3]``
    indexed by ``pair_graph``), summed in the order of the lattice vectors."""
    shift = _cast(shift, cell)
    if cell.shape[0] == 1:
        a, b, c = cell[0]
    else:
        rows = cell[pair_graph]
        a, b, c = rows[:, 0], rows[:, 1], rows[:, 2]
    return shift[:, 0:1] * a + shift[:, 1:2] * b + shift[:, 2:3] * c


def _lexsort(columns: List[torch.Tensor]) -> torch.Tensor:
    """Permutation sorting rows by ``columns[0]``, ties broken by ``columns[1]``, ... (stable passes)."""
    order = torch.arange(columns[0].numel(), device=columns[0].device)
    for column in reversed(columns):
        order = order[torch.sort(column[order], stable=True).indices]
    return order


def _csr_edges(i, j, shift, num_nodes: int, loop: bool, dtype: torch.dtype = torch.float64):
    r"""The edges ``j -> i`` (shift ``S``) and ``i -> j`` (shift ``-S``) of every pair of a half list,
    and the self-loops, as ``[2, E]`` sorted by ``dst``, then ``src``, then shift, with the ``[E, 3]``
    shifts in ``dtype`` (``None`` without ``shift``); NumPy arrays or torch tensors, as the input.

    On the host, the edges are partitioned into blocks of destinations and sorted block by block
    (:mod:`e3attn.graph.csr`). On other devices every edge is packed into one integer key

    .. math:: \big((\mathrm{dst} \cdot N + \mathrm{src}) \ll c\big) \,|\, \mathrm{code}(S),

    where :math:`\mathrm{code}` numbers the shifts :math:`S \in [-m, m]^3` lexicographically (in
    :math:`c` bits), and the keys are sorted by value: no argsort, no payload. A table of all
    :math:`(2m+1)^3` shifts decodes the codes. Large shifts (:math:`m > 50`) or keys beyond int64 fall back
    to stable sorts by column.
    """
    num_pairs = len(i)
    reach = int(max(-shift.min(), shift.max())) if shift is not None and num_pairs > 0 else 0
    width = 2 * reach + 1
    code_bits = (width**3 - 1).bit_length()
    if shift is not None and (reach > 50 or 2 * (num_nodes - 1).bit_length() + code_bits > 63):
        return _lexsorted_edges(*(_tensor(t) for t in (i, j, shift)), dtype)
    # the shifts in code order
    every_shift = torch.arange(-reach, reach + 1, dtype=dtype, device="cpu" if isinstance(i, np.ndarray) else i.device)
    table = torch.cartesian_prod(every_shift, every_shift, every_shift).reshape(-1, 3)
    coefficients = [width * width, width, 1]
    if isinstance(i, np.ndarray):
        from e3attn.graph.csr import csr_edges  # imports numba: only once a graph is assembled on the host

        if dtype != torch.float16:
            return csr_edges(i, j, shift, num_nodes, loop, code_bits, coefficients, table.numpy())
        # numba has no float16: the shifts (small integers, exact in float16) are decoded in float32
        edge_index, shifts = csr_edges(i, j, shift, num_nodes, loop, code_bits, coefficients, table.float().numpy())
        return edge_index, None if shifts is None else shifts.astype(np.float16)
    return _device_edges(i, j, shift, num_nodes, loop, code_bits, coefficients, table)


def _device_edges(i, j, shift, num_nodes, loop, code_bits, coefficients, table):
    """:func:`_csr_edges` with torch, in place in the output's memory: int64 keys in row 0, codes in row 1."""
    num_pairs = len(i)
    num_edges = 2 * num_pairs + (num_nodes if loop else 0)
    edge_index = torch.empty((2, num_edges), dtype=torch.long, device=i.device)
    keys, scratch = edge_index[0], edge_index[1]
    forward, backward = keys[:num_pairs], keys[num_pairs : 2 * num_pairs]
    torch.mul(i, num_nodes, out=forward).add_(j)
    torch.mul(j, num_nodes, out=backward).add_(i)
    if code_bits:
        code = scratch[:num_pairs].copy_(shift[:, 2]).add_(len(table) // 2)  # the code of S
        for k, coefficient in enumerate(coefficients[:2]):
            code.add_(shift[:, k], alpha=coefficient)
        forward.bitwise_left_shift_(code_bits).bitwise_or_(code)
        backward.bitwise_left_shift_(code_bits).add_(len(table) - 1).sub_(code)  # the code of -S
    if loop:  # open graphs only: no code bits
        keys[2 * num_pairs :].copy_(torch.arange(num_nodes, device=i.device)).mul_(num_nodes + 1)
    keys.copy_(torch.sort(keys).values)
    shifts = table.index_select(0, keys & ((1 << code_bits) - 1)) if shift is not None else None
    keys.bitwise_right_shift_(code_bits)
    torch.div(keys, num_nodes, rounding_mode="floor", out=scratch)
    keys.sub_(scratch * num_nodes)
    return edge_index, shifts


def _lexsorted_edges(i, j, shift, dtype):
    """:func:`_csr_edges` without self-loops for large shifts: stable sorts by column."""
    shift = shift.long()
    dst, src, shift = torch.cat([i, j]), torch.cat([j, i]), torch.cat([shift, -shift])
    order = _lexsort([dst, src, shift[:, 0], shift[:, 1], shift[:, 2]])
    return torch.stack([src[order], dst[order]]), shift[order].to(dtype)


def _check_num_neighbors(dst: torch.Tensor, num_nodes: int, max_num_neighbors: Optional[int]) -> None:
    if max_num_neighbors is None or dst.numel() == 0:
        return
    degree = torch.bincount(dst, minlength=num_nodes)
    node = int(degree.argmax())
    if int(degree[node]) > max_num_neighbors:
        raise ValueError(
            f"node {node} has {int(degree[node])} incoming edges within r_max, more than "
            f"max_num_neighbors={max_num_neighbors}; raise the cap or pass None (no cap)"
        )

r"""Edges from candidate pairs: the exact cutoff test in the dtype of the positions and the (dst, src, shift)
order, on NumPy arrays (CPU) or tensors (other devices), for :mod:`e3attn.graph`."""
from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np
import torch

from e3attn._cells import squared_norm
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
# On the CPU the graph is assembled with NumPy: single-threaded and light per operation, beside vesin's
# own threads (torch's OpenMP regions stall when other processes keep the cores busy). The functions
# below take NumPy arrays or torch tensors alike.


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


# the host assembly works through its arrays in chunks of this many entries, each small enough to stay
# in the core's cache through all its passes
_CHUNK = 2**14
# host sort keys are uint32 when they fit (NumPy sorts them about twice as fast as int64), else int64
_NARROW_KEYS = 2**32


def _csr_edges(i, j, shift, num_nodes: int, loop: bool, dtype: torch.dtype = torch.float64):
    r"""The edges ``j -> i`` (shift ``S``) and ``i -> j`` (shift ``-S``) of every pair of a half list,
    and the self-loops, as ``[2, E]`` sorted by ``dst``, then ``src``, then shift, with the ``[E, 3]``
    shifts in ``dtype`` (``None`` without ``shift``); NumPy arrays or torch tensors, as the input.

    Every edge is packed into one integer key

    .. math:: \big((\mathrm{dst} \cdot N + \mathrm{src}) \ll c\big) \,|\, \mathrm{code}(S),

    where :math:`\mathrm{code}` numbers the shifts :math:`S \in [-m, m]^3` lexicographically (in
    :math:`c` bits), and the keys are sorted by value: no argsort, no payload. A table of all
    :math:`(2m+1)^3` shifts decodes the codes. NumPy sorts uint32 keys when :math:`N^2 \, 2^c \le 2^{32}`,
    else int64 ones (as torch); large shifts (:math:`m > 50`) or keys beyond int64 fall back to stable
    sorts by column.
    """
    num_pairs = len(i)
    reach = int(max(-shift.min(), shift.max())) if shift is not None and num_pairs > 0 else 0
    width = 2 * reach + 1
    code_bits = (width**3 - 1).bit_length()
    if shift is not None and (reach > 50 or num_nodes**2 << code_bits > 2**63):
        return _lexsorted_edges(*(_tensor(t) for t in (i, j, shift)), dtype)
    num_edges = 2 * num_pairs + (num_nodes if loop else 0)
    # the shifts in code order
    every_shift = torch.arange(-reach, reach + 1, dtype=dtype, device="cpu" if isinstance(i, np.ndarray) else i.device)
    table = torch.cartesian_prod(every_shift, every_shift, every_shift).reshape(-1, 3)
    coefficients = [width * width, width, 1]
    if isinstance(i, np.ndarray):
        return _host_edges(i, j, shift, num_nodes, loop, num_edges, code_bits, coefficients, table.numpy())
    return _device_edges(i, j, shift, num_nodes, loop, num_edges, code_bits, coefficients, table)


def _host_edges(i, j, shift, num_nodes, loop, num_edges, code_bits, coefficients, table):
    """:func:`_csr_edges` with NumPy: every pass over a chunk of :data:`_CHUNK` entries at a time, in the
    output's memory or chunk-sized buffers (no array-sized temporaries, whose fresh pages cost as much as
    the arithmetic)."""
    narrow = num_nodes**2 << code_bits <= _NARROW_KEYS
    edge_index = np.empty((2, num_edges), np.int64)
    keys = np.empty(num_edges, np.uint32) if narrow else edge_index[1]
    num_pairs, top = len(i), len(table) - 1
    unsafe = dict(casting="unsafe")
    code, coefficients = np.empty(_CHUNK, np.int64), np.array(coefficients, getattr(shift, "dtype", np.int64))
    for start in range(0, num_pairs, _CHUNK):
        stop = min(start + _CHUNK, num_pairs)
        part = slice(start, stop)
        forward, backward = keys[part], keys[num_pairs + start : num_pairs + stop]
        np.multiply(i[part], num_nodes, out=forward, **unsafe)
        np.add(forward, j[part], out=forward, **unsafe)
        np.multiply(j[part], num_nodes, out=backward, **unsafe)
        np.add(backward, i[part], out=backward, **unsafe)
        if code_bits:
            c = code[: len(forward)]
            np.matmul(shift[part], coefficients, out=c, **unsafe)
            c += top // 2  # the code of S; top - code: that of -S, every component mirrored
            forward <<= code_bits
            np.bitwise_or(forward, c, out=forward, **unsafe)
            backward <<= code_bits
            backward += top
            np.subtract(backward, c, out=backward, **unsafe)
    if loop:  # open graphs only: no code bits
        np.multiply(np.arange(num_nodes), num_nodes + 1, out=keys[2 * num_pairs :], **unsafe)
    keys.sort()
    shifts = np.empty((num_edges, 3), table.dtype) if shift is not None else None
    pair = np.empty(_CHUNK, np.int64)
    for start in range(0, num_edges, _CHUNK):
        part = slice(start, start + _CHUNK)
        key, src, dst = keys[part], edge_index[0, part], edge_index[1, part]
        if shifts is not None:
            np.bitwise_and(key, (1 << code_bits) - 1, out=src, **unsafe)
            np.take(table, src, axis=0, out=shifts[part], mode="clip")
        p = pair[: len(key)]
        np.right_shift(key, code_bits, out=p, **unsafe)
        np.floor_divide(p, num_nodes, out=dst)
        np.multiply(dst, num_nodes, out=src)
        np.subtract(p, src, out=src)
    return edge_index, shifts


def _device_edges(i, j, shift, num_nodes, loop, num_edges, code_bits, coefficients, table):
    """:func:`_csr_edges` with torch, in place in the output's memory: int64 keys in row 0, codes in row 1."""
    num_pairs = len(i)
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

r"""A half list of pairs sorted into the edges of a graph in CSR order, on the host (numba and NumPy).

Every pair :math:`(i, j, S)` of a half list gives the edges :math:`j \to i` with shift :math:`S` and
:math:`i \to j` with shift :math:`-S`; the graph lists its edges sorted by destination, then source,
then shift. One sort of all :math:`E` edges by a 64-bit key dominated the assembly: its memory accesses
range over the whole array. Here the destinations are cut into blocks of :math:`B = 2^b` nodes and every
edge becomes the packed key

.. math:: \big((\mathrm{dst} \bmod B) \ll (s + c)\big) \,|\, (\mathrm{src} \ll c) \,|\, \mathrm{code}(S)

(:math:`s` bits for a node, :math:`c` for a shift), so that sorting a block's keys sorts its edges:

1. :func:`_count` counts the edges of each group of pairs per block, which fixes where each group writes
   in each block, and :func:`_scatter` writes them there, streaming into a few hundred ranges;
2. NumPy sorts each block's keys, a range that fits in the core's cache, as 32-bit integers where
   :math:`b + s + c \le 32` allows blocks of at least :math:`2^6` nodes (NumPy sorts them about twice as
   fast as 64-bit ones), else as 64-bit integers in one block;
3. :func:`_decode` unpacks the keys into ``edge_index`` and the shifts.

Every step runs in groups on the threads of :func:`e3attn.kernels.threads.parallel` (one group when the
call is too small for them), and the result does not depend on them (the sort makes it unique). ``code`` numbers the shifts :math:`S \in [-m, m]^3` lexicographically (see
:func:`e3attn.graph.edges._csr_edges`), so sorting packed keys sorts by shift. Compiled on first use and
cached on disk by numba.
"""
from __future__ import annotations

import numba
import numpy as np

from e3attn.kernels import numba_cache  # noqa: F401  (the cache follows all kernel sources)
from e3attn.kernels.threads import parallel, threads_for

__all__ = ["csr_edges"]

_JIT = dict(nogil=True, cache=True)
# blocks of fewer than 2**this nodes (huge graphs) take 64-bit keys: a NumPy call per few nodes costs more
_MIN_BLOCK_BITS = 6
# the nodes are cut into at least this many blocks where blocks can stay that large (work for the threads)
_BLOCKS = 16
# groups of pairs scattered at once (their ranges in every block are fixed by the counts)
_GROUPS = 8


@numba.njit(**_JIT)
def _count(i, j, pairs, nodes, block_bits, counts):
    """``counts [blocks]``: the edges of the pairs ``pairs`` (and of the self-loops ``nodes``) per block."""
    for p in range(pairs[0], pairs[1]):
        counts[i[p] >> block_bits] += 1
        counts[j[p] >> block_bits] += 1
    for n in range(nodes[0], nodes[1]):
        counts[n >> block_bits] += 1


@numba.njit(**_JIT)
def _scatter(i, j, shift, coefficients, top, node_bits, code_bits, block_bits, pairs, nodes, fill, keys):
    """The packed keys of the edges of ``pairs`` and of the self-loops ``nodes``, written at ``fill`` (the
    group's next place in every block)."""
    low, high = (1 << block_bits) - 1, node_bits + code_bits
    for p in range(pairs[0], pairs[1]):
        a, b = i[p], j[p]
        code = 0
        if code_bits:  # the code of S; top - code is that of -S (every component mirrored)
            code = shift[p, 0] * coefficients[0] + shift[p, 1] * coefficients[1] + shift[p, 2] * coefficients[2]
            code += top // 2
        keys[fill[a >> block_bits]] = ((a & low) << high) | (b << code_bits) | code  # b -> a, shift S
        fill[a >> block_bits] += 1
        keys[fill[b >> block_bits]] = ((b & low) << high) | (a << code_bits) | (top - code)  # a -> b, shift -S
        fill[b >> block_bits] += 1
    for n in range(nodes[0], nodes[1]):  # open graphs only: no code bits
        keys[fill[n >> block_bits]] = ((n & low) << high) | n
        fill[n >> block_bits] += 1


@numba.njit(**_JIT)
def _decode(keys, start, blocks, node_bits, code_bits, block_bits, table, edge_index, shifts):
    """``edge_index [2, E]`` and (when it has rows) ``shifts [E, 3]`` from the sorted keys of ``blocks``."""
    node_mask, code_mask, high = (1 << node_bits) - 1, (1 << code_bits) - 1, node_bits + code_bits
    for k in range(blocks[0], blocks[1]):
        first = k << block_bits
        for e in range(start[k], start[k + 1]):
            key = np.int64(keys[e])  # read before edge_index[0, e] is written (64-bit keys are that row)
            edge_index[0, e] = (key >> code_bits) & node_mask
            edge_index[1, e] = first + (key >> high)
            if shifts.shape[0]:
                code = key & code_mask
                for d in range(3):
                    shifts[e, d] = table[code, d]


def _as_index(values: np.ndarray) -> np.ndarray:
    """Node indices as int64 (numba would mix uint64 and int64 into floats), without a copy where possible."""
    return values.view(np.int64) if values.dtype == np.uint64 else values.astype(np.int64, copy=False)


def _split(size: int, parts: int) -> np.ndarray:
    """``[parts, 2]``: ``parts`` contiguous ranges covering ``0 .. size``."""
    bounds = np.arange(parts + 1) * size // parts
    return np.stack([bounds[:-1], bounds[1:]], 1)


def csr_edges(i, j, shift, num_nodes: int, loop: bool, code_bits: int, coefficients, table: np.ndarray):
    """The edges of the half list ``(i, j, shift)`` (``[P]``, ``[P]``, ``[P, 3]`` integer arrays, or
    ``shift=None`` for open graphs) and the self-loops (``loop``), as ``edge_index [2, E]`` (int64) and
    ``shifts [E, 3]`` (rows of ``table``, the shifts in code order; ``None`` without ``shift``), sorted by
    destination, then source, then shift. Keys must fit: ``2 * node bits + code_bits <= 63``."""
    i, j = _as_index(i), _as_index(j)
    periodic = shift is not None
    if not periodic:
        code_bits, shift = 0, np.zeros((0, 3), np.int64)
    node_bits = max(1, (num_nodes - 1).bit_length())
    block_bits = min(32 - node_bits - code_bits, max(_MIN_BLOCK_BITS, node_bits - _BLOCKS.bit_length() + 1))
    narrow = block_bits >= _MIN_BLOCK_BITS
    if not narrow:  # one block of 64-bit keys
        block_bits = node_bits
    num_blocks = ((num_nodes - 1) >> block_bits) + 1
    num_edges = 2 * len(i) + (num_nodes if loop else 0)
    edge_index = np.empty((2, num_edges), np.int64)
    keys = np.empty(num_edges, np.uint32) if narrow else edge_index[0]  # 64-bit keys: decoded in place
    work = 300 * num_edges  # about 25 ns per edge, in the threshold's multiply-adds (see threads.SERIAL_BELOW)
    groups = _GROUPS if threads_for(work) > 1 else 1  # a serial call: one group of everything

    pairs, nodes = _split(len(i), groups), _split(num_nodes if loop else 0, groups)
    counts = np.zeros((groups, num_blocks), np.int64)
    parallel(lambda g: _count(i, j, pairs[g], nodes[g], block_bits, counts[g]), groups, work)
    # the groups' places, block after block: fill[g, k] is where group g writes its first edge of block k
    fill = np.ascontiguousarray(np.cumsum(counts.T.reshape(-1)).reshape(num_blocks, groups).T - counts)
    start = np.append(fill[0], num_edges)
    args = (np.asarray(coefficients, np.int64), len(table) - 1, node_bits, code_bits, block_bits)
    parallel(lambda g: _scatter(i, j, shift, *args, pairs[g], nodes[g], fill[g], keys), groups, work)

    block_groups = _split(num_blocks, min(num_blocks, _BLOCKS if groups > 1 else 1))
    shifts = np.empty((num_edges if periodic else 0, 3), table.dtype)

    def sort_and_decode(g: int) -> None:
        for k in range(*block_groups[g]):
            keys[start[k] : start[k + 1]].sort()
        _decode(keys, start, block_groups[g], node_bits, code_bits, block_bits, table, edge_index, shifts)

    parallel(sort_and_decode, len(block_groups), work)
    return edge_index, shifts if periodic else None

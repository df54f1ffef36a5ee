r"""The attention's kernels on the CPU when its radial weights are contracted at the nodes (numba).

See :class:`~e3attn.node_contraction.NodeContraction` for the math. The edges are sorted by destination,
so that the edges :math:`e \to i` of node :math:`i` are the rows ``rowptr[i]:rowptr[i + 1]`` (a CSR
layout), and :func:`node_pass` walks the nodes of its share ``gi`` of ``groups``, building per node the
``[heads * hidden, paths]`` matrices that its outputs need (or their transposes, below), in a buffer that stays
in cache. The two operators
of :mod:`e3attn.kernels.segment_ops` call it:

* ``e3attn::node_expand``: :math:`Q_i = E(z_i, L)` (``_expand``), then for the node's edges
  :math:`t_e = y_e Q_i^T` and/or :math:`r_e = a_e Q_i`;
* ``e3attn::node_outer``: :math:`U_i = \sum_{e \to i} a_e^T y_e`, then :math:`R(U_i, L)` (the adjoint of
  :math:`E` in :math:`z`) and/or the gradient :math:`X(U_i, z_i)` of :math:`\langle E(z_i, L), U_i \rangle` in
  :math:`L`, summed per group (``_adjoints``).

:math:`E` works per block of the product (a degree group :math:`g` of :math:`K` paths and :math:`2l+1`
components, ``blocks`` rows ``(path offset, K, 2l+1, channels per head, L offset, z offset)``): per head
:math:`a`, channel :math:`w` and component :math:`m`, :math:`Q_i[aH + h, g + mK + k] \mathrel{+}=
z_i[a, w, m]\, L[a, w, h, k]`, run along rows of ``hidden * K`` numbers (``_scratch``). The path features
are laid out (group, component, path) to match. The edge contractions run in the register-blocked loops
of :mod:`e3attn.kernels.cpu` along the contiguous path axis, or, where there are fewer paths than rows (e.g. a
block that reads only scalars: 16 paths, 64 rows), along the rows of the matrix's transpose: the vectorised
loops then run over 64 numbers instead of 16, and the per-node steps build and read that transpose directly (no
transposed copy per node). Every kernel writes only its own nodes' rows (and the gradient
of :math:`L` into its group's buffer), so results do not depend on the number of threads.

:func:`path_features` computes :math:`y_e = P(x_{\mathrm{src}(e)}, Y_e)` or its gradients in tiles of edges,
edges last, in the same loops; :func:`add_rows` sums the gradients of the gathered rows per source node.
"""
from __future__ import annotations

import numba
import numpy as np

from .cpu import _JIT, _dots, _load, _mac, _paths, _paths_backward, _store

__all__ = ["add_rows", "node_pass", "path_features"]


# ------------------------------------------------------------------ per node: Q_i = E(z_i, L) and its adjoints


@numba.njit(**_JIT)
def _scratch(blocks, hidden, dtype_of):
    """A scratch ``[2l+1, hidden K]`` for the widest block (the per-node contractions run along its rows).
    The largest sizes by a loop: numba compiles ``ndarray.max`` for about a second."""
    rows = cols = 1
    for b in range(blocks.shape[0]):
        rows, cols = max(rows, blocks[b, 2]), max(cols, hidden * blocks[b, 1])
    return np.empty((rows, cols), dtype_of.dtype)


@numba.njit(**_JIT)
def _copy(tmp, q, by_rows, into_q, a, hidden, poff, kdim, dim_l):
    """Between ``tmp[m, h K + k]`` and head ``a`` of a block of ``Q``, ``Q[a H + h, poff + m K + k]``, stored
    ``q [J, P]`` or ``[P, J]`` (its transpose, ``by_rows``): into ``q`` (``into_q``) or out of it."""
    for m in range(dim_l):
        t = tmp[m]
        if by_rows:  # rows k of q, along h
            for k in range(kdim):
                row = q[poff + m * kdim + k, a * hidden :]
                for h in range(hidden):
                    if into_q:
                        row[h] = t[h * kdim + k]
                    else:
                        t[h * kdim + k] = row[h]
        else:  # rows h of q, along k
            for h in range(hidden):
                row, first = q[a * hidden + h, poff + m * kdim :], h * kdim
                for k in range(kdim):
                    if into_q:
                        row[k] = t[first + k]
                    else:
                        t[first + k] = row[k]


@numba.njit(**_JIT)
def _expand(q, by_rows, z, lt, blocks, heads, hidden, tmp):
    """``Q = E(z, L)`` into ``q`` (stored as in :func:`_copy`): ``Q[a H + h, poff + m K + k] = sum_w z[a, w, m]
    lt[a, w, h, k]`` per block, per head a small matrix product ``tmp [2l+1, H K] = z_a^T lt_a`` along rows of
    ``H K``, then put in place. The entries of no block are left as they are (zero in :func:`node_pass`)."""
    i0, i1 = np.int64(0), np.int64(1)  # not literals: each literal argument compiles another _mac
    for b in range(blocks.shape[0]):
        poff, kdim, dim_l, width, loff, zoff = blocks[b]
        size = hidden * kdim
        for a in range(heads):
            tmp[:dim_l, :size] = 0.0
            rows = lt[loff + a * width * size : loff + (a + 1) * width * size].reshape(width, size)
            _mac(tmp, i0, dim_l, rows, i0, width, z, zoff + a * width * dim_l, i1, dim_l, size)
            _copy(tmp, q, by_rows, True, a, hidden, poff, kdim, dim_l)


@numba.njit(**_JIT)
def _adjoints(q, by_rows, lt, z, blocks, heads, hidden, tmp, out, glt):
    """From ``U`` in ``q`` (stored as in :func:`_copy`), per block: ``out = R(U, L)``, the adjoint of
    :func:`_expand`, ``out[a, w, m] = sum_hk lt[a, w, h, k] U[a H + h, poff + m K + k]`` (if ``out`` has entries),
    and ``glt += X(U, z)``, the gradient of ``<E(z, L), U>`` in ``L``, ``glt[a, w, h, k] += sum_m z[a, w, m]
    U[a H + h, poff + m K + k]`` (if ``glt`` has entries); both along rows of ``H K``."""
    i0, i1 = np.int64(0), np.int64(1)  # not literals: each literal argument compiles another _mac
    zero = np.zeros(1, q.dtype)[0]
    for b in range(blocks.shape[0]):
        poff, kdim, dim_l, width, loff, zoff = blocks[b]
        size = hidden * kdim
        for a in range(heads):
            _copy(tmp, q, by_rows, False, a, hidden, poff, kdim, dim_l)
            first, start = loff + a * width * size, zoff + a * width * dim_l
            if out.shape[0]:
                out[start : start + width * dim_l] = 0.0
                _dots(out, start, dim_l, lt[first : first + width * size].reshape(width, size), i0, width, tmp,
                      dim_l, size, zero)
            if glt.shape[0]:
                _mac(glt[first : first + width * size].reshape(width, size), i0, width, tmp, i0, dim_l, z, start,
                     dim_l, i1, size)


# ------------------------------------------------------------------ kernels: one pass over the nodes of a group


@numba.njit(**_JIT)
def node_pass(y, a, z, lt, blocks, heads, hidden, rowptr, gi, groups, out_t, out_r, out_o, glt_groups):
    """One pass over the nodes ``i`` of group ``gi`` and their edges ``e -> i``, computing the outputs that have
    rows (the others are empty and skipped):

    * with ``Q_i = E(z_i, L)``, built once per node in cache: ``out_t[e J + j] = sum_p y[e, p] Q_i[j, p]`` and
      ``out_r[e, p] = sum_j a[e J + j] Q_i[j, p]``;
    * with ``U_i = sum_{e -> i} a_e^T y_e``, built once per node in cache: ``out_o[i] = R(U_i, L)`` and
      ``glt_groups[gi] = sum_i X(U_i, z_i)`` (summed over the groups in order afterwards: bitwise repeatable).
    """
    i0, i1 = np.int64(0), np.int64(1)  # not literals: each literal argument compiles another _mac
    nodes, paths, width = rowptr.shape[0] - 1, y.shape[1], heads * hidden  # an unused y is an empty [0, paths]
    zero = np.zeros(1, z.dtype)[0]
    want_t, want_r, want_o, want_g = out_t.shape[0] > 0, out_r.shape[0] > 0, out_o.shape[0] > 0, glt_groups.shape[0] > 0
    # the edge contractions run along the longer axis of Q_i, U_i: the paths, with q = Q_i [J, P], or (few paths)
    # the rows, with q = Q_i^T [P, J] (by_rows), as the rows of the edges' a [E, J], t [E, J] and the flat
    # y [E P], r [E P]
    by_rows = width > paths
    q = np.zeros((paths, width) if by_rows else (width, paths), z.dtype)
    tmp, none = _scratch(blocks, hidden, z), np.empty(0, z.dtype)
    a_rows, t_rows, y_flat, r_flat = a.reshape(-1, width), out_t.reshape(-1, width), y.reshape(-1), out_r.reshape(-1)
    if want_g:
        glt_groups[gi] = 0.0
    for i in range(gi * nodes // groups, (gi + 1) * nodes // groups):
        start, stop = rowptr[i], rowptr[i + 1]
        if stop == start:
            if want_o:
                out_o[i] = 0.0
            continue
        if want_t or want_r:
            if want_o or want_g:  # q held the last node's U_i: clear the entries that no block writes
                q[:, :] = 0.0
            _expand(q, by_rows, z[i], lt, blocks, heads, hidden, tmp)
            if want_t:
                out_t[start * width : stop * width] = 0.0
                if by_rows:
                    _mac(t_rows, start, stop - start, q, i0, paths, y_flat, start * paths, paths, i1, width)
                else:
                    _dots(out_t, start * width, width, y, start, stop - start, q, width, paths, zero)
            if want_r:
                out_r[start:stop] = 0.0
                if by_rows:
                    _dots(r_flat, start * paths, paths, a_rows, start, stop - start, q, paths, width, zero)
                else:
                    _mac(out_r, start, stop - start, q, i0, width, a, start * width, width, i1, paths)
        if want_o or want_g:
            q[:, :] = 0.0
            if by_rows:
                _mac(q, i0, paths, a_rows, start, stop - start, y_flat, start * paths, i1, paths, width)
            else:
                _mac(q, i0, width, y, start, stop - start, a, start * width, i1, width, paths)
            _adjoints(q, by_rows, lt, z[i] if want_g else none, blocks, heads, hidden, tmp,
                      out_o[i] if want_o else none, glt_groups[gi] if want_g else none)


@numba.njit(**_JIT)
def path_features(x, index, sh, grad, s, tile, gi, groups, y, gx_edges, gsh):
    """For the tiles of group ``gi``: ``y[e] = P(x[index[e]], sh[e])`` ``[E, paths]``, or, when ``grad`` has
    rows, the gradients of that for ``grad`` ``[E, paths]``: of the gathered ``x`` per edge (``gx_edges``) and of
    ``sh``."""
    num, backward = sh.shape[0], grad.shape[0] > 0
    tiles = (num + tile - 1) // tile
    xt = np.empty((x.shape[1], tile), x.dtype)
    sht = np.empty((sh.shape[1], tile), x.dtype)
    yt = np.empty((grad.shape[1] if backward else y.shape[1], tile), x.dtype)  # y, or its gradient
    gxt = np.empty((x.shape[1], tile), x.dtype)
    gsht = np.empty((sh.shape[1], tile), x.dtype)
    for ti in range(gi * tiles // groups, (gi + 1) * tiles // groups):
        e0 = ti * tile
        n = min(tile, num - e0)
        _load(x, index, e0, n, xt)
        _load(sh, index[:0], e0, n, sht)
        if backward:
            _load(grad, index[:0], e0, n, yt)
            gxt[:, :n] = 0.0
            gsht[:, :n] = 0.0
            _paths_backward(n, yt, xt, sht, s, gxt, gsht)
            _store(gxt, e0, n, gx_edges)
            _store(gsht, e0, n, gsh)
        else:
            yt[:, :n] = 0.0
            _paths(n, xt, sht, s, yt)
            _store(yt, e0, n, y)


@numba.njit(**_JIT)
def add_rows(out, index, rows):
    """``out[index[e]] += rows[e]`` for every row ``e``, in order (the gradient of a gather; ``index`` is checked by
    the caller)."""
    for e in range(index.shape[0]):
        target, row = out[index[e]], rows[e]
        for c in range(row.shape[0]):
            target[c] += row[c]

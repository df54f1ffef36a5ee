r"""The fused tensor product on the CPU: one numba kernel per direction.

Both kernels walk the edges in tiles of ``tile`` edges (in parallel over tiles) and keep every
intermediate of a tile in small buffers laid out edges last, ``[features, tile]``, so that every
inner loop runs over the edges of the tile, vectorised whatever the irreps: the gathered inputs,
the path features :math:`y` ``[paths, tile]``, and one output block at a time its weights
:math:`w = L^T h` ``[K W, tile]`` and its output (or gradient) ``[2l+1, W, tile]``. The
``[E, weight_numel]`` weights are never stored and ``x[index]`` is gathered inside.

The backward accumulates the gradient of :math:`L` in one buffer per group of tiles (a fixed number
of groups, independent of the number of threads) and sums the groups in order, so results are
bitwise repeatable. Compiled on first use, once per dtype, and cached on disk by numba (next to this
file, or in numba's per-user cache directory when that is read-only).
"""
from __future__ import annotations

import numba
import numpy as np

__all__ = ["forward", "backward", "GROUPS"]

# groups of tiles with their own weight-gradient buffer (load balance on a busy machine, bounded memory)
GROUPS = 8
# no nnan/ninf: NaN and infinities propagate as in PyTorch
_FASTMATH = {"contract", "reassoc", "nsz", "arcp"}
_JIT = dict(nogil=True, cache=True, fastmath=_FASTMATH)


@numba.njit(inline="always", **_JIT)
def _load_tile(x, index, sh, hidden, e0, n, xt, sht, ht):
    """The tile's gathered inputs, edges last: ``xt [D, tile]``, ``sht [S, tile]``, ``ht [H, tile]``."""
    for e in range(n):
        row = index[e0 + e]
        for i in range(x.shape[1]):
            xt[i, e] = x[row, i]
        for j in range(sh.shape[1]):
            sht[j, e] = sh[e0 + e, j]
        for h in range(hidden.shape[1]):
            ht[h, e] = hidden[e0 + e, h]


@numba.njit(inline="always", **_JIT)
def _paths(n, xt, sht, path_x, path_y, path_p, path_c, y):
    """Path features of the tile, ``y [paths, tile]``."""
    y[:, :n] = 0.0
    for q in range(path_p.shape[0]):
        c, yr, xr, sr = path_c[q], y[path_p[q]], xt[path_x[q]], sht[path_y[q]]
        for e in range(n):
            yr[e] += c * xr[e] * sr[e]


@numba.njit(inline="always", **_JIT)
def _weights(n, ht, hoff, hdim, lin, base, numel, size, wt):
    """One block's weights ``wt[j, e] = sum_h lin[base + h numel + j] ht[hoff + h, e]``, ``j < size``."""
    for j in range(size):
        acc = wt[j]
        acc[:n] = 0.0
        h = 0
        while h + 4 <= hdim:
            r = base + h * numel + j
            a0, a1, a2, a3 = lin[r], lin[r + numel], lin[r + 2 * numel], lin[r + 3 * numel]
            h0, h1, h2, h3 = ht[hoff + h], ht[hoff + h + 1], ht[hoff + h + 2], ht[hoff + h + 3]
            for e in range(n):
                acc[e] += a0 * h0[e] + a1 * h1[e] + a2 * h2[e] + a3 * h3[e]
            h += 4
        for h in range(h, hdim):
            a0, h0 = lin[base + h * numel + j], ht[hoff + h]
            for e in range(n):
                acc[e] += a0 * h0[e]


@numba.njit(parallel=True, **_JIT)
def forward(x, index, sh, hidden, lin, path_x, path_y, path_p, path_c, num_paths, blocks, channels,
            hidden_offsets, hidden_sizes, lin_offsets, weight_numel, max_block, max_width, max_dim_l, tile, out):
    """The products of all outputs, concatenated, into ``out`` ``[E, out_dim]``."""
    num = sh.shape[0]
    tiles = (num + tile - 1) // tile
    for ti in numba.prange(tiles):
        e0 = ti * tile
        n = min(tile, num - e0)
        xt = np.empty((x.shape[1], tile), x.dtype)
        sht = np.empty((sh.shape[1], tile), x.dtype)
        ht = np.empty((hidden.shape[1], tile), x.dtype)
        y = np.empty((num_paths, tile), x.dtype)
        wt = np.empty((max_block, tile), x.dtype)
        z = np.empty((max_dim_l, max_width, tile), x.dtype)
        _load_tile(x, index, sh, hidden, e0, n, xt, sht, ht)
        _paths(n, xt, sht, path_x, path_y, path_p, path_c, y)
        for b in range(blocks.shape[0]):
            t, poff, kdim, dim_l, width, woff, coff = blocks[b]
            _weights(n, ht, hidden_offsets[t], hidden_sizes[t], lin, lin_offsets[t] + woff, weight_numel[t],
                     kdim * width, wt)
            z[:dim_l, :width, :n] = 0.0
            for k in range(kdim):
                for m in range(dim_l):
                    yr = y[poff + k * dim_l + m]
                    for w in range(width):
                        zr, wr = z[m, w], wt[k * width + w]
                        for e in range(n):
                            zr[e] += wr[e] * yr[e]
            for e in range(n):
                for w in range(width):
                    for m in range(dim_l):
                        out[e0 + e, channels[coff + w] + m] = z[m, w, e]


@numba.njit(parallel=True, **_JIT)
def backward(x, index, sh, hidden, lin, grad, path_x, path_y, path_p, path_c, num_paths, blocks, channels,
             hidden_offsets, hidden_sizes, lin_offsets, weight_numel, max_block, max_width, max_dim_l, tile,
             need_inputs, need_hidden, need_lin, gx_edges, gsh, ghidden, glin_groups):
    """Gradients from ``grad`` ``[E, out_dim]``: of the gathered ``x`` per edge, of ``sh`` and ``hidden``
    (written, where needed), and of ``lin`` (summed per group of tiles into ``glin_groups[group]``)."""
    num = sh.shape[0]
    tiles = (num + tile - 1) // tile
    groups = glin_groups.shape[0]
    need_gw = need_hidden or need_lin
    zero = np.zeros(1, x.dtype)[0]  # accumulators in the dtype of the data
    for gi in numba.prange(groups):
        glin = glin_groups[gi]
        glin[:] = 0.0
        xt = np.empty((x.shape[1], tile), x.dtype)
        sht = np.empty((sh.shape[1], tile), x.dtype)
        ht = np.empty((hidden.shape[1], tile), x.dtype)
        y = np.empty((num_paths, tile), x.dtype)
        gy = np.empty((num_paths, tile), x.dtype)
        wt = np.empty((max_block, tile), x.dtype)
        gwt = np.empty((max_block, tile), x.dtype)
        gz = np.empty((max_dim_l, max_width, tile), x.dtype)
        ght = np.empty((hidden.shape[1], tile), x.dtype)
        gxt = np.empty((x.shape[1], tile), x.dtype)
        gsht = np.empty((sh.shape[1], tile), x.dtype)
        for ti in range(gi * tiles // groups, (gi + 1) * tiles // groups):
            e0 = ti * tile
            n = min(tile, num - e0)
            _load_tile(x, index, sh, hidden, e0, n, xt, sht, ht)
            _paths(n, xt, sht, path_x, path_y, path_p, path_c, y)
            gy[:, :n] = 0.0
            ght[:, :n] = 0.0
            for b in range(blocks.shape[0]):
                t, poff, kdim, dim_l, width, woff, coff = blocks[b]
                hoff, hdim, numel, base = hidden_offsets[t], hidden_sizes[t], weight_numel[t], lin_offsets[t] + woff
                size = kdim * width
                for e in range(n):
                    for w in range(width):
                        for m in range(dim_l):
                            gz[m, w, e] = grad[e0 + e, channels[coff + w] + m]
                if need_inputs:  # gy[k, m] = sum_w w[k, w] gz[m, w]
                    _weights(n, ht, hoff, hdim, lin, base, numel, size, wt)
                    for k in range(kdim):
                        for m in range(dim_l):
                            gr = gy[poff + k * dim_l + m]
                            for w in range(width):
                                wr, zr = wt[k * width + w], gz[m, w]
                                for e in range(n):
                                    gr[e] += wr[e] * zr[e]
                if not need_gw:
                    continue
                for k in range(kdim):  # gw[k, w] = sum_m gz[m, w] y[k, m]
                    for w in range(width):
                        gr = gwt[k * width + w]
                        gr[:n] = 0.0
                        for m in range(dim_l):
                            yr, zr = y[poff + k * dim_l + m], gz[m, w]
                            for e in range(n):
                                gr[e] += zr[e] * yr[e]
                if need_hidden:  # gh[h] = sum_j lin[h, j] gw[j]
                    for h in range(hdim):
                        acc, r = ght[hoff + h], base + h * numel
                        j = 0
                        while j + 4 <= size:
                            a0, a1, a2, a3 = lin[r + j], lin[r + j + 1], lin[r + j + 2], lin[r + j + 3]
                            g0, g1, g2, g3 = gwt[j], gwt[j + 1], gwt[j + 2], gwt[j + 3]
                            for e in range(n):
                                acc[e] += a0 * g0[e] + a1 * g1[e] + a2 * g2[e] + a3 * g3[e]
                            j += 4
                        for j in range(j, size):
                            a0, g0 = lin[r + j], gwt[j]
                            for e in range(n):
                                acc[e] += a0 * g0[e]
                if need_lin:  # lin[h, j] += sum_e ht[h, e] gw[j, e]
                    for h in range(hdim):
                        hr, r = ht[hoff + h], base + h * numel
                        for j in range(size):
                            g0 = gwt[j]
                            s = zero
                            for e in range(n):
                                s += hr[e] * g0[e]
                            glin[r + j] += s
            if need_hidden:
                for e in range(n):
                    for h in range(hidden.shape[1]):
                        ghidden[e0 + e, h] = ght[h, e]
            if need_inputs:
                gxt[:, :n] = 0.0
                gsht[:, :n] = 0.0
                for q in range(path_p.shape[0]):
                    c, gr = path_c[q], gy[path_p[q]]
                    xr, sr, gxr, gsr = xt[path_x[q]], sht[path_y[q]], gxt[path_x[q]], gsht[path_y[q]]
                    for e in range(n):
                        g = c * gr[e]
                        gxr[e] += g * sr[e]
                        gsr[e] += g * xr[e]
                for e in range(n):
                    for i in range(x.shape[1]):
                        gx_edges[e0 + e, i] = gxt[i, e]
                    for j in range(sh.shape[1]):
                        gsh[e0 + e, j] = gsht[j, e]

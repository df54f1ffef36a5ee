r"""The numba building blocks shared by the CPU kernels (:mod:`e3attn.kernels.segments`,
:mod:`e3attn.kernels.geometry`, :mod:`e3attn.kernels.softmax_ops`), and how those split their work.

The kernels walk tiles of edges (or nodes) and keep a tile's intermediates in small buffers laid out edges last,
``[features, tile]``, so that every inner loop runs over the edges of the tile, vectorised whatever the irreps.
These are the loops they share: loading and storing a tile (``_load``, gathering rows by an index, and
``_store``), the path features :math:`y = P(x, Y)` of a tile and their gradients (``_paths``,
``_paths_backward``: one multiply-add per non-zero Clebsch-Gordan coefficient), a small matrix product along the
edges (``_mac``) and the sums over the edges of products of rows (``_dots``).

A gradient summed over the edges is accumulated in one buffer per group of work (:data:`GROUPS` groups,
independent of the number of threads) and the groups are summed in order, so results are bitwise repeatable.
The kernels are compiled on first use, once per dtype, and cached on disk by numba (next to their module, or in
numba's per-user cache directory when that is read-only), recompiled when any of their sources changes
(:mod:`e3attn.kernels.numba_cache`).
"""
from __future__ import annotations

from typing import Optional

import numba
import numpy as np
import torch

from . import numba_cache  # noqa: F401  (before any kernel is decorated: the cache follows all their sources)

__all__ = ["GROUPS"]

#: Groups of work with their own buffer for a gradient summed over the edges (load balance on a busy machine,
#: bounded memory).
GROUPS = 8
# no nnan/ninf: NaN and infinities propagate as in PyTorch
_FASTMATH = {"contract", "reassoc", "nsz", "arcp"}
_JIT = dict(nogil=True, cache=True, fastmath=_FASTMATH)


def _array(t: Optional[torch.Tensor]) -> np.ndarray:
    """A contiguous NumPy view of ``t`` (an empty one for None)."""
    return np.empty(0, np.int64) if t is None else t.detach().contiguous().numpy()


def _forward_groups(num: int, tile: int) -> int:
    """Groups of tiles of a pass without a summed gradient: a few per thread (no reduction: any split gives the
    same result)."""
    return max(1, min((num + tile - 1) // tile, 4 * torch.get_num_threads()))


# ------------------------------------------------------------------ building blocks (edges last)


@numba.njit(**_JIT)
def _load(src, index, e0, n, out):
    """``out[:, e] = src[index[e0 + e]]`` (or ``src[e0 + e]`` when ``index`` is empty) for ``e < n``."""
    for e in range(n):
        row = index[e0 + e] if index.shape[0] else e0 + e
        for i in range(src.shape[1]):
            out[i, e] = src[row, i]


@numba.njit(**_JIT)
def _store(src, e0, n, out):
    """``out[e0 + e] = src[:, e]`` for ``e < n``."""
    for e in range(n):
        for i in range(out.shape[1]):
            out[e0 + e, i] = src[i, e]


@numba.njit(**_JIT)
def _paths(n, xt, sht, s, y):
    """Adds the path features of ``xt``, ``sht`` to ``y [paths, tile]``."""
    path_x, path_y, path_p, path_c = s[0], s[1], s[2], s[3]
    for q in range(path_p.shape[0]):
        c, yr, xr, sr = path_c[q], y[path_p[q]], xt[path_x[q]], sht[path_y[q]]
        for e in range(n):
            yr[e] += c * xr[e] * sr[e]


@numba.njit(**_JIT)
def _paths_backward(n, gy, xt, sht, s, gxt, gsht):
    """Adds the gradients of :func:`_paths` for ``gy`` to ``gxt`` and ``gsht``."""
    path_x, path_y, path_p, path_c = s[0], s[1], s[2], s[3]
    for q in range(path_p.shape[0]):
        c, gr = path_c[q], gy[path_p[q]]
        xr, sr, gxr, gsr = xt[path_x[q]], sht[path_y[q]], gxt[path_x[q]], gsht[path_y[q]]
        for e in range(n):
            g = c * gr[e]
            gxr[e] += g * sr[e]
            gsr[e] += g * xr[e]


@numba.njit(**_JIT)
def _mac(out, out_off, n_out, rows, rows_off, n_rows, coef, base, out_stride, row_stride, n):
    """``out[out_off + o, e] += sum_r coef[base + o out_stride + r row_stride] rows[rows_off + r, e]``, ``e < n``.

    A small matrix product, edges last: two output rows and four input rows per pass over the edges."""
    o = 0
    while o + 2 <= n_out:
        c0, c1 = out[out_off + o], out[out_off + o + 1]
        r = 0
        while r + 4 <= n_rows:
            i = base + o * out_stride + r * row_stride
            j = i + out_stride
            a0, a1, a2, a3 = coef[i], coef[i + row_stride], coef[i + 2 * row_stride], coef[i + 3 * row_stride]
            b0, b1, b2, b3 = coef[j], coef[j + row_stride], coef[j + 2 * row_stride], coef[j + 3 * row_stride]
            x0, x1, x2, x3 = rows[rows_off + r], rows[rows_off + r + 1], rows[rows_off + r + 2], rows[rows_off + r + 3]
            for e in range(n):
                v0, v1, v2, v3 = x0[e], x1[e], x2[e], x3[e]
                c0[e] += a0 * v0 + a1 * v1 + a2 * v2 + a3 * v3
                c1[e] += b0 * v0 + b1 * v1 + b2 * v2 + b3 * v3
            r += 4
        for r in range(r, n_rows):
            i = base + o * out_stride + r * row_stride
            a0, b0, x0 = coef[i], coef[i + out_stride], rows[rows_off + r]
            for e in range(n):
                c0[e] += a0 * x0[e]
                c1[e] += b0 * x0[e]
        o += 2
    if o < n_out:  # a lone last output row: four input rows per pass
        c0, i = out[out_off + o], base + o * out_stride
        r = 0
        while r + 4 <= n_rows:
            a0, a1 = coef[i + r * row_stride], coef[i + (r + 1) * row_stride]
            a2, a3 = coef[i + (r + 2) * row_stride], coef[i + (r + 3) * row_stride]
            x0, x1, x2, x3 = rows[rows_off + r], rows[rows_off + r + 1], rows[rows_off + r + 2], rows[rows_off + r + 3]
            for e in range(n):
                c0[e] += a0 * x0[e] + a1 * x1[e] + a2 * x2[e] + a3 * x3[e]
            r += 4
        for r in range(r, n_rows):
            a0, x0 = coef[i + r * row_stride], rows[rows_off + r]
            for e in range(n):
                c0[e] += a0 * x0[e]


@numba.njit(**_JIT)
def _dots(out, base, stride, a, a_off, n_a, b, n_b, n, zero):
    """``out[base + i stride + j] += sum_e a[a_off + i, e] b[j, e]``, ``e < n``: two rows of ``a`` by four rows of
    ``b`` per pass, the last rows of ``b`` one at a time (a lone last row of ``a`` is summed twice, kept once)."""
    i = 0
    while i < n_a:
        a0, a1, two = a[a_off + i], a[a_off + min(i + 1, n_a - 1)], i + 1 < n_a
        r = base + i * stride
        j = 0
        while j + 4 <= n_b:
            b0, b1, b2, b3 = b[j], b[j + 1], b[j + 2], b[j + 3]
            s00 = s01 = s02 = s03 = s10 = s11 = s12 = s13 = zero
            for e in range(n):
                u0, u1, v0, v1, v2, v3 = a0[e], a1[e], b0[e], b1[e], b2[e], b3[e]
                s00 += u0 * v0
                s01 += u0 * v1
                s02 += u0 * v2
                s03 += u0 * v3
                s10 += u1 * v0
                s11 += u1 * v1
                s12 += u1 * v2
                s13 += u1 * v3
            out[r + j] += s00
            out[r + j + 1] += s01
            out[r + j + 2] += s02
            out[r + j + 3] += s03
            if two:
                out[r + stride + j] += s10
                out[r + stride + j + 1] += s11
                out[r + stride + j + 2] += s12
                out[r + stride + j + 3] += s13
            j += 4
        for j in range(j, n_b):
            b0 = b[j]
            s00 = s10 = zero
            for e in range(n):
                v0 = b0[e]
                s00 += a0[e] * v0
                s10 += a1[e] * v0
            out[r + j] += s00
            if two:
                out[r + stride + j] += s10
        i += 2

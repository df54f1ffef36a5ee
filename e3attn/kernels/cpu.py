r"""The fused tensor product on the CPU: numba kernels, one pass over the edges per direction.

Every kernel walks one group of tiles of ``tile`` edges (the groups run in parallel on threads:
the kernels release the GIL) and keeps every intermediate of a tile in small buffers laid out
edges last, ``[features, tile]``, so that every inner loop runs over the edges of the tile,
vectorised whatever the irreps: the gathered inputs,
the path features :math:`y` ``[paths, tile]``, and one output block at a time its weights
:math:`w = L^T h` ``[K W, tile]`` and its output (or gradient) ``[2l+1, W, tile]``. The
``[E, weight_numel]`` weights are never stored and ``x[index]`` is gathered inside.

* :func:`forward`: :math:`z = F(x, Y, h, L)`;
* :func:`backward`: the gradients of :math:`\langle g, F \rangle` with respect to :math:`x, Y, h, L`;
* :func:`backward_backward`: the gradients, with respect to :math:`g, x, Y, h, L`, of
  :math:`\langle g, D F[v] \rangle = \sum_a \langle v_a, \partial_a \langle g, F \rangle \rangle`
  for directions :math:`v` (the backward of the backward, e.g. training on forces).

The gradient of :math:`L` is accumulated in one buffer per group of tiles (a fixed number of groups,
independent of the number of threads) and the groups are summed in order, so results are bitwise
repeatable. Compiled on first use, once per dtype, and cached on disk by numba (next to this file,
or in numba's per-user cache directory when that is read-only).

``structure`` is the tuple of :func:`e3attn.kernels.ops` ``_structure``: the arrays of a
:class:`~e3attn.kernels.layout.KernelLayout` and the sizes of the hidden features and weights.
"""
from __future__ import annotations

import numba
import numpy as np

__all__ = ["forward", "backward", "backward_backward", "GROUPS"]

# groups of tiles with their own weight-gradient buffer (load balance on a busy machine, bounded memory)
GROUPS = 8
# no nnan/ninf: NaN and infinities propagate as in PyTorch
_FASTMATH = {"contract", "reassoc", "nsz", "arcp"}
_JIT = dict(nogil=True, cache=True, fastmath=_FASTMATH)
_INLINE = dict(inline="always", **_JIT)


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
    """``out[base + i stride + j] += sum_e a[a_off + i, e] b[j, e]``, ``e < n``: two by two rows per pass."""
    i = 0
    while i < n_a:
        a0, a1 = a[a_off + i], a[a_off + min(i + 1, n_a - 1)]  # a lone last row is summed twice, kept once
        j = 0
        while j < n_b:
            b0, b1 = b[j], b[min(j + 1, n_b - 1)]
            s00 = s01 = s10 = s11 = zero
            for e in range(n):
                u0, u1, v0, v1 = a0[e], a1[e], b0[e], b1[e]
                s00 += u0 * v0
                s01 += u0 * v1
                s10 += u1 * v0
                s11 += u1 * v1
            r = base + i * stride + j
            out[r] += s00
            if j + 1 < n_b:
                out[r + 1] += s01
            if i + 1 < n_a:
                out[r + stride] += s10
                if j + 1 < n_b:
                    out[r + stride + 1] += s11
            j += 2
        i += 2


@numba.njit(**_JIT)
def _contract(z, wt, y, poff, kdim, dim_l, width, n):
    """``z[m, w, e] += sum_k wt[k W + w, e] y[poff + k (2l+1) + m, e]``: a block's output."""
    for k in range(kdim):
        for m in range(dim_l):
            yr = y[poff + k * dim_l + m]
            for w in range(width):
                zr, wr = z[m, w], wt[k * width + w]
                for e in range(n):
                    zr[e] += wr[e] * yr[e]


@numba.njit(**_JIT)
def _contract_weights(gy, wt, gz, poff, kdim, dim_l, width, n):
    """``gy[poff + k (2l+1) + m, e] += sum_w wt[k W + w, e] gz[m, w, e]``: the gradient of the path features."""
    for k in range(kdim):
        for m in range(dim_l):
            gr = gy[poff + k * dim_l + m]
            for w in range(width):
                wr, zr = wt[k * width + w], gz[m, w]
                for e in range(n):
                    gr[e] += wr[e] * zr[e]


@numba.njit(**_JIT)
def _contract_paths(gwt, gz, y, poff, kdim, dim_l, width, n):
    """``gwt[k W + w, e] = sum_m gz[m, w, e] y[poff + k (2l+1) + m, e]``: the gradient of the weights."""
    for k in range(kdim):
        for w in range(width):
            gr = gwt[k * width + w]
            gr[:n] = 0.0
            for m in range(dim_l):
                yr, zr = y[poff + k * dim_l + m], gz[m, w]
                for e in range(n):
                    gr[e] += zr[e] * yr[e]


@numba.njit(**_INLINE)
def _block(s, b):
    """Block ``b``: ``(poff, K, 2l+1, W, first channel, hidden offset, hidden size, weights base, numel)``."""
    blocks, hidden_offsets, hidden_sizes, lin_offsets, weight_numel = s[5], s[7], s[8], s[9], s[10]
    t, poff, kdim, dim_l, width, woff, coff = blocks[b]
    return (poff, kdim, dim_l, width, coff, hidden_offsets[t], hidden_sizes[t], lin_offsets[t] + woff,
            weight_numel[t])


@numba.njit(**_JIT)
def _grad_block(grad, channels, e0, n, coff, dim_l, width, gz):
    """The output gradient of a block, ``gz [2l+1, W, tile]``."""
    for e in range(n):
        for w in range(width):
            for m in range(dim_l):
                gz[m, w, e] = grad[e0 + e, channels[coff + w] + m]


@numba.njit(**_JIT)
def _tile_inputs(x, index, sh, hidden, s, e0, n, xt, sht, ht, y):
    """A tile's inputs, edges last (``x`` gathered by ``index``), and its path features ``y``."""
    _load(x, index, e0, n, xt)
    _load(sh, index[:0], e0, n, sht)
    _load(hidden, index[:0], e0, n, ht)
    y[:, :n] = 0.0
    _paths(n, xt, sht, s, y)


@numba.njit(**_JIT)
def _buffers(x, sh, hidden, s, tile):
    """A backward's tile buffers: the inputs ``xt, sht, ht``, ``y``, ``gy``, the weights and their
    gradient ``wt, gwt`` ``[K W, tile]``, the output gradient ``gz``, and the gradients ``ght, gxt, gsht``."""
    num_paths, max_block, max_width, max_dim_l = s[4], s[11], s[12], s[13]
    features = (np.zeros((x.shape[1], tile), x.dtype), np.zeros((sh.shape[1], tile), x.dtype),
                np.zeros((hidden.shape[1], tile), x.dtype))
    return (*features, np.empty((num_paths, tile), x.dtype), np.empty((num_paths, tile), x.dtype),
            np.empty((max_block, tile), x.dtype), np.empty((max_block, tile), x.dtype),
            np.empty((max_dim_l, max_width, tile), x.dtype), np.empty((hidden.shape[1], tile), x.dtype),
            np.empty((x.shape[1], tile), x.dtype), np.empty((sh.shape[1], tile), x.dtype))


# ------------------------------------------------------------------ kernels


@numba.njit(**_JIT)
def forward(x, index, sh, hidden, lin, s, tile, gi, groups, out):
    """Group ``gi`` of ``groups`` of the tiles: the products of all outputs, concatenated, into ``out``
    ``[E, out_dim]``."""
    num_paths, max_block, max_width, max_dim_l = s[4], s[11], s[12], s[13]
    tiles = (sh.shape[0] + tile - 1) // tile
    xt = np.empty((x.shape[1], tile), x.dtype)
    sht = np.empty((sh.shape[1], tile), x.dtype)
    ht = np.empty((hidden.shape[1], tile), x.dtype)
    y = np.empty((num_paths, tile), x.dtype)
    wt = np.empty((max_block, tile), x.dtype)
    z = np.empty((max_dim_l, max_width, tile), x.dtype)
    for ti in range(gi * tiles // groups, (gi + 1) * tiles // groups):
        _forward_tile(x, index, sh, hidden, lin, s, tile, ti, out, xt, sht, ht, y, wt, z)


@numba.njit(**_JIT)
def _forward_tile(x, index, sh, hidden, lin, s, tile, ti, out, xt, sht, ht, y, wt, z):
    """Tile ``ti`` of :func:`forward`, in the given buffers."""
    i0, i1 = np.int64(0), np.int64(1)  # not literals: each literal argument compiles another _mac
    channels = s[6]
    e0 = ti * tile
    n = min(tile, sh.shape[0] - e0)
    _tile_inputs(x, index, sh, hidden, s, e0, n, xt, sht, ht, y)
    for b in range(s[5].shape[0]):
        poff, kdim, dim_l, width, coff, hoff, hdim, base, numel = _block(s, b)
        wt[: kdim * width, :n] = 0.0
        _mac(wt, i0, kdim * width, ht, hoff, hdim, lin, base, i1, numel, n)
        z[:dim_l, :width, :n] = 0.0
        _contract(z, wt, y, poff, kdim, dim_l, width, n)
        for e in range(n):
            for w in range(width):
                for m in range(dim_l):
                    out[e0 + e, channels[coff + w] + m] = z[m, w, e]


@numba.njit(**_JIT)
def backward(x, index, sh, hidden, lin, grad, s, tile, need_inputs, need_hidden, need_lin,
             gx_edges, gsh, ghidden, glin_groups, gi):
    """Group ``gi`` of the tiles: the gradients from ``grad`` ``[E, out_dim]`` of the gathered ``x`` per
    edge, of ``sh`` and ``hidden`` (written, where needed), and of ``lin`` (into ``glin_groups[gi]``)."""
    i0, i1 = np.int64(0), np.int64(1)  # not literals: each literal argument compiles another _mac
    channels = s[6]
    num = sh.shape[0]
    tiles = (num + tile - 1) // tile
    groups = glin_groups.shape[0]
    zero = np.zeros(1, x.dtype)[0]  # accumulators in the dtype of the data
    glin = glin_groups[gi]
    glin[:] = 0.0
    xt, sht, ht, y, gy, wt, gwt, gz, ght, gxt, gsht = _buffers(x, sh, hidden, s, tile)
    for ti in range(gi * tiles // groups, (gi + 1) * tiles // groups):
        e0 = ti * tile
        n = min(tile, num - e0)
        _tile_inputs(x, index, sh, hidden, s, e0, n, xt, sht, ht, y)
        gy[:, :n] = 0.0
        ght[:, :n] = 0.0
        for b in range(s[5].shape[0]):
            poff, kdim, dim_l, width, coff, hoff, hdim, base, numel = _block(s, b)
            size = kdim * width
            _grad_block(grad, channels, e0, n, coff, dim_l, width, gz)
            if need_inputs:
                wt[:size, :n] = 0.0
                _mac(wt, i0, size, ht, hoff, hdim, lin, base, i1, numel, n)
                _contract_weights(gy, wt, gz, poff, kdim, dim_l, width, n)
            if need_hidden or need_lin:
                _contract_paths(gwt, gz, y, poff, kdim, dim_l, width, n)
            if need_hidden:  # gh[h, e] += sum_j lin[h, j] gw[j, e]
                _mac(ght, hoff, hdim, gwt, i0, size, lin, base, numel, i1, n)
            if need_lin:  # lin[h, j] += sum_e ht[h, e] gw[j, e]
                _dots(glin, base, numel, ht, hoff, hdim, gwt, size, n, zero)
        if need_hidden:
            _store(ght, e0, n, ghidden)
        if need_inputs:
            gxt[:, :n] = 0.0
            gsht[:, :n] = 0.0
            _paths_backward(n, gy, xt, sht, s, gxt, gsht)
            _store(gxt, e0, n, gx_edges)
            _store(gsht, e0, n, gsh)


@numba.njit(**_JIT)
def backward_backward(x, index, sh, hidden, lin, grad, vx, vsh, vhidden, vlin, s, tile, need_grad,
                      need_inputs, need_hidden, need_lin, ggrad, gx_edges, gsh, ghidden, glin_groups, gi):
    r"""The backward of :func:`backward` for the directions ``vx``, ``vsh``, ``vhidden``, ``vlin`` (each may be
    empty: zero), by the multilinearity of the product:

    .. math::

        \partial_g = F(v_x, Y, h, L) + F(x, v_Y, h, L) + F(x, Y, v_h, L) + F(x, Y, h, v_L)

    and, with :math:`y' = P(v_x, Y) + P(x, v_Y)` and :math:`w' = v_h L + h v_L`,
    :math:`\partial_x = P_x^T(w^T g; v_Y) + P_x^T(w'^T g; Y)` (likewise :math:`Y`),
    :math:`\partial_h = (g \otimes y') L^T + (g \otimes y) v_L^T`,
    :math:`\partial_L = h^T (g \otimes y') + v_h^T (g \otimes y)`. Outputs as in :func:`backward`, and
    ``ggrad`` ``[E, out_dim]``.
    """
    i0, i1 = np.int64(0), np.int64(1)  # not literals: each literal argument compiles another _mac
    channels = s[6]
    num = sh.shape[0]
    tiles = (num + tile - 1) // tile
    groups = glin_groups.shape[0]
    zero = np.zeros(1, x.dtype)[0]
    has_vx, has_vsh, has_vh, has_vlin = vx.shape[0] > 0, vsh.shape[0] > 0, vhidden.shape[0] > 0, vlin.shape[0] > 0
    has_yd, has_wd = has_vx or has_vsh, has_vh or has_vlin
    glin = glin_groups[gi]
    glin[:] = 0.0
    xt, sht, ht, y, gy, wt, gwt, gz, ght, gxt, gsht = _buffers(x, sh, hidden, s, tile)
    vxt, vsht, vht, yd, gyd, wd, _, z, _, _, _ = _buffers(x, sh, hidden, s, tile)  # directions: zero when absent
    for ti in range(gi * tiles // groups, (gi + 1) * tiles // groups):
        e0 = ti * tile
        n = min(tile, num - e0)
        _tile_inputs(x, index, sh, hidden, s, e0, n, xt, sht, ht, y)
        if has_vx:
            _load(vx, index, e0, n, vxt)
        if has_vsh:
            _load(vsh, index[:0], e0, n, vsht)
        if has_vh:
            _load(vhidden, index[:0], e0, n, vht)
        yd[:, :n] = 0.0
        if has_vx:
            _paths(n, vxt, sht, s, yd)
        if has_vsh:
            _paths(n, xt, vsht, s, yd)
        gy[:, :n] = 0.0
        gyd[:, :n] = 0.0
        ght[:, :n] = 0.0
        for b in range(s[5].shape[0]):
            poff, kdim, dim_l, width, coff, hoff, hdim, base, numel = _block(s, b)
            size = kdim * width
            _grad_block(grad, channels, e0, n, coff, dim_l, width, gz)
            if need_grad or (need_inputs and has_yd):  # w = h L
                wt[:size, :n] = 0.0
                _mac(wt, i0, size, ht, hoff, hdim, lin, base, i1, numel, n)
            if has_wd:  # w' = v_h L + h v_L
                wd[:size, :n] = 0.0
                if has_vh:
                    _mac(wd, i0, size, vht, hoff, hdim, lin, base, i1, numel, n)
                if has_vlin:
                    _mac(wd, i0, size, ht, hoff, hdim, vlin, base, i1, numel, n)
            if need_grad:
                z[:dim_l, :width, :n] = 0.0
                if has_yd:
                    _contract(z, wt, yd, poff, kdim, dim_l, width, n)
                if has_wd:
                    _contract(z, wd, y, poff, kdim, dim_l, width, n)
                for e in range(n):
                    for w in range(width):
                        for m in range(dim_l):
                            ggrad[e0 + e, channels[coff + w] + m] = z[m, w, e]
            if need_inputs:
                if has_yd:
                    _contract_weights(gy, wt, gz, poff, kdim, dim_l, width, n)
                if has_wd:
                    _contract_weights(gyd, wd, gz, poff, kdim, dim_l, width, n)
            if (need_hidden or need_lin) and has_yd:  # g (x) y' against L and h
                _contract_paths(gwt, gz, yd, poff, kdim, dim_l, width, n)
                if need_hidden:
                    _mac(ght, hoff, hdim, gwt, i0, size, lin, base, numel, i1, n)
                if need_lin:
                    _dots(glin, base, numel, ht, hoff, hdim, gwt, size, n, zero)
            if (need_hidden and has_vlin) or (need_lin and has_vh):  # g (x) y against v_L and v_h
                _contract_paths(gwt, gz, y, poff, kdim, dim_l, width, n)
                if need_hidden and has_vlin:
                    _mac(ght, hoff, hdim, gwt, i0, size, vlin, base, numel, i1, n)
                if need_lin and has_vh:
                    _dots(glin, base, numel, vht, hoff, hdim, gwt, size, n, zero)
        if need_hidden:
            _store(ght, e0, n, ghidden)
        if need_inputs:
            gxt[:, :n] = 0.0
            gsht[:, :n] = 0.0
            if has_yd:
                _paths_backward(n, gy, vxt, vsht, s, gxt, gsht)
            if has_wd:
                _paths_backward(n, gyd, xt, sht, s, gxt, gsht)
            _store(gxt, e0, n, gx_edges)
            _store(gsht, e0, n, gsh)

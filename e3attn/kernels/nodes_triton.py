r"""The per-node matrices of the node contraction on Triton: :math:`Q_i = E(z_i, L)` and the adjoints of
:math:`E`, for :mod:`e3attn.kernels.segments_triton` (see :class:`~e3attn.node_contraction.NodeContraction` for
the math).

:math:`Q_i` and :math:`U_i` are stored head by head, ``[N, heads, paths, hidden]``: per block of the product (a
degree group of ``kdim`` paths and ``2l+1`` components, ``width`` channels per head), head :math:`a` and component
:math:`m`, the rows ``poff + m kdim + k`` of head :math:`a` hold ``kdim * hidden`` contiguous numbers. Each of the
three products works on those rows, one head at a time, so the radial networks' last layer :math:`L` enters
only through its head's own ``[width, kdim * hidden]`` matrix (no products with the zero blocks between heads):

* ``_expand_kernel``: :math:`Q_i[a, \mathrm{poff} + m K + k, h] = \sum_w z_i[a, w, m]\, L[a, w, h, k]`;
* ``_adjoint_kernel``: :math:`R(U_i, L)[a, w, m] = \sum_{k, h} L[a, w, h, k]\, U_i[a, \mathrm{poff} + m K + k, h]`,
  the adjoint of :math:`E` in :math:`z`;
* ``_node_sum_kernel``: :math:`\sum_i X(U_i, z_i)[a, w, h, k] = \sum_i \sum_m z_i[a, w, m]\,
  U_i[a, \mathrm{poff} + m K + k, h]`, the gradient in :math:`L`: a sum over all nodes split into shares (one
  program per share, head and tile), the shares' sums then added in order (bitwise repeatable).

The first two are small-inner-dimension matrix products per node tile; every program writes only its own
outputs, and each output's sum runs in one fixed order.
"""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Tuple

import numpy as np
import torch
import triton
import triton.language as tl

from .triton_tools import _block, _precision, tuned

__all__ = ["adjoints", "expand"]

BLOCK_W = 16  # channels per step of _expand_kernel's sum (tl.dot's least size)
BLOCK_KH = 64  # numbers of a row per step of _adjoint_kernel's sum


@tuned(["kh_size", "width"], {"BLOCK_N": "num_nodes", "BLOCK_C": "kh_size"},
       [(32, 64, 4), (64, 64, 4), (64, 128, 8), (32, 32, 2), (128, 64, 8)])
@triton.jit
def _expand_kernel(z_ptr, lh_ptr, q_ptr, num_nodes, z_stride, z_off, width, dim_l, kh_size, q_stride, q_head_stride,
                   q_off, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr,
                   PRECISION: tl.constexpr):
    """``q[i, a, m, c] = sum_w z[i, (a, w), m] lh[a, w, c]`` for the nodes of tile ``program_id(0)``, ``(a, m) =
    divmod(program_id(1), dim_l)`` and the columns of tile ``program_id(2)``; ``z[i, (a, w), m]`` at ``z + i
    z_stride + z_off + (a width + w) dim_l + m``, ``lh`` ``[heads, width, kh_size]``, ``q[i, a, m, c]`` at ``q + i
    q_stride + a q_head_stride + q_off + m kh_size + c``."""
    ns = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    head = tl.program_id(1) // dim_l
    m = tl.program_id(1) % dim_l
    cs = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    n_mask = ns < num_nodes
    c_mask = cs < kh_size
    nodes = ns.to(tl.int64)
    acc = tl.zeros((BLOCK_N, BLOCK_C), dtype=q_ptr.dtype.element_ty)
    for w0 in range(0, width, BLOCK_W):
        ws = w0 + tl.arange(0, BLOCK_W)
        w_mask = ws < width
        zt = tl.load(z_ptr + nodes[:, None] * z_stride + z_off + (head * width + ws[None, :]) * dim_l + m,
                     mask=n_mask[:, None] & w_mask[None, :], other=0.0)
        lt = tl.load(lh_ptr + (head * width + ws[:, None]) * kh_size + cs[None, :],
                     mask=w_mask[:, None] & c_mask[None, :], other=0.0)
        acc += tl.dot(zt, lt, input_precision=PRECISION)
    tl.store(q_ptr + nodes[:, None] * q_stride + head * q_head_stride + q_off + m * kh_size + cs[None, :], acc,
             mask=n_mask[:, None] & c_mask[None, :])


@tuned(["kh_size", "width"], {"BLOCK_N": "num_nodes", "BLOCK_W": "width"},
       [(32, 16, 4), (64, 16, 4), (64, 32, 4), (128, 16, 4), (32, 32, 2)])
@triton.jit
def _adjoint_kernel(u_ptr, lh_ptr, out_ptr, num_nodes, u_stride, u_head_stride, u_off, width, dim_l, kh_size,
                    out_stride, out_off, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_KH: tl.constexpr,
                    PRECISION: tl.constexpr):
    """``out[i, (a, w), m] = sum_c u[i, a, m, c] lh[a, w, c]`` for the nodes of tile ``program_id(0)``, ``(a, m)
    = divmod(program_id(1), dim_l)`` and the channels ``w`` of tile ``program_id(2)``; the layouts as in
    ``_expand_kernel`` (``out`` as ``z``)."""
    ns = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    head = tl.program_id(1) // dim_l
    m = tl.program_id(1) % dim_l
    ws = tl.program_id(2) * BLOCK_W + tl.arange(0, BLOCK_W)
    n_mask = ns < num_nodes
    w_mask = ws < width
    nodes = ns.to(tl.int64)
    acc = tl.zeros((BLOCK_N, BLOCK_W), dtype=out_ptr.dtype.element_ty)
    for c0 in range(0, kh_size, BLOCK_KH):
        cs = c0 + tl.arange(0, BLOCK_KH)
        c_mask = cs < kh_size
        ut = tl.load(u_ptr + nodes[:, None] * u_stride + head * u_head_stride + u_off + m * kh_size + cs[None, :],
                     mask=n_mask[:, None] & c_mask[None, :], other=0.0)
        lt = tl.load(lh_ptr + (head * width + ws[None, :]) * kh_size + cs[:, None],
                     mask=c_mask[:, None] & w_mask[None, :], other=0.0)
        acc += tl.dot(ut, lt, input_precision=PRECISION)
    tl.store(out_ptr + nodes[:, None] * out_stride + out_off + (head * width + ws[None, :]) * dim_l + m, acc,
             mask=n_mask[:, None] & w_mask[None, :])


@triton.jit
def _node_sum_kernel(z_ptr, u_ptr, part_ptr, num_nodes, nodes_per_program, z_stride, z_off, width, dim_l, kh_size,
                     u_stride, u_head_stride, u_off, row_tiles, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_C: tl.constexpr, PRECISION: tl.constexpr):
    """``part[s, a, w, c] = sum_i sum_m z[i, (a, w), m] u[i, a, m, c]`` over the nodes ``i`` of share ``s =
    program_id(0)`` (``nodes_per_program`` of them), for head ``a`` and the tile of channels ``w`` given by
    ``program_id(1) = a row_tiles + tile`` and the tile of columns by ``program_id(2)``; the layouts as in
    ``_expand_kernel`` and ``_adjoint_kernel``."""
    share = tl.program_id(0)
    head = tl.program_id(1) // row_tiles
    ws = (tl.program_id(1) % row_tiles) * BLOCK_R + tl.arange(0, BLOCK_R)
    cs = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    w_mask = ws < width
    c_mask = cs < kh_size
    start = share * nodes_per_program
    stop = tl.minimum(start + nodes_per_program, num_nodes)
    acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=part_ptr.dtype.element_ty)
    for n0 in range(start, stop, BLOCK_N):
        ns = n0 + tl.arange(0, BLOCK_N)
        n_mask = ns < stop
        nodes = ns.to(tl.int64)
        for m in range(dim_l):
            zt = tl.load(z_ptr + nodes[:, None] * z_stride + z_off + (head * width + ws[None, :]) * dim_l + m,
                         mask=n_mask[:, None] & w_mask[None, :], other=0.0)
            ut = tl.load(u_ptr + nodes[:, None] * u_stride + head * u_head_stride + u_off + m * kh_size + cs[None, :],
                         mask=n_mask[:, None] & c_mask[None, :], other=0.0)
            acc += tl.dot(tl.trans(zt), ut, input_precision=PRECISION)
    heads = tl.num_programs(1) // row_tiles
    base = part_ptr + (share.to(tl.int64) * heads + head) * width * kh_size
    tl.store(base + ws[:, None] * kh_size + cs[None, :], acc, mask=w_mask[:, None] & c_mask[None, :])


class _Block(NamedTuple):
    """A block of the product (a degree group: ``kdim`` paths, ``dim_l = 2l+1`` components, ``width`` channels
    per head): its rows ``poff : poff + dim_l kdim`` of each head's ``Q_i``, its columns ``zoff : zoff + heads
    width dim_l`` of ``z`` and ``loff`` of ``L``, and ``lh``, the offset of its ``[heads, width, kdim hidden]``
    matrices in :func:`_head_matrices`."""

    poff: int
    kdim: int
    dim_l: int
    width: int
    loff: int
    zoff: int
    lh: int


class _Plan(NamedTuple):
    blocks: Tuple[_Block, ...]
    index: torch.Tensor  # [sum of the blocks' heads width kdim hidden] into L
    uncovered: Tuple[Tuple[int, int], ...]  # rows of each head's Q_i that no block writes (zero)


_PLANS: Dict[Tuple, _Plan] = {}


def _plan(table: List[List[int]], dims: List[int], device: torch.device) -> _Plan:
    """The blocks of ``table`` and the gather that lays out ``L [heads, width, hidden, kdim]`` per block as each
    head's ``Lh[a][w, (k, h)] = L[a, w, h, k]`` (:func:`_head_matrices`)."""
    key = (tuple(map(tuple, table)), tuple(dims), device)
    found = _PLANS.get(key)
    if found is None:
        heads, hidden, paths = dims[:3]
        blocks, parts, covered, offset = [], [], np.zeros(paths, bool), 0
        for poff, kdim, dim_l, width, loff, zoff in table:
            a, w, k, h = np.ix_(*(np.arange(n) for n in (heads, width, kdim, hidden)))
            parts.append((loff + ((a * width + w) * hidden + h) * kdim + k).reshape(-1))  # [a, w, k, h]
            blocks.append(_Block(poff, kdim, dim_l, width, loff, zoff, offset))
            covered[poff : poff + dim_l * kdim] = True
            offset += parts[-1].size
        edges = np.flatnonzero(np.diff(np.concatenate([[1], covered.astype(np.int8), [1]])))
        uncovered = tuple(zip(edges[0::2].tolist(), edges[1::2].tolist()))  # runs of False
        index = torch.as_tensor(np.concatenate(parts) if parts else np.zeros(0, np.int64), device=device)
        found = _PLANS[key] = _Plan(tuple(blocks), index, uncovered)
    return found


def _head_matrices(lt: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """All blocks' ``Lh [heads, width, kdim hidden]`` (see :func:`_plan`), flat, in one gather."""
    return lt.index_select(0, plan.index)


def expand(z: torch.Tensor, lt: torch.Tensor, table: List[List[int]], dims: List[int]) -> torch.Tensor:
    """``Q [N, heads, paths, hidden]``: ``Q[i, a, poff + m K + k, h] = sum_w z[i, (a, w), m] L[a, w, h, k]`` per
    block (``_expand_kernel``), zero in the rows of no block. ``z`` ``[N, z width]`` and ``lt`` contiguous."""
    heads, hidden, paths = dims[:3]
    nodes = z.shape[0]
    plan = _plan(table, dims, z.device)
    q = z.new_empty(nodes, heads, paths, hidden)
    for start, stop in plan.uncovered:
        q[:, :, start:stop] = 0.0
    if nodes == 0:
        return q
    lh = _head_matrices(lt, plan)
    for blk in plan.blocks:
        kh = blk.kdim * hidden

        def grid(meta, blk=blk, kh=kh):
            return triton.cdiv(nodes, meta["BLOCK_N"]), heads * blk.dim_l, triton.cdiv(kh, meta["BLOCK_C"])

        _expand_kernel[grid](z, lh[blk.lh :], q, nodes, z.stride(0), blk.zoff, blk.width, blk.dim_l, kh, q.stride(0),
                             q.stride(1), blk.poff * hidden, BLOCK_W=BLOCK_W, PRECISION=_precision(z.dtype))
    return q


_SUM_PROGRAMS = 1024  # about as many programs of _node_sum_kernel: a few per multiprocessor
_SUM_BLOCK_N = 32  # nodes per step of _node_sum_kernel (tl.dot's inner size)


def _node_sum(z: torch.Tensor, u: torch.Tensor, blk: _Block, hidden: int) -> torch.Tensor:
    """The block's ``G[a, w, (k, h)] = sum_i sum_m z[i, (a, w), m] U[i, a, poff + m K + k, h]`` ``[heads, width,
    kdim hidden]`` (``_node_sum_kernel``; cuBLAS runs such a product, of a long inner dimension and a small
    result, on a few programs)."""
    nodes, heads = u.shape[:2]
    kh = blk.kdim * hidden
    block_r, block_c = _block(blk.width, 16, 32), _block(kh, 16, 64)
    row_tiles = triton.cdiv(blk.width, block_r)
    tiles = (heads * row_tiles, triton.cdiv(kh, block_c))
    shares = max(1, min(triton.cdiv(nodes, _SUM_BLOCK_N), triton.cdiv(_SUM_PROGRAMS, tiles[0] * tiles[1])))
    per_share = triton.cdiv(triton.cdiv(nodes, shares), _SUM_BLOCK_N) * _SUM_BLOCK_N
    shares = triton.cdiv(nodes, per_share)
    part = z.new_empty(shares, heads, blk.width, kh)
    _node_sum_kernel[(shares,) + tiles](
        z, u, part, nodes, per_share, z.stride(0), blk.zoff, blk.width, blk.dim_l, kh, u.stride(0), u.stride(1),
        blk.poff * hidden, row_tiles, BLOCK_N=_SUM_BLOCK_N, BLOCK_R=block_r, BLOCK_C=block_c,
        PRECISION=_precision(z.dtype))
    return part.sum(0)


def adjoints(u: torch.Tensor, lt: Optional[torch.Tensor], z: Optional[torch.Tensor], table: List[List[int]],
             dims: List[int]) -> Tuple[torch.Tensor, torch.Tensor]:
    """From ``U [N, heads, paths, hidden]``: ``R(U, L) [N, z width]`` (if ``lt``, ``_adjoint_kernel``) and ``sum_i
    X(U_i, z_i) [L size]`` (if ``z``, ``_node_sum_kernel``), each empty otherwise; zero where no block is (as
    numba's). ``lt`` and ``z`` contiguous."""
    heads, hidden, _, zwidth, lsize = dims
    nodes = u.shape[0]
    plan = _plan(table, dims, u.device)
    out = u.new_zeros(nodes if lt is not None else 0, zwidth)
    glt = u.new_zeros(lsize if z is not None else 0)
    if nodes == 0:
        return out, glt
    lh = _head_matrices(lt, plan) if lt is not None else None
    for blk in plan.blocks:
        kh = blk.kdim * hidden
        if lt is not None:
            def grid(meta, blk=blk):
                return triton.cdiv(nodes, meta["BLOCK_N"]), heads * blk.dim_l, triton.cdiv(blk.width, meta["BLOCK_W"])

            _adjoint_kernel[grid](u, lh[blk.lh :], out, nodes, u.stride(0), u.stride(1), blk.poff * hidden,
                                  blk.width, blk.dim_l, kh, out.stride(0), blk.zoff, BLOCK_KH=BLOCK_KH,
                                  PRECISION=_precision(u.dtype))
        if z is not None:  # [a, w, (k, h)] into L's [a, w, h, k]
            g = _node_sum(z, u, blk, hidden).view(heads, blk.width, blk.kdim, hidden)
            size = heads * blk.width * hidden * blk.kdim
            glt[blk.loff : blk.loff + size].view(heads, blk.width, hidden, blk.kdim).copy_(g.transpose(2, 3))
    return out, glt

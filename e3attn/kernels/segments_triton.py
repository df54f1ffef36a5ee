r"""The attention's node contraction on Triton: the backend of :mod:`e3attn.kernels.segment_ops` for CUDA tensors.

The same outputs as :func:`e3attn.kernels.segments.node_pass` (see
:class:`~e3attn.node_contraction.NodeContraction` for the math), computed in three kinds of steps:

* per node, the matrices :math:`Q_i = E(z_i, L)`, stored ``[N, paths, heads * hidden]``, and from :math:`U_i` (the
  same layout) the adjoints :math:`R(U_i, L)` and :math:`\sum_i X(U_i, z_i)`: per block of the product one batched
  matrix product on cuBLAS with the head-block-diagonal matrix of :math:`L` (``_plan``), reading and writing
  the block's rows of :math:`Q` or :math:`U` in place (views: no copy of them), never per edge;
* per node and its incoming edges ``rowptr[i]:rowptr[i + 1]`` (the CSR layout of the destination-sorted
  edges), ``_segment_rows_kernel``: :math:`t_e = y_e Q_i` or :math:`r_e = a_e Q_i^T`, one program per node and
  chunk of output columns streaming the node's edges through ``tl.dot``;
* ``_segment_outer_kernel``: :math:`U_i = \sum_{e \to i} y_e^T a_e`, one program per node and tile of
  :math:`U_i`.

No per-edge weights, keys or values are formed: per edge only the path features :math:`y_e`
(:mod:`e3attn.kernels.paths_triton`). Every program writes only its own rows, so the node contraction has no
atomic additions.

Products run in IEEE float32 (or float64): TF32 only where ``torch.backends.cuda.matmul.allow_tf32`` asks for
it, for these kernels as for cuBLAS. With ``TRITON_INTERPRET=1`` set before Triton is first imported, the same
kernels run on CPU tensors in Triton's interpreter (``E3ATTN_KERNEL_BACKEND=triton``): how the tests check them
without a GPU.
"""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch
import triton
import triton.language as tl

from .._env import env_flag

__all__ = ["node_pass"]

BLOCK_E = 16  # edges per step of a node's segment (tl.dot's least size; most nodes have 10-40 edges)


@triton.jit
def _segment_rows_kernel(a_ptr, m_ptr, rowptr_ptr, out_ptr, k_size, c_size, m_node_stride, m_stride_k, m_stride_c,
                         BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
                         PRECISION: tl.constexpr):
    """``out[e, c] = sum_k a[e, k] M_i[k, c]`` for the edges ``e`` of node ``i = program_id(0)``, columns of chunk
    ``program_id(1)``, with ``M_i[k, c]`` at ``m + i m_node_stride + k m_stride_k + c m_stride_c``."""
    node = tl.program_id(0)
    start = tl.load(rowptr_ptr + node)
    stop = tl.load(rowptr_ptr + node + 1)
    cs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = cs < c_size
    m_base = m_ptr + node.to(tl.int64) * m_node_stride
    for e0 in range(start, stop, BLOCK_E):
        es = e0 + tl.arange(0, BLOCK_E)
        e_mask = es < stop
        rows = es.to(tl.int64)
        acc = tl.zeros((BLOCK_E, BLOCK_C), dtype=out_ptr.dtype.element_ty)
        for k0 in range(0, k_size, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < k_size
            a = tl.load(a_ptr + rows[:, None] * k_size + ks[None, :], mask=e_mask[:, None] & k_mask[None, :],
                        other=0.0)
            m = tl.load(m_base + ks[:, None] * m_stride_k + cs[None, :] * m_stride_c,
                        mask=k_mask[:, None] & c_mask[None, :], other=0.0)
            acc += tl.dot(a, m, input_precision=PRECISION)
        tl.store(out_ptr + rows[:, None] * c_size + cs[None, :], acc, mask=e_mask[:, None] & c_mask[None, :])


@triton.jit
def _segment_outer_kernel(a_ptr, y_ptr, rowptr_ptr, u_ptr, j_size, p_size, BLOCK_E: tl.constexpr,
                          BLOCK_J: tl.constexpr, BLOCK_P: tl.constexpr, PRECISION: tl.constexpr):
    """``U[i, p, j] = sum_{e -> i} y[e, p] a[e, j]`` for node ``i = program_id(0)`` and the tile
    ``(program_id(1), program_id(2))`` of its ``[P, J]`` (zero for a node without edges)."""
    node = tl.program_id(0)
    start = tl.load(rowptr_ptr + node)
    stop = tl.load(rowptr_ptr + node + 1)
    ps = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    js = tl.program_id(2) * BLOCK_J + tl.arange(0, BLOCK_J)
    j_mask = js < j_size
    p_mask = ps < p_size
    acc = tl.zeros((BLOCK_P, BLOCK_J), dtype=u_ptr.dtype.element_ty)
    for e0 in range(start, stop, BLOCK_E):
        es = e0 + tl.arange(0, BLOCK_E)
        e_mask = es < stop
        rows = es.to(tl.int64)
        y = tl.load(y_ptr + rows[:, None] * p_size + ps[None, :], mask=e_mask[:, None] & p_mask[None, :], other=0.0)
        a = tl.load(a_ptr + rows[:, None] * j_size + js[None, :], mask=e_mask[:, None] & j_mask[None, :], other=0.0)
        acc += tl.dot(tl.trans(y), a, input_precision=PRECISION)
    base = u_ptr + node.to(tl.int64) * p_size * j_size
    tl.store(base + ps[:, None] * j_size + js[None, :], acc, mask=p_mask[:, None] & j_mask[None, :])


def _precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision: IEEE unless float32 products may use TF32 (PyTorch's own switch)."""
    return "tf32" if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 else "ieee"


def _block(n: int, least: int, most: int) -> int:
    return max(least, min(most, triton.next_power_of_2(max(n, 1))))


def _interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1`` when it was imported)."""
    knobs = getattr(triton, "knobs", None)  # Triton >= 3.4
    return bool(knobs.runtime.interpret) if knobs is not None else env_flag("TRITON_INTERPRET", False)


def _check_interpretable(t: torch.Tensor) -> None:
    if t.device.type == "cpu" and not _interpreting():
        raise RuntimeError("the Triton kernels run CPU tensors only in Triton's interpreter: set TRITON_INTERPRET=1 "
                           "before importing e3attn (E3ATTN_KERNEL_BACKEND=triton does so where there is no GPU)")


def _segment_rows(a: torch.Tensor, m: torch.Tensor, rowptr: torch.Tensor, over_paths: bool) -> torch.Tensor:
    """For ``M [N, P, J]`` and the edges ``e -> i``: ``out[e] = a[e] @ M_i`` (``over_paths``: ``a [E, P]``,
    ``out [E, J]``) or ``out[e] = a[e] @ M_i^T`` (``a [E, J]``, ``out [E, P]``)."""
    nodes, paths, cols = m.shape
    k_size, c_size = (paths, cols) if over_paths else (cols, paths)
    stride_k, stride_c = (cols, 1) if over_paths else (1, cols)
    out = a.new_empty(a.shape[0], c_size)
    if out.numel() == 0:
        return out
    block_c, block_k = _block(c_size, 16, 64), _block(k_size, 16, 64)
    _segment_rows_kernel[(nodes, triton.cdiv(c_size, block_c))](
        a, m, rowptr, out, k_size, c_size, paths * cols, stride_k, stride_c, BLOCK_E=BLOCK_E, BLOCK_K=block_k,
        BLOCK_C=block_c, PRECISION=_precision(a.dtype))
    return out


def _segment_outer(a: torch.Tensor, y: torch.Tensor, rowptr: torch.Tensor) -> torch.Tensor:
    """``U [N, P, J]``: ``U_i = sum_{e -> i} y_e^T a_e``."""
    nodes, j_size, p_size = rowptr.shape[0] - 1, a.shape[1], y.shape[1]
    u = y.new_empty(nodes, p_size, j_size)
    if u.numel() == 0:
        return u
    block_j, block_p = _block(j_size, 16, 64), _block(p_size, 16, 64)
    _segment_outer_kernel[(nodes, triton.cdiv(p_size, block_p), triton.cdiv(j_size, block_j))](
        a, y, rowptr, u, j_size, p_size, BLOCK_E=BLOCK_E, BLOCK_J=block_j, BLOCK_P=block_p,
        PRECISION=_precision(y.dtype))
    return u


# ------------------------------------------------------------------ per node: E(z, L) and its adjoints, per block


class _Block(NamedTuple):
    """A block of the product (a degree group: ``kdim`` paths, ``dim_l = 2l+1`` components, ``width`` channels
    per head) as the node matrices see it: its rows ``poff : poff + dim_l kdim`` of ``Q_i [P, J]``, its columns
    ``zoff : zoff + heads width dim_l`` of ``z`` and ``loff`` of ``L``, and ``lbd``, the offset of its
    ``[heads width, kdim J]`` matrix in :func:`_head_matrices`."""

    poff: int
    kdim: int
    dim_l: int
    width: int
    loff: int
    zoff: int
    lbd: int


class _Plan(NamedTuple):
    blocks: Tuple[_Block, ...]
    index: torch.Tensor  # [sum of the blocks' heads width kdim J] into L and one zero after it
    uncovered: Tuple[Tuple[int, int], ...]  # rows of Q_i that no block writes (zero)


_PLANS: Dict[Tuple, _Plan] = {}


def _plan(table: List[List[int]], dims: List[int], device: torch.device) -> _Plan:
    """The blocks of ``table`` and the gather that lays out ``L`` per block as the head-block-diagonal matrices
    ``Lb[(a, w), (k, a', h)] = [a = a'] L[a, w, h, k]`` (:func:`_head_matrices`)."""
    key = (tuple(map(tuple, table)), tuple(dims), device)
    found = _PLANS.get(key)
    if found is None:
        heads, hidden, paths, _, lsize = dims
        blocks, parts, covered, offset = [], [], np.zeros(paths, bool), 0
        for poff, kdim, dim_l, width, loff, zoff in table:
            a, w, k, b, h = np.ix_(*(np.arange(n) for n in (heads, width, kdim, heads, hidden)))
            index = loff + ((a * width + w) * hidden + h) * kdim + k  # [a, w, k, a', h]
            parts.append(np.where(a == b, index, lsize).reshape(-1))  # lsize: the zero appended to L
            blocks.append(_Block(poff, kdim, dim_l, width, loff, zoff, offset))
            covered[poff : poff + dim_l * kdim] = True
            offset += parts[-1].size
        edges = np.flatnonzero(np.diff(np.concatenate([[1], covered.astype(np.int8), [1]])))
        uncovered = tuple(zip(edges[0::2].tolist(), edges[1::2].tolist()))  # runs of False
        index = torch.as_tensor(np.concatenate(parts) if parts else np.zeros(0, np.int64), device=device)
        found = _PLANS[key] = _Plan(tuple(blocks), index, uncovered)
    return found


def _head_matrices(lt: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """All blocks' ``Lb [heads width, kdim J]`` (see :func:`_plan`), flat, in one gather."""
    return torch.cat([lt, lt.new_zeros(1)]).index_select(0, plan.index)


def _views(blk: _Block, dims: List[int], lbd: Optional[torch.Tensor], z: Optional[torch.Tensor]):
    """The block's ``Lb [heads width, kdim J]`` and ``z_b [N, heads width, 2l+1]`` (None where not given)."""
    heads, hidden = dims[:2]
    rows, cols = heads * blk.width, blk.kdim * heads * hidden
    lb = lbd[blk.lbd : blk.lbd + rows * cols].view(rows, cols) if lbd is not None else None
    zb = z[:, blk.zoff : blk.zoff + rows * blk.dim_l].unflatten(1, (rows, blk.dim_l)) if z is not None else None
    return lb, zb


def _rows(m: torch.Tensor, blk: _Block) -> torch.Tensor:
    """The block's rows of ``M [N, P, J]`` as ``[N, 2l+1, kdim J]`` (a view)."""
    return m[:, blk.poff : blk.poff + blk.dim_l * blk.kdim].unflatten(1, (blk.dim_l, -1)).flatten(2)


def _expand(z: torch.Tensor, lt: torch.Tensor, table: List[List[int]], dims: List[int]) -> torch.Tensor:
    """``Q [N, P, J]``: ``Q[i, poff + m K + k, a H + h] = sum_w z[i, a, w, m] L[a, w, h, k]``, per block one
    matrix product per component ``m`` (``[N, heads width] @ Lb``, batched over ``m``) written in place into its
    rows of ``Q``."""
    heads, hidden, paths = dims[:3]
    plan = _plan(table, dims, z.device)
    q = z.new_empty(z.shape[0], paths, heads * hidden)
    for start, stop in plan.uncovered:
        q[:, start:stop] = 0.0
    lbd = _head_matrices(lt, plan)
    for blk in plan.blocks:  # batched over the components m: [N, heads width] @ Lb per m, into Q's rows in place
        lb, zb = _views(blk, dims, lbd, z)
        torch.bmm(zb.permute(2, 0, 1), lb.expand(blk.dim_l, -1, -1), out=_rows(q, blk).transpose(0, 1))
    return q


def _adjoints(u: torch.Tensor, lt: Optional[torch.Tensor], z: Optional[torch.Tensor], table: List[List[int]],
              dims: List[int]) -> Tuple[torch.Tensor, torch.Tensor]:
    """From ``U [N, P, J]``: ``R(U, L) [N, z width]`` (if ``lt``) and ``sum_i X(U_i, z_i) [L size]`` (if ``z``),
    each empty otherwise; per block batched matrix products on views of ``U`` (no copy of it)."""
    heads, hidden, _, zwidth, lsize = dims
    nodes = u.shape[0]
    plan = _plan(table, dims, u.device)
    out = u.new_zeros(nodes if lt is not None else 0, zwidth)  # zero where no block is (as numba's)
    glt = u.new_zeros(lsize if z is not None else 0)
    lbd = _head_matrices(lt, plan) if lt is not None else None
    for blk in plan.blocks:
        ub = _rows(u, blk)  # [N, 2l+1, K J]
        lb, zb = _views(blk, dims, lbd, z)
        rows = heads * blk.width
        if lt is not None:  # out[i, (a, w), m] = sum_(k, a', h) Lb[(a, w), (k, a', h)] U_i[m, (k, a', h)]
            r = torch.bmm(ub.transpose(0, 1), lb.t().expand(blk.dim_l, -1, -1))  # [2l+1, N, heads width]
            out[:, blk.zoff : blk.zoff + rows * blk.dim_l].unflatten(1, (rows, blk.dim_l)).copy_(r.permute(1, 2, 0))
        if z is not None:  # sum over nodes and m of z_i[(a, w), m] U_i[m, (k, a', h)], then its a = a' blocks
            g = torch.bmm(zb.permute(2, 1, 0), ub.transpose(0, 1)).sum(0)  # [heads width, K J]
            g = torch.diagonal(g.view(heads, blk.width, blk.kdim, heads, hidden), dim1=0, dim2=3)  # [w, k, h, a]
            size = heads * blk.width * hidden * blk.kdim
            glt[blk.loff : blk.loff + size].view(heads, blk.width, hidden, blk.kdim).copy_(g.permute(3, 0, 2, 1))
    return out, glt


def node_pass(y: Optional[torch.Tensor], a: Optional[torch.Tensor], z: Optional[torch.Tensor],
              lt: Optional[torch.Tensor], table: List[List[int]], rowptr: torch.Tensor, dims: List[int],
              needs: Sequence[bool]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""The outputs of :func:`e3attn.kernels.segments.node_pass` flagged in ``needs`` (the others empty):
    :math:`t = D(y, Q)` ``[E, heads * hidden]``, :math:`r = C(a, Q)` ``[E, paths]``, :math:`R(U, L)`
    ``[N, z width]`` and :math:`\sum_i X(U_i, z_i)` ``[L size]``, with :math:`Q_i = E(z_i, L)` and
    :math:`U_i = \sum_{e \to i} a_e^T y_e`, both stored ``[N, paths, heads * hidden]``. ``table`` is the block
    table as Python integers; the arguments are checked by the caller (:mod:`e3attn.kernels.segment_ops`)."""
    need_t, need_r, need_o, need_g = needs
    ref = next(t for t in (y, a, z) if t is not None)
    _check_interpretable(ref)
    heads, hidden, paths = dims[:3]
    num = y.shape[0] if y is not None else a.shape[0]
    a = a.reshape(num, heads * hidden).contiguous() if a is not None else None
    y = y.contiguous() if y is not None else None
    empty = ref.new_empty(0)
    t = r = o = g = empty
    if need_t or need_r:
        q = _expand(z.contiguous(), lt.contiguous(), table, dims)
        t = _segment_rows(y, q, rowptr, over_paths=True) if need_t else ref.new_empty(0, heads * hidden)
        r = _segment_rows(a, q, rowptr, over_paths=False) if need_r else ref.new_empty(0, paths)
    if need_o or need_g:
        u = _segment_outer(a, y, rowptr)
        o, g = _adjoints(u, lt.contiguous() if need_o else None, z.contiguous() if need_g else None, table, dims)
    return (t if need_t else ref.new_empty(0, heads * hidden), r if need_r else ref.new_empty(0, paths),
            o if need_o else ref.new_empty(0, dims[3]), g if need_g else empty)

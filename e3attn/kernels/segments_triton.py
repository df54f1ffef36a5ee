r"""The attention's node contraction on Triton: the backend of :mod:`e3attn.kernels.segment_ops` for CUDA tensors.

The same outputs as :func:`e3attn.kernels.segments.node_pass` (see
:class:`~e3attn.node_contraction.NodeContraction` for the math), computed in two kinds of steps:

* per node, the matrices :math:`Q_i = E(z_i, L)`, and from :math:`U_i` the adjoints :math:`R(U_i, L)` and
  :math:`\sum_i X(U_i, z_i)`, both stored head by head, ``[N, heads, paths, hidden]``
  (:mod:`e3attn.kernels.nodes_triton`), never per edge;
* per node and its incoming edges ``rowptr[i]:rowptr[i + 1]`` (the CSR layout of the destination-sorted
  edges), ``_segment_rows_kernel``: :math:`t_e = y_e Q_i` or :math:`r_e = a_e Q_i^T`, one program per node and
  chunk of output columns streaming the node's edges through ``tl.dot``; ``_segment_outer_kernel``:
  :math:`U_i = \sum_{e \to i} y_e^T a_e`, one program per node and tile of :math:`U_i`.

No per-edge weights, keys or values are formed: per edge only the path features :math:`y_e`
(:mod:`e3attn.kernels.paths_triton`). Every program writes only its own rows, so the node contraction has no
atomic additions. On a GPU the kernels choose their tiles and warps by timing at their first call per shape
(:func:`~e3attn.kernels.triton_tools.tuned`; ``E3ATTN_TRITON_AUTOTUNE=0``: the first choice).

Products run in IEEE float32 (or float64): TF32 only where ``torch.backends.cuda.matmul.allow_tf32`` asks for
it, for these kernels as for cuBLAS. With ``TRITON_INTERPRET=1`` set before Triton is first imported, the same
kernels run on CPU tensors in Triton's interpreter (``E3ATTN_KERNEL_BACKEND=triton``): how the tests check them
without a GPU.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from . import nodes_triton
from .triton_tools import _block, _check_interpretable, _precision, tuned

__all__ = ["node_pass"]

BLOCK_E = 16  # edges per step of a node's segment (tl.dot's least size; most nodes have 10-40 edges)


@tuned(["k_size", "c_size", "OVER_PATHS"], {"BLOCK_C": "c_size"},
       [(64, 4), (32, 2), (32, 4), (64, 2), (128, 4), (128, 8)])
@triton.jit
def _segment_rows_kernel(a_ptr, m_ptr, rowptr_ptr, out_ptr, k_size, c_size, m_node_stride, hidden, head_stride,
                         BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
                         OVER_PATHS: tl.constexpr, PRECISION: tl.constexpr):
    """``out[e, c] = sum_k a[e, k] M_i[k, c]`` for the edges ``e`` of node ``i = program_id(0)``, columns of chunk
    ``program_id(1)``, with ``M_i`` node ``i`` of ``M [N, heads, P, hidden]`` as a ``[P, J]`` matrix
    (``OVER_PATHS``: ``k`` a path, ``c = (a, h)``) or its ``[J, P]`` transpose."""
    node = tl.program_id(0)
    start = tl.load(rowptr_ptr + node)
    stop = tl.load(rowptr_ptr + node + 1)
    cs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = cs < c_size
    if OVER_PATHS:
        c_off = (cs // hidden) * head_stride + cs % hidden
    else:
        c_off = cs * hidden
    m_base = m_ptr + node.to(tl.int64) * m_node_stride
    for e0 in range(start, stop, BLOCK_E):
        es = e0 + tl.arange(0, BLOCK_E)
        e_mask = es < stop
        rows = es.to(tl.int64)
        acc = tl.zeros((BLOCK_E, BLOCK_C), dtype=out_ptr.dtype.element_ty)
        for k0 in range(0, k_size, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < k_size
            if OVER_PATHS:
                k_off = ks * hidden
            else:
                k_off = (ks // hidden) * head_stride + ks % hidden
            a = tl.load(a_ptr + rows[:, None] * k_size + ks[None, :], mask=e_mask[:, None] & k_mask[None, :],
                        other=0.0)
            m = tl.load(m_base + k_off[:, None] + c_off[None, :], mask=k_mask[:, None] & c_mask[None, :], other=0.0)
            acc += tl.dot(a, m, input_precision=PRECISION)
        tl.store(out_ptr + rows[:, None] * c_size + cs[None, :], acc, mask=e_mask[:, None] & c_mask[None, :])


@tuned(["j_size", "p_size"], {"BLOCK_J": "j_size", "BLOCK_P": "p_size"},
       [(64, 64, 4), (32, 32, 2), (32, 64, 4), (64, 128, 8), (128, 64, 8), (128, 128, 8)])
@triton.jit
def _segment_outer_kernel(a_ptr, y_ptr, rowptr_ptr, u_ptr, j_size, p_size, hidden, BLOCK_E: tl.constexpr,
                          BLOCK_J: tl.constexpr, BLOCK_P: tl.constexpr, PRECISION: tl.constexpr):
    """``U[i, a, p, h] = sum_{e -> i} y[e, p] a[e, (a, h)]`` for node ``i = program_id(0)`` and the tile
    ``(program_id(1), program_id(2))`` of its ``[P, J]`` (zero for a node without edges), ``U`` ``[N, heads, P,
    hidden]``."""
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
    offsets = (js[None, :] // hidden) * p_size * hidden + ps[:, None] * hidden + js[None, :] % hidden
    tl.store(base + offsets, acc, mask=p_mask[:, None] & j_mask[None, :])


def _segment_rows(a: torch.Tensor, m: torch.Tensor, rowptr: torch.Tensor, over_paths: bool) -> torch.Tensor:
    """For ``M [N, heads, P, hidden]`` (node ``i``'s as a ``[P, J]`` matrix ``M_i``) and the edges ``e -> i``:
    ``out[e] = a[e] @ M_i`` (``over_paths``: ``a [E, P]``, ``out [E, J]``) or ``out[e] = a[e] @ M_i^T`` (``a [E,
    J]``, ``out [E, P]``)."""
    nodes, heads, paths, hidden = m.shape
    k_size, c_size = (paths, heads * hidden) if over_paths else (heads * hidden, paths)
    out = a.new_empty(a.shape[0], c_size)
    if out.numel() == 0:
        return out
    _segment_rows_kernel[lambda meta: (nodes, triton.cdiv(c_size, meta["BLOCK_C"]))](
        a, m, rowptr, out, k_size, c_size, m.stride(0), hidden, m.stride(1), BLOCK_E=BLOCK_E,
        BLOCK_K=_block(k_size, 16, 64), OVER_PATHS=over_paths, PRECISION=_precision(a.dtype))
    return out


def _segment_outer(a: torch.Tensor, y: torch.Tensor, rowptr: torch.Tensor, heads: int) -> torch.Tensor:
    """``U [N, heads, P, hidden]``: ``U_i = sum_{e -> i} y_e^T a_e`` (as ``[P, J]`` matrices)."""
    nodes, j_size, p_size = rowptr.shape[0] - 1, a.shape[1], y.shape[1]
    u = y.new_empty(nodes, heads, p_size, j_size // heads)
    if u.numel() == 0:
        return u

    def grid(meta):
        return nodes, triton.cdiv(p_size, meta["BLOCK_P"]), triton.cdiv(j_size, meta["BLOCK_J"])

    _segment_outer_kernel[grid](a, y, rowptr, u, j_size, p_size, j_size // heads, BLOCK_E=BLOCK_E,
                                PRECISION=_precision(y.dtype))
    return u


def node_pass(y: Optional[torch.Tensor], a: Optional[torch.Tensor], z: Optional[torch.Tensor],
              lt: Optional[torch.Tensor], table: List[List[int]], rowptr: torch.Tensor, dims: List[int],
              needs: Sequence[bool]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""The outputs of :func:`e3attn.kernels.segments.node_pass` flagged in ``needs`` (the others empty):
    :math:`t = D(y, Q)` ``[E, heads * hidden]``, :math:`r = C(a, Q)` ``[E, paths]``, :math:`R(U, L)`
    ``[N, z width]`` and :math:`\sum_i X(U_i, z_i)` ``[L size]``, with :math:`Q_i = E(z_i, L)` and
    :math:`U_i = \sum_{e \to i} a_e^T y_e`, both stored ``[N, heads, paths, hidden]``. ``table`` is the block
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
        q = nodes_triton.expand(z.contiguous(), lt.contiguous(), table, dims)
        t = _segment_rows(y, q, rowptr, over_paths=True) if need_t else ref.new_empty(0, heads * hidden)
        r = _segment_rows(a, q, rowptr, over_paths=False) if need_r else ref.new_empty(0, paths)
    if need_o or need_g:
        u = _segment_outer(a, y, rowptr, heads)
        o, g = nodes_triton.adjoints(u, lt.contiguous() if need_o else None, z.contiguous() if need_g else None,
                                     table, dims)
    return (t if need_t else ref.new_empty(0, heads * hidden), r if need_r else ref.new_empty(0, paths),
            o if need_o else ref.new_empty(0, dims[3]), g if need_g else empty)

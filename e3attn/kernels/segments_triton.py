r"""The attention's node contraction on Triton: the backend of :mod:`e3attn.kernels.segment_ops` for CUDA tensors.

The same outputs as :func:`e3attn.kernels.segments.node_pass` (see
:class:`~e3attn.node_contraction.NodeContraction` for the math), computed in three kinds of steps:

* per node, the matrices :math:`Q_i = E(z_i, L)` ``[heads * hidden, paths]``, and from :math:`U_i` the adjoints
  :math:`R(U_i, L)` and :math:`\sum_i X(U_i, z_i)`: one batched matrix product per block of the product
  (``torch.einsum``, on cuBLAS), never per edge;
* per node and its incoming edges ``rowptr[i]:rowptr[i + 1]`` (the CSR layout of the destination-sorted
  edges), ``_segment_rows_kernel``: :math:`t_e = y_e Q_i^T` or :math:`r_e = a_e Q_i`, one program per node and
  chunk of output columns streaming the node's edges through ``tl.dot``;
* ``_segment_outer_kernel``: :math:`U_i = \sum_{e \to i} a_e^T y_e`, one program per node and tile of
  :math:`U_i`.

No per-edge weights, keys or values are formed: per edge only the path features :math:`y_e` (in the
component-major layout of :func:`~e3attn.kernels.layout.component_major_paths`), computed with the
Clebsch-Gordan sums of ``_coefficients_kernel``, one program per tile of edges. Every program writes only its own
rows, so the node contraction has no atomic additions; the gradient of the gathered features sums per
source with ``index_add_``.

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
from .layout import component_major_paths, layout_for

__all__ = ["node_pass", "path_features", "path_features_backward"]

BLOCK_E = 16  # edges per step of a node's segment (tl.dot's least size; most nodes have 10-40 edges)
_PATH_TILE = 128  # edges per program of the Clebsch-Gordan sums


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
    """``U[i, j, p] = sum_{e -> i} a[e, j] y[e, p]`` for node ``i = program_id(0)`` and the tile
    ``(program_id(1), program_id(2))`` of its ``[J, P]`` (zero for a node without edges)."""
    node = tl.program_id(0)
    start = tl.load(rowptr_ptr + node)
    stop = tl.load(rowptr_ptr + node + 1)
    js = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    ps = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    j_mask = js < j_size
    p_mask = ps < p_size
    acc = tl.zeros((BLOCK_J, BLOCK_P), dtype=u_ptr.dtype.element_ty)
    for e0 in range(start, stop, BLOCK_E):
        es = e0 + tl.arange(0, BLOCK_E)
        e_mask = es < stop
        rows = es.to(tl.int64)
        a = tl.load(a_ptr + rows[:, None] * j_size + js[None, :], mask=e_mask[:, None] & j_mask[None, :], other=0.0)
        y = tl.load(y_ptr + rows[:, None] * p_size + ps[None, :], mask=e_mask[:, None] & p_mask[None, :], other=0.0)
        acc += tl.dot(tl.trans(a), y, input_precision=PRECISION)
    base = u_ptr + node.to(tl.int64) * j_size * p_size
    tl.store(base + js[:, None] * p_size + ps[None, :], acc, mask=j_mask[:, None] & p_mask[None, :])


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


def _segment_rows(a: torch.Tensor, m: torch.Tensor, rowptr: torch.Tensor, transpose: bool) -> torch.Tensor:
    """``out[e] = a[e] @ M_i`` (``transpose``: ``a[e] @ M_i^T``) for ``M [N, J, P]`` and the edges ``e -> i``."""
    nodes, rows, cols = m.shape
    k_size, c_size = (cols, rows) if transpose else (rows, cols)
    stride_k, stride_c = (1, cols) if transpose else (cols, 1)
    out = a.new_empty(a.shape[0], c_size)
    if out.numel() == 0:
        return out
    block_c, block_k = _block(c_size, 16, 64), _block(k_size, 16, 64)
    _segment_rows_kernel[(nodes, triton.cdiv(c_size, block_c))](
        a, m, rowptr, out, k_size, c_size, rows * cols, stride_k, stride_c, BLOCK_E=BLOCK_E, BLOCK_K=block_k,
        BLOCK_C=block_c, PRECISION=_precision(a.dtype))
    return out


def _segment_outer(a: torch.Tensor, y: torch.Tensor, rowptr: torch.Tensor) -> torch.Tensor:
    """``U [N, J, P]``: ``U_i = sum_{e -> i} a_e^T y_e``."""
    nodes, j_size, p_size = rowptr.shape[0] - 1, a.shape[1], y.shape[1]
    u = y.new_empty(nodes, j_size, p_size)
    if u.numel() == 0:
        return u
    block_j, block_p = _block(j_size, 16, 64), _block(p_size, 16, 64)
    _segment_outer_kernel[(nodes, triton.cdiv(j_size, block_j), triton.cdiv(p_size, block_p))](
        a, y, rowptr, u, j_size, p_size, BLOCK_E=BLOCK_E, BLOCK_J=block_j, BLOCK_P=block_p,
        PRECISION=_precision(y.dtype))
    return u


# ------------------------------------------------------------------ per node: E(z, L) and its adjoints, per block


def _block_views(z: Optional[torch.Tensor], lt: Optional[torch.Tensor], row: Sequence[int], heads: int, hidden: int):
    """A block's slices ``z [N, heads, W, 2l+1]`` and ``L [heads, W, hidden, K]`` (None where not given)."""
    poff, kdim, dim_l, width, loff, zoff = row
    zb = z[:, zoff : zoff + heads * width * dim_l].reshape(-1, heads, width, dim_l) if z is not None else None
    lb = lt[loff : loff + heads * width * hidden * kdim].reshape(heads, width, hidden, kdim) if lt is not None else None
    return zb, lb


def _expand(z: torch.Tensor, lt: torch.Tensor, table: List[List[int]], dims: List[int]) -> torch.Tensor:
    """``Q [N, heads * hidden, paths]``: ``Q[i, a H + h, poff + m K + k] = sum_w z[i, a, w, m] L[a, w, h, k]``."""
    heads, hidden, paths = dims[:3]
    q = z.new_zeros(z.shape[0], heads, hidden, paths)  # the columns of no block stay zero
    for row in table:
        poff, kdim, dim_l = row[:3]
        zb, lb = _block_views(z, lt, row, heads, hidden)
        q[..., poff : poff + dim_l * kdim] = torch.einsum("nawm,awhk->nahmk", zb, lb).flatten(3)
    return q.view(z.shape[0], heads * hidden, paths)


def _adjoints(u: torch.Tensor, lt: Optional[torch.Tensor], z: Optional[torch.Tensor], table: List[List[int]],
              dims: List[int]) -> Tuple[torch.Tensor, torch.Tensor]:
    """From ``U [N, heads * hidden, paths]``: ``R(U, L) [N, z width]`` (if ``lt``) and
    ``sum_i X(U_i, z_i) [L size]`` (if ``z``), each empty otherwise."""
    heads, hidden, paths, zwidth, lsize = dims
    nodes = u.shape[0]
    blocks = u.view(nodes, heads, hidden, paths)
    out = u.new_zeros(nodes if lt is not None else 0, zwidth)
    glt = u.new_zeros(lsize if z is not None else 0)
    for row in table:
        poff, kdim, dim_l, width, loff, zoff = row
        ub = blocks[..., poff : poff + dim_l * kdim].unflatten(3, (dim_l, kdim))  # [N, a, h, m, k]
        zb, lb = _block_views(z, lt, row, heads, hidden)
        if lt is not None:
            out[:, zoff : zoff + heads * width * dim_l] = torch.einsum("awhk,nahmk->nawm", lb, ub).flatten(1)
        if z is not None:
            glt[loff : loff + heads * width * hidden * kdim] = torch.einsum("nawm,nahmk->awhk", zb, ub).flatten()
    return out, glt


def node_pass(y: Optional[torch.Tensor], a: Optional[torch.Tensor], z: Optional[torch.Tensor],
              lt: Optional[torch.Tensor], table: List[List[int]], rowptr: torch.Tensor, dims: List[int],
              needs: Sequence[bool]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""The outputs of :func:`e3attn.kernels.segments.node_pass` flagged in ``needs`` (the others empty):
    :math:`t = D(y, Q)` ``[E, heads * hidden]``, :math:`r = C(a, Q)` ``[E, paths]``, :math:`R(U, L)`
    ``[N, z width]`` and :math:`\sum_i X(U_i, z_i)` ``[L size]``, with :math:`Q_i = E(z_i, L)` and
    :math:`U_i = \sum_{e \to i} a_e^T y_e`. ``table`` is the block table as Python integers; the arguments are
    checked by the caller (:mod:`e3attn.kernels.segment_ops`)."""
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
        q = _expand(z, lt, table, dims)
        t = _segment_rows(y, q, rowptr, transpose=True) if need_t else ref.new_empty(0, heads * hidden)
        r = _segment_rows(a, q, rowptr, transpose=False) if need_r else ref.new_empty(0, paths)
    if need_o or need_g:
        u = _segment_outer(a, y, rowptr)
        o, g = _adjoints(u, lt if need_o else None, z if need_g else None, table, dims)
    return (t if need_t else ref.new_empty(0, heads * hidden), r if need_r else ref.new_empty(0, paths),
            o if need_o else ref.new_empty(0, dims[3]), g if need_g else empty)


# ------------------------------------------------------------------ per edge: the path features and their gradients


@triton.jit
def _coefficients_kernel(a_ptr, a_stride, a_columns_ptr, b_ptr, b_stride, b_columns_ptr, index_ptr, ptr_ptr, order_ptr,
                         coeff_ptr, out_ptr, num_edges, num_columns, GATHER: tl.constexpr, BLOCK: tl.constexpr):
    """Sums of Clebsch-Gordan terms, per edge: ``out[e, i] = sum_r c_q a[e, a_q] b[rows(e), b_q]`` with
    ``q = order[r]`` for ``r`` in ``ptr[i]:ptr[i + 1]``, where ``rows(e)`` is ``index[e]`` (``GATHER``) or ``e``.

    The path features are ``y = (Y by j_q) * (x[index] by i_q)`` listed by path; the gradient of ``x`` per edge
    is ``(gy by p_q) * (Y by j_q)`` listed by ``i``, that of ``Y`` is ``(gy by p_q) * (x[index] by i_q)`` listed
    by ``j``. ``out`` is ``[E, num_columns]``."""
    edges = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = edges < num_edges
    edges = edges.to(tl.int64)
    a_rows = edges * a_stride
    b_rows = (tl.load(index_ptr + edges, mask=mask, other=0).to(tl.int64) if GATHER else edges) * b_stride
    for i in range(num_columns):
        acc = tl.zeros((BLOCK,), dtype=out_ptr.dtype.element_ty)
        for r in range(tl.load(ptr_ptr + i), tl.load(ptr_ptr + i + 1)):
            q = tl.load(order_ptr + r)
            a = tl.load(a_ptr + a_rows + tl.load(a_columns_ptr + q), mask=mask, other=0.0)
            b = tl.load(b_ptr + b_rows + tl.load(b_columns_ptr + q), mask=mask, other=0.0)
            acc += tl.load(coeff_ptr + q) * a * b
        tl.store(out_ptr + edges * num_columns + i, acc, mask=mask)


class _PathTables(NamedTuple):
    """The Clebsch-Gordan coefficients of a product on a device, listed by path feature (component-major, the
    node kernels' layout), by input column ``i`` and by harmonic ``j`` (CSR pointers and orders)."""

    x: torch.Tensor
    y: torch.Tensor
    p: torch.Tensor
    c: torch.Tensor
    by_p: Tuple[torch.Tensor, torch.Tensor]
    by_x: Tuple[torch.Tensor, torch.Tensor]
    by_y: Tuple[torch.Tensor, torch.Tensor]


_TABLES: Dict[Tuple[str, int, int, torch.device, torch.dtype], _PathTables] = {}


def _tables(spec: str, x_dim: int, sh_dim: int, device: torch.device, dtype: torch.dtype) -> _PathTables:
    key = (spec, x_dim, sh_dim, device, dtype)
    found = _TABLES.get(key)
    if found is None:
        layout = layout_for(spec)
        order, paths = component_major_paths(spec)
        columns = order[layout.path_p]

        def ints(values) -> torch.Tensor:
            return torch.as_tensor(np.ascontiguousarray(values), dtype=torch.int32, device=device)

        def listed(keys: np.ndarray, size: int) -> Tuple[torch.Tensor, torch.Tensor]:
            ptr = np.concatenate([[0], np.cumsum(np.bincount(keys, minlength=size))])
            return ints(ptr), ints(np.argsort(keys, kind="stable"))

        found = _TABLES[key] = _PathTables(
            x=ints(layout.path_x), y=ints(layout.path_y), p=ints(columns),
            c=torch.as_tensor(layout.path_c, dtype=dtype, device=device), by_p=listed(columns, paths),
            by_x=listed(layout.path_x, x_dim), by_y=listed(layout.path_y, sh_dim))
    return found


def _sums(tables: _PathTables, a, a_columns, b, b_columns, index: torch.Tensor, gather_b: bool, listed,
          num_columns: int) -> torch.Tensor:
    """``out[e, i] = sum_q c_q a[e, a_q] b[rows(e), b_q]`` over the coefficients ``q`` listed under column ``i``,
    ``rows(e) = index[e]`` if ``gather_b`` (``_coefficients_kernel``)."""
    num = a.shape[0]
    out = a.new_empty(num, num_columns)
    if num == 0:
        return out
    ptr, order = listed
    _coefficients_kernel[(triton.cdiv(num, _PATH_TILE),)](
        a, a.shape[1], a_columns, b, b.shape[1], b_columns, index, ptr, order, tables.c, out, num, num_columns,
        GATHER=gather_b, BLOCK=_PATH_TILE)
    return out


def path_features(spec: str, x: torch.Tensor, index: torch.Tensor, sh: torch.Tensor, paths: int) -> torch.Tensor:
    """:math:`y_e = P(x_{\\mathrm{index}(e)}, Y_e)` ``[E, paths]`` (component-major, padded columns zero)."""
    _check_interpretable(sh)
    x, index, sh = x.contiguous(), index.contiguous(), sh.contiguous()
    tables = _tables(spec, x.shape[1], sh.shape[1], sh.device, sh.dtype)
    return _sums(tables, sh, tables.y, x, tables.x, index, True, tables.by_p, paths)


def path_features_backward(spec: str, x: torch.Tensor, index: torch.Tensor, sh: torch.Tensor, grad: torch.Tensor,
                           needs: Sequence[bool]) -> Tuple[torch.Tensor, torch.Tensor]:
    """The gradients of ``x`` ``[N, in]`` (summed per source node) and ``sh`` ``[E, sh]`` for the gradient
    ``grad`` of :func:`path_features`, each empty unless flagged in ``needs``."""
    _check_interpretable(sh)
    x, index, sh, grad = x.contiguous(), index.contiguous(), sh.contiguous(), grad.contiguous()
    tables = _tables(spec, x.shape[1], sh.shape[1], sh.device, sh.dtype)
    gx, gsh = x.new_empty(0), sh.new_empty(0)
    if needs[0]:
        per_edge = _sums(tables, grad, tables.p, sh, tables.y, index, False, tables.by_x, x.shape[1])
        gx = torch.zeros_like(x).index_add_(0, index, per_edge)
    if needs[1]:
        gsh = _sums(tables, grad, tables.p, x, tables.x, index, True, tables.by_y, sh.shape[1])
    return gx, gsh

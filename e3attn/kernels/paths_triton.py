r"""The path features of the attention's product on Triton: the backend of :mod:`e3attn.kernels.segment_ops`'s
``path_features`` and ``path_features_backward`` for CUDA tensors (CPU tensors in Triton's interpreter).

Per edge, :math:`y_e = P(x_{\mathrm{src}(e)}, Y_e)` in the component-major layout of
:func:`~e3attn.kernels.layout.component_major_paths` that the node kernels (:mod:`e3attn.kernels.segments_triton`)
read, and its gradients in :math:`x` (per edge, then summed per source with ``index_add_``) and in :math:`Y`: sums of
Clebsch-Gordan terms, all three computed by ``_coefficients_kernel``, one program per tile of edges and of output
columns. The terms are listed column by column (``_chunked``), so that every load of a row reads neighbouring
columns and every store writes a run of them.
"""
from __future__ import annotations

from typing import Dict, NamedTuple, Sequence, Tuple

import numpy as np
import torch
import triton
import triton.language as tl

from .layout import component_major_paths, layout_for
from .segments_triton import _block, _check_interpretable, size_class, tuned

__all__ = ["path_features", "path_features_backward"]


@tuned(["num_columns", "a_stride", "b_stride", "GATHER", "BLOCK_C"], {"BLOCK_E": "num_edges"},
       [(32, 4), (32, 2), (64, 4), (128, 4), (64, 8), (128, 8)])
@triton.jit(do_not_specialize=["size_class"])
def _coefficients_kernel(a_ptr, a_stride, b_ptr, b_stride, index_ptr, start_ptr, a_cols_ptr, b_cols_ptr, coeff_ptr,
                         out_ptr, num_edges, num_columns, size_class, GATHER: tl.constexpr, BLOCK_E: tl.constexpr,
                         BLOCK_C: tl.constexpr):
    """Sums of Clebsch-Gordan terms for a tile of edges (``program_id(0)``) and of output columns (``program_id(1)``):
    ``out[e, c] = sum_r coeff[r, c] a[e, a_cols[r, c]] b[rows(e), b_cols[r, c]]`` over the rows ``r`` of the
    column chunk's table (``start[chunk]:start[chunk + 1]``, :func:`_chunked`; a zero coefficient pads a column
    with fewer terms), where ``rows(e)`` is ``index[e]`` (``GATHER``) or ``e``. ``out`` is ``[E, num_columns]``.

    The path features are ``y = (Y by j_q) * (x[index] by i_q)`` listed by path; the gradient of ``x`` per edge
    is ``(gy by p_q) * (Y by j_q)`` listed by ``i``, that of ``Y`` is ``(gy by p_q) * (x[index] by i_q)`` listed
    by ``j``. Every load of a row reads neighbouring columns, every store a run of them."""
    edges = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    chunk = tl.program_id(1)
    cs = tl.arange(0, BLOCK_C)
    e_mask = edges < num_edges
    edges = edges.to(tl.int64)
    a_rows = edges * a_stride
    b_rows = (tl.load(index_ptr + edges, mask=e_mask, other=0).to(tl.int64) if GATHER else edges) * b_stride
    acc = tl.zeros((BLOCK_E, BLOCK_C), dtype=out_ptr.dtype.element_ty)
    for r in range(tl.load(start_ptr + chunk), tl.load(start_ptr + chunk + 1)):
        coeff = tl.load(coeff_ptr + r * BLOCK_C + cs)
        mask = e_mask[:, None] & (coeff != 0)[None, :]
        a = tl.load(a_ptr + a_rows[:, None] + tl.load(a_cols_ptr + r * BLOCK_C + cs)[None, :], mask=mask, other=0.0)
        b = tl.load(b_ptr + b_rows[:, None] + tl.load(b_cols_ptr + r * BLOCK_C + cs)[None, :], mask=mask, other=0.0)
        acc += coeff[None, :] * a * b
    columns = chunk * BLOCK_C + cs
    tl.store(out_ptr + edges[:, None] * num_columns + columns[None, :], acc,
             mask=e_mask[:, None] & (columns < num_columns)[None, :])


class _Chunked(NamedTuple):
    """A listing of the Clebsch-Gordan terms by output column, in chunks of ``block`` columns: the rows
    ``start[k]:start[k + 1]`` of the ``[rows, block]`` tables ``a_cols``, ``b_cols`` and ``coeff`` hold the terms of
    chunk ``k``, column by column (zero coefficients where a column has fewer terms than the chunk's most)."""

    block: int
    start: torch.Tensor
    a_cols: torch.Tensor
    b_cols: torch.Tensor
    coeff: torch.Tensor


def _chunked(keys: np.ndarray, num_columns: int, a_cols: np.ndarray, b_cols: np.ndarray, coeff: np.ndarray,
             device: torch.device, dtype: torch.dtype) -> _Chunked:
    """The terms ``q`` (columns ``a_cols[q]`` of ``a`` and ``b_cols[q]`` of ``b``, coefficient ``coeff[q]``) listed
    under output column ``keys[q]``, in chunks of columns."""
    block = _block(num_columns, 8, 32)
    chunks = max(1, triton.cdiv(num_columns, block))
    order = np.argsort(keys, kind="stable")
    counts = np.bincount(keys, minlength=chunks * block)
    rank = np.arange(order.size) - np.repeat(np.cumsum(counts) - counts, counts)  # place among its column's terms
    start = np.concatenate([[0], np.cumsum(counts.reshape(chunks, block).max(1))])
    row, column = start[keys[order] // block] + rank, keys[order] % block
    tables = [np.zeros((int(start[-1]), block), np.int32), np.zeros((int(start[-1]), block), np.int32),
              np.zeros((int(start[-1]), block))]
    for table, values in zip(tables, (a_cols, b_cols, coeff)):
        table[row, column] = values[order]

    def on_device(values: np.ndarray, type_: torch.dtype) -> torch.Tensor:
        return torch.as_tensor(np.ascontiguousarray(values), dtype=type_, device=device)

    return _Chunked(block, on_device(start, torch.int32), on_device(tables[0], torch.int32),
                    on_device(tables[1], torch.int32), on_device(tables[2], dtype))


class _PathTables(NamedTuple):
    """The Clebsch-Gordan terms of a product on a device, listed (:func:`_chunked`) by path feature
    (component-major, the node kernels' layout), by input column ``i`` and by harmonic ``j``."""

    by_p: _Chunked
    by_x: _Chunked
    by_y: _Chunked


_TABLES: Dict[Tuple[str, int, int, torch.device, torch.dtype], _PathTables] = {}


def _tables(spec: str, x_dim: int, sh_dim: int, device: torch.device, dtype: torch.dtype) -> _PathTables:
    key = (spec, x_dim, sh_dim, device, dtype)
    found = _TABLES.get(key)
    if found is None:
        layout = layout_for(spec)
        order, paths = component_major_paths(spec)
        xs, ys, ps, cs = layout.path_x, layout.path_y, order[layout.path_p], layout.path_c
        found = _TABLES[key] = _PathTables(
            by_p=_chunked(ps, paths, ys, xs, cs, device, dtype),  # y = P(x[index], Y): a = Y, b = x
            by_x=_chunked(xs, x_dim, ps, ys, cs, device, dtype),  # gradient of x per edge: a = grad, b = Y
            by_y=_chunked(ys, sh_dim, ps, xs, cs, device, dtype))  # gradient of Y: a = grad, b = x
    return found


def _sums(listed: _Chunked, a: torch.Tensor, b: torch.Tensor, index: torch.Tensor, gather_b: bool,
          num_columns: int) -> torch.Tensor:
    """``out[e, c] = sum_q coeff_q a[e, a_q] b[rows(e), b_q]`` over the terms ``q`` listed under column ``c``,
    ``rows(e) = index[e]`` if ``gather_b`` (``_coefficients_kernel``)."""
    num = a.shape[0]
    out = a.new_empty(num, num_columns)
    if out.numel() == 0:
        return out
    _coefficients_kernel[lambda meta: (triton.cdiv(num, meta["BLOCK_E"]), listed.start.shape[0] - 1)](
        a, a.shape[1], b, b.shape[1], index, listed.start, listed.a_cols, listed.b_cols, listed.coeff, out, num,
        num_columns, size_class(num), GATHER=gather_b, BLOCK_C=listed.block)
    return out


def path_features(spec: str, x: torch.Tensor, index: torch.Tensor, sh: torch.Tensor, paths: int) -> torch.Tensor:
    """:math:`y_e = P(x_{\\mathrm{index}(e)}, Y_e)` ``[E, paths]`` (component-major, padded columns zero)."""
    _check_interpretable(sh)
    x, index, sh = x.contiguous(), index.contiguous(), sh.contiguous()
    tables = _tables(spec, x.shape[1], sh.shape[1], sh.device, sh.dtype)
    return _sums(tables.by_p, sh, x, index, True, paths)


def path_features_backward(spec: str, x: torch.Tensor, index: torch.Tensor, sh: torch.Tensor, grad: torch.Tensor,
                           needs: Sequence[bool]) -> Tuple[torch.Tensor, torch.Tensor]:
    """The gradients of ``x`` ``[N, in]`` (summed per source node) and ``sh`` ``[E, sh]`` for the gradient
    ``grad`` of :func:`path_features`, each empty unless flagged in ``needs``."""
    _check_interpretable(sh)
    x, index, sh, grad = x.contiguous(), index.contiguous(), sh.contiguous(), grad.contiguous()
    tables = _tables(spec, x.shape[1], sh.shape[1], sh.device, sh.dtype)
    gx, gsh = x.new_empty(0), sh.new_empty(0)
    if needs[0]:
        per_edge = _sums(tables.by_x, grad, sh, index, False, x.shape[1])
        gx = torch.zeros_like(x).index_add_(0, index, per_edge)
    if needs[1]:
        gsh = _sums(tables.by_y, grad, x, index, True, sh.shape[1])
    return gx, gsh

r"""The fused tensor product on CUDA: Triton kernels, compiled by Triton on first use and cached on disk.

The product runs in two steps (see :mod:`e3attn.kernels.layout`), each one kernel over tiles of edges:

1. ``_coefficients_kernel``: the path features :math:`y_e = P(x_{\mathrm{index}(e)}, Y_e)`
   ``[E, num_paths]``, one sum of Clebsch-Gordan terms per path (``x[index]`` is gathered inside);
2. ``_blocks_kernel``: per (tile, output block, chunk of channels), the block's weights
   :math:`w = h L` with ``tl.dot`` (in IEEE precision: no TF32), contracted with :math:`y` into the
   output columns. The ``[E, weight_numel]`` weights are never stored.

Blocks of one dimension :math:`2l+1` are launched together, with tiles sized for them. The backward
runs the steps in reverse order: ``_paths_gradient_kernel`` gives the gradient of :math:`y` (one
program per tile and degree group, summing over the group's blocks), ``_hidden_backward_kernel``
that of :math:`h`, ``_linear_backward_kernel`` that of :math:`L` (each program sums over a share
of the tiles), and ``_coefficients_kernel`` again those of :math:`x` (per edge) and :math:`Y`.
Sums across programs are atomic additions, whose order (and so the last bits of a float sum) may
vary from run to run. The backward of the backward is composed from these (see
:mod:`e3attn.kernels.ops`).

With ``TRITON_INTERPRET=1`` set before this module is imported, Triton's interpreter runs the same
kernels on CPU tensors (slowly): that is how the tests check them on machines without a GPU.
"""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Tuple

import numpy as np
import torch
import triton
import triton.language as tl

from .layout import KernelLayout

__all__ = ["forward", "backward"]

BLOCK_E = 128  # edges per tile of the Clebsch-Gordan sums


@triton.jit
def _coefficients_kernel(a_ptr, a_stride, a_columns_ptr, b_ptr, b_stride, b_columns_ptr, index_ptr, ptr_ptr, order_ptr,
                         coeff_ptr, out_ptr, num_edges, num_columns, GATHER_A: tl.constexpr, GATHER_B: tl.constexpr,
                         BLOCK: tl.constexpr):
    """Sums of Clebsch-Gordan terms, per edge: ``out[e, i] = sum_r c_q a[rows_a(e), a_q] b[rows_b(e), b_q]`` with
    ``q = order[r]`` for ``r`` in ``ptr[i]:ptr[i + 1]``, where the rows are ``index[e]`` (``GATHER``) or ``e``.

    The path features are ``y = (x[index] by i_q) * (Y by j_q)`` listed by path; the gradient of ``x`` per edge
    is ``(gy by p_q) * (Y by j_q)`` listed by ``i``, that of ``Y`` is ``(gy by p_q) * (x[index] by i_q)`` listed
    by ``j``. ``out`` is ``[E, num_columns]``."""
    edges = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = edges < num_edges
    edges = edges.to(tl.int64)
    index = tl.load(index_ptr + edges, mask=mask, other=0).to(tl.int64) if GATHER_A or GATHER_B else edges
    a_rows = (index if GATHER_A else edges) * a_stride
    b_rows = (index if GATHER_B else edges) * b_stride
    for i in range(num_columns):
        acc = tl.zeros((BLOCK,), dtype=out_ptr.dtype.element_ty)
        for r in range(tl.load(ptr_ptr + i), tl.load(ptr_ptr + i + 1)):
            q = tl.load(order_ptr + r)
            a = tl.load(a_ptr + a_rows + tl.load(a_columns_ptr + q), mask=mask, other=0.0)
            b = tl.load(b_ptr + b_rows + tl.load(b_columns_ptr + q), mask=mask, other=0.0)
            acc += tl.load(coeff_ptr + q) * a * b
        tl.store(out_ptr + edges * num_columns + i, acc, mask=mask)


@triton.jit
def _block(blocks_ptr, block, hidden_sizes_ptr, linear_offsets_ptr, numel_ptr, chunk, BLOCK_W: tl.constexpr,
           BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr):
    """A block (row ``block`` of ``KernelLayout.blocks``) and a chunk of its channels: the
    block's fields, the indices and masks of its channels ``w``, hidden features ``h`` and components ``m``,
    and the offsets of its weights ``L[h, k W + w]`` for ``k = 0``."""
    row = blocks_ptr + block * 7
    out = tl.load(row)
    width = tl.load(row + 4)
    dim_l = tl.load(row + 3)
    channels = chunk * BLOCK_W + tl.arange(0, BLOCK_W)
    hs = tl.arange(0, BLOCK_H)
    ms = tl.arange(0, BLOCK_M)
    # linear[t][h, weight_offset + k W + w] sits at linear_offsets[t] + h numel_t + weight_offset + k W + w
    weights = (tl.load(linear_offsets_ptr + out) + hs[:, None] * tl.load(numel_ptr + out) + tl.load(row + 5)
               + channels[None, :])
    return (out, tl.load(row + 1), tl.load(row + 2), dim_l, width, tl.load(row + 6), channels, channels < width, hs,
            hs < tl.load(hidden_sizes_ptr + out), ms, ms < dim_l, weights)


@triton.jit
def _edges(tile, num_edges, BLOCK: tl.constexpr):
    """The edges of a tile (int64) and their mask."""
    edges = tile * BLOCK + tl.arange(0, BLOCK)
    return edges.to(tl.int64), edges < num_edges


@triton.jit
def _hidden_tile(hidden_ptr, hidden_offsets_ptr, out, edges, edge_mask, hs, h_mask, hidden_stride):
    """``hidden[e, offset_t + h]``, ``[BLOCK, BLOCK_H]``."""
    return tl.load(hidden_ptr + edges[:, None] * hidden_stride + tl.load(hidden_offsets_ptr + out) + hs[None, :],
                   mask=edge_mask[:, None] & h_mask[None, :], other=0.0)


@triton.jit
def _output_tile(ptr, channels_ptr, channel_offset, channels, w_mask, ms, m_mask, edges, edge_mask, stride):
    """Pointers ``[BLOCK, BLOCK_W, BLOCK_M]`` to the output columns ``col(w) + m`` of a block, and their mask."""
    columns = tl.load(channels_ptr + channel_offset + channels, mask=w_mask, other=0)
    return (ptr + edges[:, None, None] * stride + columns[None, :, None] + ms[None, None, :],
            edge_mask[:, None, None] & w_mask[None, :, None] & m_mask[None, None, :])


@triton.jit
def _blocks_kernel(y_ptr, hidden_ptr, linear_ptr, blocks_ptr, channels_ptr, hidden_offsets_ptr, hidden_sizes_ptr,
                   linear_offsets_ptr, numel_ptr, out_ptr, num_edges, num_paths, hidden_stride, out_stride,
                   BLOCK: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr):
    """``z[e, col(w) + m] = sum_k (h_e L)[k W + w] y[e, path_offset + k (2l+1) + m]`` for one tile of edges and
    one block's chunk of channels ``w`` (program ids: tile, block, chunk)."""
    (out, path_offset, k_dim, dim_l, width, channel_offset, channels, w_mask, hs, h_mask, ms, m_mask,
     weights) = _block(blocks_ptr, tl.program_id(1), hidden_sizes_ptr, linear_offsets_ptr, numel_ptr, tl.program_id(2), BLOCK_W,
                       BLOCK_H, BLOCK_M)
    if tl.program_id(2) * BLOCK_W < width:
        edges, edge_mask = _edges(tl.program_id(0), num_edges, BLOCK)
        hidden = _hidden_tile(hidden_ptr, hidden_offsets_ptr, out, edges, edge_mask, hs, h_mask, hidden_stride)
        acc = tl.zeros((BLOCK, BLOCK_W, BLOCK_M), dtype=out_ptr.dtype.element_ty)
        for k in range(k_dim):
            lin = tl.load(linear_ptr + weights + k * width, mask=h_mask[:, None] & w_mask[None, :], other=0.0)
            w = tl.dot(hidden, lin, input_precision="ieee")
            y = tl.load(y_ptr + edges[:, None] * num_paths + path_offset + k * dim_l + ms[None, :],
                        mask=edge_mask[:, None] & m_mask[None, :], other=0.0)
            acc += w[:, :, None] * y[:, None, :]
        pointers, mask = _output_tile(out_ptr, channels_ptr, channel_offset, channels, w_mask, ms, m_mask, edges,
                                      edge_mask, out_stride)
        tl.store(pointers, acc, mask=mask)


@triton.jit
def _channel_columns(channels_ptr, channel_offset, channels, w_mask, edges, edge_mask, stride):
    """Offsets ``[BLOCK, BLOCK_W]`` of the output columns ``col(w)`` (component ``m = 0``) of a block, and their
    mask: component ``m`` is at ``+ m``."""
    columns = tl.load(channels_ptr + channel_offset + channels, mask=w_mask, other=0)
    return edges[:, None] * stride + columns[None, :], edge_mask[:, None] & w_mask[None, :]


@triton.jit
def _paths_gradient_kernel(grad_ptr, hidden_ptr, linear_ptr, blocks_ptr, groups_ptr, channels_ptr,
                           hidden_offsets_ptr, hidden_sizes_ptr, linear_offsets_ptr, numel_ptr, gy_ptr, num_edges,
                           num_paths, hidden_stride, grad_stride, BLOCK: tl.constexpr, BLOCK_W: tl.constexpr,
                           BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr):
    """``gy[e, path_offset + k (2l+1) + m] = sum_{blocks, w} (h_e L)[k W + w] g[e, col(w) + m]`` for one tile and
    one degree group (program ids: tile, group), summed over the group's blocks ``groups[i]`` to
    ``groups[i + 1]`` (rows of ``blocks``): each path is written once, by one program."""
    edges, edge_mask = _edges(tl.program_id(0), num_edges, BLOCK)
    first = tl.load(groups_ptr + tl.program_id(1))
    last = tl.load(groups_ptr + tl.program_id(1) + 1)
    path_offset = tl.load(blocks_ptr + first * 7 + 1)
    k_dim = tl.load(blocks_ptr + first * 7 + 2)
    dim_l = tl.load(blocks_ptr + first * 7 + 3)
    ms = tl.arange(0, BLOCK_M)
    for k in range(k_dim):
        gy = tl.zeros((BLOCK, BLOCK_M), dtype=gy_ptr.dtype.element_ty)
        for block in range(first, last):
            for chunk in range(tl.cdiv(tl.load(blocks_ptr + block * 7 + 4), BLOCK_W)):
                (out, _, _, _, width, channel_offset, channels, w_mask, hs, h_mask, _, _, weights) = _block(blocks_ptr, block, hidden_sizes_ptr, linear_offsets_ptr, numel_ptr, chunk,
                                   BLOCK_W, BLOCK_H, BLOCK_M)
                hidden = _hidden_tile(hidden_ptr, hidden_offsets_ptr, out, edges, edge_mask, hs, h_mask,
                                      hidden_stride)
                lin = tl.load(linear_ptr + weights + k * width, mask=h_mask[:, None] & w_mask[None, :], other=0.0)
                w = tl.dot(hidden, lin, input_precision="ieee")
                columns, mask = _channel_columns(channels_ptr, channel_offset, channels, w_mask, edges, edge_mask,
                                                 grad_stride)
                for m in range(dim_l):
                    part = tl.sum(w * tl.load(grad_ptr + columns + m, mask=mask, other=0.0), axis=1)
                    gy += tl.where(ms[None, :] == m, part[:, None], 0.0)
        tl.store(gy_ptr + edges[:, None] * num_paths + path_offset + k * dim_l + ms[None, :], gy,
                 mask=edge_mask[:, None] & (ms < dim_l)[None, :])


@triton.jit
def _hidden_backward_kernel(grad_ptr, y_ptr, linear_ptr, blocks_ptr, channels_ptr, hidden_offsets_ptr,
                            hidden_sizes_ptr, linear_offsets_ptr, numel_ptr, ghidden_ptr, num_edges, num_paths,
                            hidden_stride, grad_stride, BLOCK: tl.constexpr, BLOCK_W: tl.constexpr,
                            BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr):
    """``ghidden[e, h] += sum_{k, w} L[h, k W + w] sum_m g[e, col(w) + m] y[e, path_offset + k (2l+1) + m]`` for
    one tile and one block's chunk of channels (program ids: tile, block, chunk)."""
    (out, path_offset, k_dim, dim_l, width, channel_offset, channels, w_mask, hs, h_mask, ms, m_mask,
     weights) = _block(blocks_ptr, tl.program_id(1), hidden_sizes_ptr, linear_offsets_ptr, numel_ptr,
                       tl.program_id(2), BLOCK_W, BLOCK_H, BLOCK_M)
    if tl.program_id(2) * BLOCK_W < width:
        edges, edge_mask = _edges(tl.program_id(0), num_edges, BLOCK)
        columns, mask = _channel_columns(channels_ptr, channel_offset, channels, w_mask, edges, edge_mask,
                                         grad_stride)
        ghidden = tl.zeros((BLOCK, BLOCK_H), dtype=ghidden_ptr.dtype.element_ty)
        for k in range(k_dim):
            lin = tl.load(linear_ptr + weights + k * width, mask=h_mask[:, None] & w_mask[None, :], other=0.0)
            paths = edges * num_paths + path_offset + k * dim_l
            gw = tl.zeros((BLOCK, BLOCK_W), dtype=ghidden_ptr.dtype.element_ty)
            for m in range(dim_l):
                gw += (tl.load(grad_ptr + columns + m, mask=mask, other=0.0)
                       * tl.load(y_ptr + paths + m, mask=edge_mask, other=0.0)[:, None])
            ghidden += tl.dot(gw, tl.trans(lin), input_precision="ieee")
        tl.atomic_add(ghidden_ptr + edges[:, None] * hidden_stride + tl.load(hidden_offsets_ptr + out)
                      + hs[None, :], ghidden, mask=edge_mask[:, None] & h_mask[None, :])


@triton.jit
def _linear_backward_kernel(grad_ptr, y_ptr, hidden_ptr, blocks_ptr, channels_ptr, hidden_offsets_ptr,
                            hidden_sizes_ptr, linear_offsets_ptr, numel_ptr, glinear_ptr, num_edges, num_paths,
                            hidden_stride, grad_stride, max_k, BLOCK: tl.constexpr, BLOCK_W: tl.constexpr,
                            BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr):
    """``glinear[h, k W + w] += sum_e hidden[e, h] sum_m g[e, col(w) + m] y[e, path_offset + k (2l+1) + m]`` over
    the tiles ``program_id(0) + i num_programs(0)``, for one block, chunk of channels and ``k`` (program id 2:
    ``chunk max_k + k``): one atomic addition per program."""
    chunk = tl.program_id(2) // max_k
    k = tl.program_id(2) % max_k
    (out, path_offset, k_dim, dim_l, width, channel_offset, channels, w_mask, hs, h_mask, ms, m_mask,
     weights) = _block(blocks_ptr, tl.program_id(1), hidden_sizes_ptr, linear_offsets_ptr, numel_ptr, chunk,
                       BLOCK_W, BLOCK_H, BLOCK_M)
    if (k < k_dim) & (chunk * BLOCK_W < width):
        acc = tl.zeros((BLOCK_H, BLOCK_W), dtype=glinear_ptr.dtype.element_ty)
        for tile in range(tl.program_id(0), tl.cdiv(num_edges, BLOCK), tl.num_programs(0)):
            edges, edge_mask = _edges(tile, num_edges, BLOCK)
            hidden = _hidden_tile(hidden_ptr, hidden_offsets_ptr, out, edges, edge_mask, hs, h_mask, hidden_stride)
            columns, mask = _channel_columns(channels_ptr, channel_offset, channels, w_mask, edges, edge_mask,
                                             grad_stride)
            paths = edges * num_paths + path_offset + k * dim_l
            gw = tl.zeros((BLOCK, BLOCK_W), dtype=glinear_ptr.dtype.element_ty)
            for m in range(dim_l):
                gw += (tl.load(grad_ptr + columns + m, mask=mask, other=0.0)
                       * tl.load(y_ptr + paths + m, mask=edge_mask, other=0.0)[:, None])
            acc += tl.dot(tl.trans(hidden), gw, input_precision="ieee")
        tl.atomic_add(glinear_ptr + weights + k * width, acc, mask=h_mask[:, None] & w_mask[None, :])


# ---------------------------------------------------------------------- launch


class _BlockClass(NamedTuple):
    """The blocks of one dimension :math:`2l+1`, launched together with the tile sizes that fit them."""

    blocks: torch.Tensor  # [n, 7] int32 rows of KernelLayout.blocks, sorted by path offset (degree group)
    groups: torch.Tensor  # [num_groups + 1] the first row of each degree group
    block_m: int  # components per program: 2l+1 rounded up to a power of two
    block_w: int  # channels per program
    block_e: int  # edges per tile of the forward ([edges, channels, components] tiles)
    block_e_backward: int  # edges per tile of the backward ([edges, channels] tiles)
    chunks: int  # programs per block along the channels
    max_k: int


class _DeviceLayout(NamedTuple):
    """A :class:`~e3attn.kernels.layout.KernelLayout` as device tensors, with the coefficients also listed by
    ``i`` and by ``j`` (CSR pointers) for the backward, and the blocks grouped by dimension."""

    ptr_p: torch.Tensor
    order_p: torch.Tensor
    coeff_x: torch.Tensor
    coeff_y: torch.Tensor
    coeff_p: torch.Tensor
    coeff_c: torch.Tensor
    ptr_x: torch.Tensor
    order_x: torch.Tensor
    ptr_sh: torch.Tensor
    order_sh: torch.Tensor
    channels: torch.Tensor
    classes: Tuple[_BlockClass, ...]


_DEVICE_LAYOUTS: Dict[Tuple[int, int, int, torch.device, torch.dtype], _DeviceLayout] = {}


def _pow2(n: int, least: int) -> int:
    return max(least, triton.next_power_of_2(max(n, 1)))


def _pointers(keys: np.ndarray, size: int) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(np.bincount(keys, minlength=size))])


def _block_classes(blocks: np.ndarray, ints) -> Tuple[_BlockClass, ...]:
    classes = []
    blocks = blocks[blocks[:, 2] > 0]  # blocks reached by no path: their outputs stay zero
    for dim in np.unique(blocks[:, 3]):
        rows = blocks[blocks[:, 3] == dim]
        rows = rows[np.argsort(rows[:, 1], kind="stable")]
        starts = np.flatnonzero(np.diff(rows[:, 1], prepend=-1))
        block_m = _pow2(int(dim), 1)
        widest = int(rows[:, 4].max())
        # at most 256 outputs per edge and program (registers), at least 16 channels (tl.dot)
        block_w = max(16, min(_pow2(widest, 16), 256 // block_m))
        # tiles of 2,048 to 4,096 values, 32 to 128 edges
        block_e = max(32, min(128, 2048 // (block_w * block_m)))
        block_e_backward = max(32, min(128, 4096 // block_w))
        classes.append(_BlockClass(ints(rows), ints(np.append(starts, len(rows))), block_m, block_w, block_e,
                                   block_e_backward, triton.cdiv(widest, block_w), int(rows[:, 2].max())))
    return tuple(classes)


def _device_layout(layout: KernelLayout, x_dim: int, sh_dim: int, device: torch.device,
                   dtype: torch.dtype) -> _DeviceLayout:
    key = (id(layout), x_dim, sh_dim, device, dtype)
    found = _DEVICE_LAYOUTS.get(key)
    if found is None:
        def ints(values) -> torch.Tensor:
            return torch.as_tensor(np.ascontiguousarray(values), dtype=torch.int32, device=device)

        found = _DEVICE_LAYOUTS[key] = _DeviceLayout(
            ptr_p=ints(_pointers(layout.path_p, layout.num_paths)), order_p=ints(np.arange(len(layout.path_p))),
            coeff_x=ints(layout.path_x), coeff_y=ints(layout.path_y), coeff_p=ints(layout.path_p),
            coeff_c=torch.as_tensor(layout.path_c, dtype=dtype, device=device),
            ptr_x=ints(_pointers(layout.path_x, x_dim)), order_x=ints(np.argsort(layout.path_x, kind="stable")),
            ptr_sh=ints(_pointers(layout.path_y, sh_dim)), order_sh=ints(np.argsort(layout.path_y, kind="stable")),
            channels=ints(layout.channels), classes=_block_classes(layout.blocks, ints),
        )
    return found


def _sizes(device: torch.device, hidden_sizes: List[int], numel) -> Tuple[torch.Tensor, ...]:
    """Per output: the offsets and sizes of its hidden features, the offsets and sizes of its weights."""
    sizes = np.asarray(hidden_sizes, dtype=np.int64)
    numel = np.asarray(numel, dtype=np.int64)
    values = (np.cumsum([0, *sizes[:-1]]), sizes, np.cumsum([0, *(sizes * numel)[:-1]]), numel)
    return tuple(torch.as_tensor(v, dtype=torch.int32, device=device) for v in values)


def _coefficient_sums(dev: _DeviceLayout, a, a_columns, a_gathered: bool, b, b_columns, b_gathered: bool,
                      index, ptr, order, num_columns: int) -> torch.Tensor:
    """``_coefficients_kernel``'s ``[E, num_columns]`` (``index`` is used where a factor is gathered)."""
    num = b.shape[0] if not b_gathered else a.shape[0]
    out = a.new_empty(num, num_columns)
    _coefficients_kernel[(triton.cdiv(num, BLOCK_E),)](
        a, a.shape[1], a_columns, b, b.shape[1], b_columns, index if index is not None else order, ptr, order,
        dev.coeff_c, out, num, num_columns, GATHER_A=a_gathered and index is not None,
        GATHER_B=b_gathered and index is not None, BLOCK=BLOCK_E)
    return out


def _paths(layout: KernelLayout, dev: _DeviceLayout, x, index, sh) -> torch.Tensor:
    """The path features ``y``, ``[E, num_paths]``."""
    return _coefficient_sums(dev, sh, dev.coeff_y, False, x, dev.coeff_x, True, index, dev.ptr_p, dev.order_p,
                             layout.num_paths)


def _launches(layout: KernelLayout, dev: _DeviceLayout, hidden, hidden_sizes: List[int], backward: bool):
    """Per class of blocks: the grid (tile, block, chunk), the structure arguments and the tile sizes."""
    sizes = _sizes(hidden.device, hidden_sizes, layout.weight_numel)
    block_h = _pow2(max(hidden_sizes, default=1), 16)
    for c in dev.classes:
        block_e = c.block_e_backward if backward else c.block_e
        yield c, (triton.cdiv(hidden.shape[0], block_e), c.blocks.shape[0], c.chunks), \
            (c.blocks, dev.channels, *sizes), dict(BLOCK=block_e, BLOCK_W=c.block_w, BLOCK_H=block_h, BLOCK_M=c.block_m)


def forward(layout: KernelLayout, x: torch.Tensor, index: Optional[torch.Tensor], sh: torch.Tensor,
            hidden: torch.Tensor, linear: torch.Tensor, hidden_sizes: List[int]) -> torch.Tensor:
    """:math:`F(x, Y, h, L)`, ``[E, out_dim]`` (contiguous arguments on one device, checked by the caller)."""
    num = sh.shape[0]
    out = sh.new_zeros(num, layout.out_dim)  # columns of outputs without paths stay zero
    if num == 0:
        return out
    dev = _device_layout(layout, x.shape[1], sh.shape[1], sh.device, sh.dtype)
    y = _paths(layout, dev, x, index, sh)
    for _, grid, structure, constants in _launches(layout, dev, hidden, hidden_sizes, backward=False):
        _blocks_kernel[grid](y, hidden, linear, *structure, out, num, layout.num_paths, hidden.shape[1],
                             layout.out_dim, **constants)
    return out


# programs of the weight-gradient kernel (each sums over a share of the tiles): a few per multiprocessor
_LINEAR_PROGRAMS = 8192


def backward(layout: KernelLayout, x: torch.Tensor, index: Optional[torch.Tensor], sh: torch.Tensor,
             hidden: torch.Tensor, linear: torch.Tensor, hidden_sizes: List[int], grad: torch.Tensor,
             need_inputs: bool, need_hidden: bool, need_linear: bool
             ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of :math:`\\langle g, F \\rangle`: of the gathered ``x`` per edge ``[E, x_dim]`` and of
    ``sh`` (when ``need_inputs``), of ``hidden`` and of ``linear`` (empty where not needed)."""
    num = sh.shape[0]
    gx, gsh = x.new_zeros(0, x.shape[1]), sh.new_zeros(0, sh.shape[1])  # replaced below where needed
    ghidden = hidden.new_zeros(num if need_hidden else 0, hidden.shape[1])
    glinear = linear.new_zeros(linear.shape[0] if need_linear else 0)
    if num == 0 or not (need_inputs or need_hidden or need_linear):
        return gx, gsh, ghidden, glinear
    dev = _device_layout(layout, x.shape[1], sh.shape[1], sh.device, sh.dtype)
    y = _paths(layout, dev, x, index, sh) if need_hidden or need_linear else sh.new_empty(0)
    gy = sh.new_zeros(num if need_inputs else 0, layout.num_paths)  # paths of no block stay zero
    for c, grid, structure, constants in _launches(layout, dev, hidden, hidden_sizes, backward=True):
        blocks, channels, *sizes = structure
        if need_inputs:
            _paths_gradient_kernel[(grid[0], c.groups.shape[0] - 1)](
                grad, hidden, linear, blocks, c.groups, channels, *sizes, gy, num, layout.num_paths, hidden.shape[1],
                layout.out_dim, **constants)
        if need_hidden:
            _hidden_backward_kernel[grid](grad, y, linear, *structure, ghidden, num, layout.num_paths,
                                          hidden.shape[1], layout.out_dim, **constants)
        if need_linear:
            per_tile = c.blocks.shape[0] * c.chunks * c.max_k
            splits = max(1, min(grid[0], _LINEAR_PROGRAMS // per_tile))
            _linear_backward_kernel[(splits, grid[1], c.chunks * c.max_k)](
                grad, y, hidden, *structure, glinear, num, layout.num_paths, hidden.shape[1], layout.out_dim,
                c.max_k, **constants)
    if need_inputs:
        gx = _coefficient_sums(dev, gy, dev.coeff_p, False, sh, dev.coeff_y, False, None, dev.ptr_x, dev.order_x,
                               x.shape[1])
        gsh = _coefficient_sums(dev, gy, dev.coeff_p, False, x, dev.coeff_x, True, index, dev.ptr_sh, dev.order_sh,
                                sh.shape[1])
    return gx, gsh, ghidden, glinear

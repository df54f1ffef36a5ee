r"""The fused tensor product on CUDA: Triton kernels, compiled by Triton on first use and cached on disk.

The product runs in two steps (see :mod:`e3attn.kernels.layout`), each one kernel over tiles of
``BLOCK_E`` edges:

1. :func:`_paths_kernel`: the path features :math:`y_e = P(x_{\mathrm{index}(e)}, Y_e)`
   ``[E, num_paths]``, one sum of Clebsch-Gordan terms per path (``x[index]`` is gathered inside);
2. :func:`_blocks_kernel`: per (tile, output block, chunk of ``BLOCK_W`` channels), the block's weights
   :math:`w = h L` tile by tile with ``tl.dot`` (in IEEE precision: no TF32), contracted with
   :math:`y` into the output columns. The ``[E, weight_numel]`` weights are never stored.

The backward runs the same two kernels in reverse order: :func:`_blocks_backward_kernel` gives the
gradients of :math:`y`, :math:`h` and :math:`L` (added atomically: the order of the additions, and
so the last bits of float sums, may vary from run to run), then :func:`_paths_backward_kernel`
those of :math:`x` (per edge) and :math:`Y`. The backward of the backward is composed from these
(see :mod:`e3attn.kernels.ops`).

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

BLOCK_E = 32  # edges per tile
BLOCK_W = 32  # channels per program of the block kernels


@triton.jit
def _paths_kernel(x_ptr, index_ptr, sh_ptr, ptr_ptr, coeff_x_ptr, coeff_y_ptr, coeff_c_ptr, y_ptr,
                  num_edges, num_paths, x_stride, sh_stride, HAS_INDEX: tl.constexpr, BLOCK: tl.constexpr):
    """``y[e, p] = sum_q c_q x[index[e], i_q] Y[e, j_q]`` over the coefficients ``q`` of path ``p``."""
    edges = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = edges < num_edges
    edges = edges.to(tl.int64)
    rows = tl.load(index_ptr + edges, mask=mask, other=0).to(tl.int64) if HAS_INDEX else edges
    for p in range(num_paths):
        acc = tl.zeros((BLOCK,), dtype=y_ptr.dtype.element_ty)
        for q in range(tl.load(ptr_ptr + p), tl.load(ptr_ptr + p + 1)):
            x = tl.load(x_ptr + rows * x_stride + tl.load(coeff_x_ptr + q), mask=mask, other=0.0)
            y = tl.load(sh_ptr + edges * sh_stride + tl.load(coeff_y_ptr + q), mask=mask, other=0.0)
            acc += tl.load(coeff_c_ptr + q) * x * y
        tl.store(y_ptr + edges * num_paths + p, acc, mask=mask)


@triton.jit
def _paths_backward_kernel(gy_ptr, x_ptr, index_ptr, sh_ptr, num_x, ptr_x_ptr, order_x_ptr, num_sh, ptr_sh_ptr,
                           order_sh_ptr, coeff_x_ptr, coeff_y_ptr, coeff_p_ptr, coeff_c_ptr, gx_ptr, gsh_ptr,
                           num_edges, num_paths, x_stride, sh_stride, HAS_INDEX: tl.constexpr,
                           BLOCK: tl.constexpr):
    """Per edge, ``gx[e, i] = sum_{q: i_q = i} c_q gy[e, p_q] Y[e, j_q]`` and
    ``gsh[e, j] = sum_{q: j_q = j} c_q gy[e, p_q] x[index[e], i_q]`` (coefficients listed by ``i``, by ``j``)."""
    edges = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = edges < num_edges
    edges = edges.to(tl.int64)
    rows = tl.load(index_ptr + edges, mask=mask, other=0).to(tl.int64) if HAS_INDEX else edges
    for i in range(num_x):
        acc = tl.zeros((BLOCK,), dtype=gx_ptr.dtype.element_ty)
        for r in range(tl.load(ptr_x_ptr + i), tl.load(ptr_x_ptr + i + 1)):
            q = tl.load(order_x_ptr + r)
            gy = tl.load(gy_ptr + edges * num_paths + tl.load(coeff_p_ptr + q), mask=mask, other=0.0)
            y = tl.load(sh_ptr + edges * sh_stride + tl.load(coeff_y_ptr + q), mask=mask, other=0.0)
            acc += tl.load(coeff_c_ptr + q) * gy * y
        tl.store(gx_ptr + edges * x_stride + i, acc, mask=mask)
    for j in range(num_sh):
        acc = tl.zeros((BLOCK,), dtype=gsh_ptr.dtype.element_ty)
        for r in range(tl.load(ptr_sh_ptr + j), tl.load(ptr_sh_ptr + j + 1)):
            q = tl.load(order_sh_ptr + r)
            gy = tl.load(gy_ptr + edges * num_paths + tl.load(coeff_p_ptr + q), mask=mask, other=0.0)
            x = tl.load(x_ptr + rows * x_stride + tl.load(coeff_x_ptr + q), mask=mask, other=0.0)
            acc += tl.load(coeff_c_ptr + q) * gy * x
        tl.store(gsh_ptr + edges * sh_stride + j, acc, mask=mask)


@triton.jit
def _block_operands(blocks_ptr, hidden_offsets_ptr, hidden_sizes_ptr, linear_offsets_ptr, numel_ptr, hidden_ptr,
                    num_edges, hidden_stride, BLOCK: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_H: tl.constexpr,
                    BLOCK_M: tl.constexpr):
    """What a program of the block kernels works on: its block's row of ``KernelLayout.blocks``, its edges,
    channels ``w``, components ``m`` and hidden features ``h`` (indices and masks), and the hidden tile."""
    edges = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    edge_mask = edges < num_edges
    edges = edges.to(tl.int64)
    row = blocks_ptr + tl.program_id(1) * 7
    out = tl.load(row)
    width = tl.load(row + 4)
    channels = tl.program_id(2) * BLOCK_W + tl.arange(0, BLOCK_W)
    hs = tl.arange(0, BLOCK_H)
    h_mask = hs < tl.load(hidden_sizes_ptr + out)
    hidden = tl.load(hidden_ptr + edges[:, None] * hidden_stride + tl.load(hidden_offsets_ptr + out) + hs[None, :],
                     mask=edge_mask[:, None] & h_mask[None, :], other=0.0)
    ms = tl.arange(0, BLOCK_M)
    numel = tl.load(numel_ptr + out)
    # linear[t][h, weight_offset + k W + w] sits at linear_offsets[t] + h numel_t + weight_offset + k W + w
    weights = tl.load(linear_offsets_ptr + out) + hs[:, None] * numel + tl.load(row + 5) + channels[None, :]
    return (edges, edge_mask, channels, channels < width, hs, h_mask, ms, ms < tl.load(row + 3), hidden, weights,
            tl.load(row + 1), tl.load(row + 2), tl.load(row + 3), width, tl.load(row + 6), out)


@triton.jit
def _blocks_kernel(y_ptr, hidden_ptr, linear_ptr, blocks_ptr, channels_ptr, hidden_offsets_ptr, hidden_sizes_ptr,
                   linear_offsets_ptr, numel_ptr, out_ptr, num_edges, num_paths, hidden_stride, out_stride,
                   BLOCK: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr):
    """``z[e, col(w) + m] = sum_k (h_e L)[k W + w] y[e, path_offset + k (2l+1) + m]`` for one block's chunk of
    channels ``w``."""
    (edges, edge_mask, channels, w_mask, hs, h_mask, ms, m_mask, hidden, weights, path_offset, k_dim, dim_l, width,
     channel_offset, out) = _block_operands(blocks_ptr, hidden_offsets_ptr, hidden_sizes_ptr, linear_offsets_ptr,
                                            numel_ptr, hidden_ptr, num_edges, hidden_stride, BLOCK, BLOCK_W, BLOCK_H,
                                            BLOCK_M)
    if tl.program_id(2) * BLOCK_W < width:
        acc = tl.zeros((BLOCK, BLOCK_W, BLOCK_M), dtype=out_ptr.dtype.element_ty)
        for k in range(k_dim):
            lin = tl.load(linear_ptr + weights + k * width, mask=h_mask[:, None] & w_mask[None, :], other=0.0)
            w = tl.dot(hidden, lin, input_precision="ieee")
            y = tl.load(y_ptr + edges[:, None] * num_paths + path_offset + k * dim_l + ms[None, :],
                        mask=edge_mask[:, None] & m_mask[None, :], other=0.0)
            acc += w[:, :, None] * y[:, None, :]
        columns = tl.load(channels_ptr + channel_offset + channels, mask=w_mask, other=0)
        tl.store(out_ptr + edges[:, None, None] * out_stride + columns[None, :, None] + ms[None, None, :], acc,
                 mask=edge_mask[:, None, None] & w_mask[None, :, None] & m_mask[None, None, :])


@triton.jit
def _blocks_backward_kernel(grad_ptr, y_ptr, hidden_ptr, linear_ptr, blocks_ptr, channels_ptr, hidden_offsets_ptr,
                            hidden_sizes_ptr, linear_offsets_ptr, numel_ptr, gy_ptr, ghidden_ptr, glinear_ptr,
                            num_edges, num_paths, hidden_stride, grad_stride, NEED_Y: tl.constexpr,
                            NEED_HIDDEN: tl.constexpr, NEED_LINEAR: tl.constexpr, BLOCK: tl.constexpr,
                            BLOCK_W: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr):
    """The gradients of ``<g, z>`` of one block's chunk of channels, added to ``gy``, ``ghidden``, ``glinear``."""
    (edges, edge_mask, channels, w_mask, hs, h_mask, ms, m_mask, hidden, weights, path_offset, k_dim, dim_l, width,
     channel_offset, out) = _block_operands(blocks_ptr, hidden_offsets_ptr, hidden_sizes_ptr, linear_offsets_ptr,
                                            numel_ptr, hidden_ptr, num_edges, hidden_stride, BLOCK, BLOCK_W, BLOCK_H,
                                            BLOCK_M)
    if tl.program_id(2) * BLOCK_W < width:
        columns = tl.load(channels_ptr + channel_offset + channels, mask=w_mask, other=0)
        grad = tl.load(grad_ptr + edges[:, None, None] * grad_stride + columns[None, :, None] + ms[None, None, :],
                       mask=edge_mask[:, None, None] & w_mask[None, :, None] & m_mask[None, None, :], other=0.0)
        ghidden = tl.zeros((BLOCK, BLOCK_H), dtype=ghidden_ptr.dtype.element_ty)
        for k in range(k_dim):
            lin_mask = h_mask[:, None] & w_mask[None, :]
            lin = tl.load(linear_ptr + weights + k * width, mask=lin_mask, other=0.0)
            paths = edges[:, None] * num_paths + path_offset + k * dim_l + ms[None, :]
            path_mask = edge_mask[:, None] & m_mask[None, :]
            if NEED_Y:
                w = tl.dot(hidden, lin, input_precision="ieee")
                tl.atomic_add(gy_ptr + paths, tl.sum(w[:, :, None] * grad, axis=1), mask=path_mask)
            if NEED_HIDDEN or NEED_LINEAR:
                y = tl.load(y_ptr + paths, mask=path_mask, other=0.0)
                gw = tl.sum(grad * y[:, None, :], axis=2)
                if NEED_HIDDEN:
                    ghidden += tl.dot(gw, tl.trans(lin), input_precision="ieee")
                if NEED_LINEAR:
                    tl.atomic_add(glinear_ptr + weights + k * width,
                                  tl.dot(tl.trans(hidden), gw, input_precision="ieee"), mask=lin_mask)
        if NEED_HIDDEN:
            hidden_offset = tl.load(hidden_offsets_ptr + out)
            tl.atomic_add(ghidden_ptr + edges[:, None] * hidden_stride + hidden_offset + hs[None, :], ghidden,
                          mask=edge_mask[:, None] & h_mask[None, :])


# ---------------------------------------------------------------------- launch


class _DeviceLayout(NamedTuple):
    """A :class:`~e3attn.kernels.layout.KernelLayout` as device tensors, with the coefficients also listed by
    ``i`` and by ``j`` (CSR pointers) for the backward."""

    ptr_p: torch.Tensor
    coeff_x: torch.Tensor
    coeff_y: torch.Tensor
    coeff_p: torch.Tensor
    coeff_c: torch.Tensor
    ptr_x: torch.Tensor
    order_x: torch.Tensor
    ptr_sh: torch.Tensor
    order_sh: torch.Tensor
    blocks: torch.Tensor
    channels: torch.Tensor
    max_width: int
    max_dim: int


_DEVICE_LAYOUTS: Dict[Tuple[int, torch.device, torch.dtype], _DeviceLayout] = {}


def _pointers(keys: np.ndarray, size: int) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(np.bincount(keys, minlength=size))])


def _device_layout(layout: KernelLayout, x_dim: int, sh_dim: int, device: torch.device,
                   dtype: torch.dtype) -> _DeviceLayout:
    key = (id(layout), device, dtype)
    found = _DEVICE_LAYOUTS.get(key)
    if found is None:
        def ints(values) -> torch.Tensor:
            return torch.as_tensor(np.ascontiguousarray(values), dtype=torch.int32, device=device)

        found = _DEVICE_LAYOUTS[key] = _DeviceLayout(
            ptr_p=ints(_pointers(layout.path_p, layout.num_paths)),
            coeff_x=ints(layout.path_x), coeff_y=ints(layout.path_y), coeff_p=ints(layout.path_p),
            coeff_c=torch.as_tensor(layout.path_c, dtype=dtype, device=device),
            ptr_x=ints(_pointers(layout.path_x, x_dim)), order_x=ints(np.argsort(layout.path_x, kind="stable")),
            ptr_sh=ints(_pointers(layout.path_y, sh_dim)), order_sh=ints(np.argsort(layout.path_y, kind="stable")),
            blocks=ints(layout.blocks), channels=ints(layout.channels),
            max_width=int(layout.blocks[:, 4].max(initial=1)), max_dim=int(layout.blocks[:, 3].max(initial=1)),
        )
    return found


def _sizes(device: torch.device, hidden_sizes: List[int], numel) -> Tuple[torch.Tensor, ...]:
    sizes = np.asarray(hidden_sizes, dtype=np.int64)
    numel = np.asarray(numel, dtype=np.int64)
    values = (np.cumsum([0, *sizes[:-1]]), sizes, np.cumsum([0, *(sizes * numel)[:-1]]), numel)
    return tuple(torch.as_tensor(v, dtype=torch.int32, device=device) for v in values)


def _pow2(n: int, least: int) -> int:
    return max(least, triton.next_power_of_2(max(n, 1)))


def _paths(layout: KernelLayout, dev: _DeviceLayout, x, index, sh) -> torch.Tensor:
    num = sh.shape[0]
    y = sh.new_empty(num, layout.num_paths)
    _paths_kernel[(triton.cdiv(num, BLOCK_E),)](
        x, index if index is not None else sh, sh, dev.ptr_p, dev.coeff_x, dev.coeff_y, dev.coeff_c, y,
        num, layout.num_paths, x.shape[1], sh.shape[1], HAS_INDEX=index is not None, BLOCK=BLOCK_E)
    return y


def _block_arguments(layout: KernelLayout, dev: _DeviceLayout, hidden, hidden_sizes: List[int]):
    grid = (triton.cdiv(hidden.shape[0], BLOCK_E), layout.blocks.shape[0], triton.cdiv(dev.max_width, BLOCK_W))
    constants = dict(BLOCK=BLOCK_E, BLOCK_W=BLOCK_W, BLOCK_H=_pow2(max(hidden_sizes, default=1), 16),
                     BLOCK_M=_pow2(dev.max_dim, 1))
    return grid, (dev.blocks, dev.channels, *_sizes(hidden.device, hidden_sizes, layout.weight_numel)), constants


def forward(layout: KernelLayout, x: torch.Tensor, index: Optional[torch.Tensor], sh: torch.Tensor,
            hidden: torch.Tensor, linear: torch.Tensor, hidden_sizes: List[int]) -> torch.Tensor:
    """:math:`F(x, Y, h, L)`, ``[E, out_dim]`` (contiguous arguments on one device, checked by the caller)."""
    num = sh.shape[0]
    out = sh.new_zeros(num, layout.out_dim)  # columns of outputs without paths stay zero
    if num == 0 or layout.blocks.shape[0] == 0:
        return out
    dev = _device_layout(layout, x.shape[1], sh.shape[1], sh.device, sh.dtype)
    y = _paths(layout, dev, x, index, sh)
    grid, structure, constants = _block_arguments(layout, dev, hidden, hidden_sizes)
    _blocks_kernel[grid](y, hidden, linear, *structure, out, num, layout.num_paths, hidden.shape[1], layout.out_dim,
                         **constants)
    return out


def backward(layout: KernelLayout, x: torch.Tensor, index: Optional[torch.Tensor], sh: torch.Tensor,
             hidden: torch.Tensor, linear: torch.Tensor, hidden_sizes: List[int], grad: torch.Tensor,
             need_inputs: bool, need_hidden: bool, need_linear: bool
             ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of :math:`\\langle g, F \\rangle`: of the gathered ``x`` per edge ``[E, x_dim]`` and of
    ``sh`` (when ``need_inputs``), of ``hidden`` and of ``linear`` (empty where not needed)."""
    num = sh.shape[0]
    gx = x.new_zeros(num if need_inputs else 0, x.shape[1])
    gsh = sh.new_zeros(num if need_inputs else 0, sh.shape[1])
    ghidden = hidden.new_zeros(num if need_hidden else 0, hidden.shape[1])
    glinear = linear.new_zeros(linear.shape[0] if need_linear else 0)
    if num == 0 or layout.blocks.shape[0] == 0 or not (need_inputs or need_hidden or need_linear):
        return gx, gsh, ghidden, glinear
    dev = _device_layout(layout, x.shape[1], sh.shape[1], sh.device, sh.dtype)
    y = _paths(layout, dev, x, index, sh) if need_hidden or need_linear else sh.new_empty(0)
    gy = sh.new_zeros(num if need_inputs else 0, layout.num_paths)
    grid, structure, constants = _block_arguments(layout, dev, hidden, hidden_sizes)
    _blocks_backward_kernel[grid](
        grad, y, hidden, linear, *structure, gy, ghidden, glinear, num, layout.num_paths, hidden.shape[1],
        layout.out_dim, NEED_Y=need_inputs, NEED_HIDDEN=need_hidden, NEED_LINEAR=need_linear, **constants)
    if need_inputs:
        _paths_backward_kernel[(triton.cdiv(num, BLOCK_E),)](
            gy, x, index if index is not None else sh, sh, dev.ptr_x.shape[0] - 1, dev.ptr_x, dev.order_x,
            dev.ptr_sh.shape[0] - 1, dev.ptr_sh, dev.order_sh, dev.coeff_x, dev.coeff_y, dev.coeff_p, dev.coeff_c,
            gx, gsh, num, layout.num_paths, x.shape[1], sh.shape[1], HAS_INDEX=index is not None, BLOCK=BLOCK_E)
    return gx, gsh, ghidden, glinear

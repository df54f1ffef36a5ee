r"""The fused tensor product as PyTorch custom operators, differentiable to any order.

``e3attn::fused_product`` computes :math:`z = F(x, Y, h, L)` (every output of a
:class:`~e3attn.tensor_product.SphericalTensorProduct`, concatenated),
``e3attn::fused_product_backward`` its four gradients :math:`B = (B_x, B_Y, B_h, B_L)` for an output
gradient :math:`g`, and ``e3attn::fused_product_backward_backward`` the backward of that. They take
the product's irreps as a string (its structure comes from
:func:`~e3attn.kernels.layout.layout_for`), the hidden features of all outputs side by side
``[E, sum_t h_t]`` and the last layers flattened and concatenated.

:math:`F` is linear in each of :math:`x, Y, h, L` separately. For the gradients :math:`v_a` arriving
at :math:`B_a(g; x, Y, h, L)`:

.. math::

    \frac{\partial}{\partial g} \sum_a \langle v_a, B_a \rangle = \sum_a F(\ldots, a \to v_a, \ldots),
    \qquad
    \frac{\partial}{\partial b} \sum_a \langle v_a, B_a \rangle = \sum_{a \ne b} B_b(g; \ldots, a \to v_a, \ldots)

(the directional derivative of :math:`\langle g, F \rangle` along :math:`v`). The backward of the
backward computes this in one fused pass; when it must itself be differentiable (a third
derivative), it calls :math:`F` and :math:`B` with one argument replaced instead, so every
derivative stays on the fused kernels.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np
import torch

from . import cpu
from .backends import backend
from .layout import layout_for, output_dim
from .threads import parallel

__all__ = ["fused_product", "fused_product_backward", "fused_product_backward_backward"]


def _offsets(sizes) -> np.ndarray:
    return np.cumsum([0, *sizes[:-1]]).astype(np.int64)


def _array(t: Optional[torch.Tensor]) -> np.ndarray:
    """A contiguous NumPy view of ``t`` (an empty one for None)."""
    return np.empty(0, np.int64) if t is None else t.detach().contiguous().numpy()


def _structure(layout, hidden_sizes: List[int], dtype: np.dtype) -> tuple:
    """The ``structure`` tuple of the CPU kernels (:mod:`e3attn.kernels.cpu`)."""
    hidden_sizes = np.asarray(hidden_sizes, dtype=np.int64)
    numel = np.asarray(layout.weight_numel, dtype=np.int64)
    widths, dims = layout.blocks[:, 4], layout.blocks[:, 3]
    return (
        layout.path_x, layout.path_y, layout.path_p, layout.path_c.astype(dtype), layout.num_paths,
        layout.blocks, layout.channels, _offsets(hidden_sizes), hidden_sizes, _offsets(hidden_sizes * numel), numel,
        int((widths * layout.blocks[:, 2]).max(initial=1)), int(widths.max(initial=1)), int(dims.max(initial=1)),
    )


def _cpu_arguments(spec: str, tile: int, x, index, sh, hidden, linear, hidden_sizes: List[int]):
    """The arguments shared by the CPU kernels: the data as NumPy arrays, the structure, the tile."""
    layout = layout_for(spec)
    _check_arguments(layout, x, index, sh, hidden, linear, hidden_sizes)
    data = tuple(_array(t) for t in (x, index if index is not None else torch.arange(sh.shape[0]), sh, hidden,
                                      linear))
    return data, _structure(layout, hidden_sizes, data[0].dtype), _tile(tile, layout, sh.dtype)


def _check_arguments(layout, x, index, sh, hidden, linear, hidden_sizes: List[int]) -> None:
    """The kernels index without bounds checks: refuse anything that would make them read out of range."""
    num = sh.shape[0]
    if hidden.dim() != 2 or hidden.shape[0] != num or hidden.shape[1] != sum(hidden_sizes):
        raise ValueError(f"hidden must have shape [{num}, {sum(hidden_sizes)}], got {list(hidden.shape)}")
    expected = sum(h * n for h, n in zip(hidden_sizes, layout.weight_numel))
    if linear.dim() != 1 or linear.shape[0] != expected or len(hidden_sizes) != len(layout.weight_numel):
        raise ValueError(f"linear must have shape [{expected}] (hidden_sizes {list(hidden_sizes)}), got "
                         f"{list(linear.shape)}")
    if x.dim() != 2 or sh.dim() != 2 or (index is None and x.shape[0] != num):
        raise ValueError(f"x and sh must be 2-d with one row per edge (or an index), got {list(x.shape)}, "
                         f"{list(sh.shape)}")
    if x.shape[1] <= int(layout.path_x.max(initial=-1)) or sh.shape[1] <= int(layout.path_y.max(initial=-1)):
        raise ValueError(f"x and sh have too few columns for this product: {list(x.shape)}, {list(sh.shape)}")
    if index is not None:
        if index.shape != (num,):
            raise ValueError(f"index must have shape [{num}], got {list(index.shape)}")
        if num and (int(index.min()) < 0 or int(index.max()) >= x.shape[0]):
            raise IndexError(f"index must be in [0, {x.shape[0]}) (the rows of x), got values in "
                             f"[{int(index.min())}, {int(index.max())}]")


def _gradient_buffers(x, sh, hidden, linear, need_inputs: bool, need_hidden: bool, need_linear: bool):
    """Uninitialised outputs of the backward kernels: per-edge gradients of the gathered ``x``, of ``sh``,
    ``hidden``, and one gradient of ``linear`` per group of tiles (empty where not needed)."""
    num = sh.shape[0]
    return (x.new_empty(num if need_inputs else 0, x.shape[1]), sh.new_empty(num if need_inputs else 0, sh.shape[1]),
            hidden.new_empty(num if need_hidden else 0, hidden.shape[1]),
            linear.new_empty(cpu.GROUPS, linear.shape[0] if need_linear else 0))


def _gradients(x, index, needs, gx_edges, gsh, ghidden, glin_groups):
    """The four gradients from the kernels' buffers (empty where not in ``needs``)."""
    need_x, need_sh, need_hidden, need_linear = needs
    empty = x.new_empty(0)
    if not need_x:
        gx = empty
    elif index is None:
        gx = gx_edges
    else:
        gx = torch.zeros_like(x).index_add_(0, index, gx_edges)
    return (gx, gsh if need_sh else empty.clone(), ghidden if need_hidden else empty.clone(),
            glin_groups.sum(0) if need_linear else empty.clone())


def _work(sh: torch.Tensor, linear: torch.Tensor) -> int:
    """The multiply-adds of the product's weights on every edge (most of a kernel's), for :func:`parallel`."""
    return sh.shape[0] * linear.shape[0]


def _forward_groups(num: int, tile: int) -> int:
    """Groups of tiles of the forward: a few per thread (no reduction: any split gives the same result)."""
    return max(1, min((num + tile - 1) // tile, 4 * torch.get_num_threads()))


def _tile(tile: int, layout, dtype: torch.dtype) -> int:
    """``tile``, or by default the power of two (64 to 128) whose widest block weights take about 1 MiB.

    Measured on the guide (blocks of up to 330 weights: 128 best) and the large configuration (7,168: 64)."""
    if tile > 0:
        return tile
    widest = int((layout.blocks[:, 2] * layout.blocks[:, 4]).max(initial=1))
    fit = (1 << 20) // (widest * torch.finfo(dtype).bits // 8)
    return 1 << max(6, min(7, fit.bit_length() - 1))


def _on_numba(sh: torch.Tensor) -> bool:
    """Whether the numba kernels (True) or the Triton kernels (False) run tensors on the device of ``sh``."""
    return backend(sh.device) == "numba"


def _triton_arguments(spec: str, x, index, sh, hidden, linear, hidden_sizes: List[int]):
    """The layout and the contiguous tensors for :mod:`e3attn.kernels.gpu`."""
    from . import gpu  # imports triton: only where it runs

    layout = layout_for(spec)
    _check_arguments(layout, x, index, sh, hidden, linear, hidden_sizes)
    tensors = (t.contiguous() if t is not None else None for t in (x, index, sh, hidden, linear))
    return gpu, (layout, *tensors, hidden_sizes)


@torch.library.custom_op("e3attn::fused_product", mutates_args=())
def fused_product(spec: str, tile: int, x: torch.Tensor, index: Optional[torch.Tensor], sh: torch.Tensor,
                  hidden: torch.Tensor, linear: torch.Tensor, hidden_sizes: List[int]) -> torch.Tensor:
    """:math:`F`: every output of the product named by ``spec``, concatenated ``[E, out_dim]``."""
    if not _on_numba(sh):
        gpu, arguments = _triton_arguments(spec, x, index, sh, hidden, linear, hidden_sizes)
        return gpu.forward(*arguments)
    out = sh.new_empty(sh.shape[0], output_dim(spec))
    data, structure, tile = _cpu_arguments(spec, tile, x, index, sh, hidden, linear, hidden_sizes)
    groups, array = _forward_groups(sh.shape[0], tile), out.numpy()
    parallel(lambda group: cpu.forward(*data, structure, tile, group, groups, array), groups, _work(sh, linear))
    return out


@fused_product.register_fake
def _(spec, tile, x, index, sh, hidden, linear, hidden_sizes):
    return sh.new_empty(sh.shape[0], output_dim(spec))


@torch.library.custom_op("e3attn::fused_product_backward", mutates_args=())
def fused_product_backward(spec: str, tile: int, x: torch.Tensor, index: Optional[torch.Tensor], sh: torch.Tensor,
                           hidden: torch.Tensor, linear: torch.Tensor, hidden_sizes: List[int], grad: torch.Tensor,
                           needs: List[bool]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:math:`B`: the gradients of ``x``, ``sh``, ``hidden`` and ``linear`` flagged in ``needs`` (others empty)."""
    need_inputs = needs[0] or needs[1]
    if not _on_numba(sh):
        gpu, arguments = _triton_arguments(spec, x, index, sh, hidden, linear, hidden_sizes)
        gx, gsh, ghidden, glinear = gpu.backward(*arguments, grad.contiguous(), need_inputs, needs[2], needs[3])
        return _gradients(x, index, needs, gx, gsh, ghidden, glinear[None])
    data, structure, tile = _cpu_arguments(spec, tile, x, index, sh, hidden, linear, hidden_sizes)
    buffers = _gradient_buffers(x, sh, hidden, linear, need_inputs, needs[2], needs[3])
    arrays = [t.numpy() for t in buffers]
    parallel(lambda group: cpu.backward(*data, _array(grad), structure, tile, need_inputs, needs[2], needs[3],
                                         *arrays, group), cpu.GROUPS, 2 * _work(sh, linear))
    return _gradients(x, index, needs, *buffers)


@fused_product_backward.register_fake
def _(spec, tile, x, index, sh, hidden, linear, hidden_sizes, grad, needs):
    return tuple(t.new_empty(t.shape) if need else t.new_empty(0) for t, need in zip((x, sh, hidden, linear), needs))


@torch.library.custom_op("e3attn::fused_product_backward_backward", mutates_args=())
def fused_product_backward_backward(
    spec: str, tile: int, x: torch.Tensor, index: Optional[torch.Tensor], sh: torch.Tensor, hidden: torch.Tensor,
    linear: torch.Tensor, hidden_sizes: List[int], grad: torch.Tensor, vx: Optional[torch.Tensor],
    vsh: Optional[torch.Tensor], vhidden: Optional[torch.Tensor], vlinear: Optional[torch.Tensor], needs: List[bool],
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""The gradients of :math:`\sum_a \langle v_a, B_a \rangle` with respect to ``grad``, ``x``, ``sh``,
    ``hidden`` and ``linear`` flagged in ``needs`` (others empty), in one pass; None directions are zero.

    CPU tensors only (on CUDA, the backward of the backward is composed from :math:`F` and :math:`B`).
    Not differentiable itself: a third derivative takes :func:`_backward_backward`'s composed path."""
    if not _on_numba(sh):
        raise NotImplementedError("fused_product_backward_backward runs the numba kernels (CPU tensors) only")
    need_grad, need_x, need_sh, need_hidden, need_linear = needs
    need_inputs = need_x or need_sh
    data, structure, tile = _cpu_arguments(spec, tile, x, index, sh, hidden, linear, hidden_sizes)
    ggrad = grad.new_empty(grad.shape[0] if need_grad else 0, grad.shape[1])
    buffers = _gradient_buffers(x, sh, hidden, linear, need_inputs, need_hidden, need_linear)
    directions = [_array(v) if v is not None else np.empty((0, 0), data[0].dtype) for v in (vx, vsh, vhidden)]
    arrays = [ggrad.numpy(), *(t.numpy() for t in buffers)]
    vlin = _array(vlinear) if vlinear is not None else np.empty(0, data[0].dtype)
    parallel(lambda group: cpu.backward_backward(*data, _array(grad), *directions, vlin, structure, tile, need_grad,
                                                  need_inputs, need_hidden, need_linear, *arrays, group), cpu.GROUPS,
             3 * _work(sh, linear))
    return (ggrad, *_gradients(x, index, needs[1:], *buffers))


@fused_product_backward_backward.register_fake
def _(spec, tile, x, index, sh, hidden, linear, hidden_sizes, grad, vx, vsh, vhidden, vlinear, needs):
    return tuple(t.new_empty(t.shape) if need else t.new_empty(0)
                 for t, need in zip((grad, x, sh, hidden, linear), needs))


# ---------------------------------------------------------------------- autograd


def _save(ctx, inputs, output) -> None:
    spec, tile, x, index, sh, hidden, linear, hidden_sizes = inputs[:8]
    ctx.meta = (spec, tile, hidden_sizes)
    ctx.save_for_backward(x, index, sh, hidden, linear, *inputs[8:9])


def _product_backward(ctx, grad: torch.Tensor):
    spec, tile, hidden_sizes = ctx.meta
    x, index, sh, hidden, linear = ctx.saved_tensors
    needs = [ctx.needs_input_grad[i] for i in (2, 4, 5, 6)]
    if not any(needs):
        return (None,) * 8
    found = fused_product_backward(spec, tile, x, index, sh, hidden, linear, hidden_sizes, grad.contiguous(), needs)
    gx, gsh, gh, gl = (g if need else None for g, need in zip(found, needs))
    return None, None, gx, None, gsh, gh, gl, None


fused_product.register_autograd(_product_backward, setup_context=_save)


def _save_backward(ctx, inputs, output) -> None:
    _save(ctx, inputs, output)
    ctx.needs = inputs[9]
    ctx.set_materialize_grads(False)  # an output without a gradient costs nothing (not a zero-filled tensor)


def _backward_backward(ctx, *vs: torch.Tensor):
    """Gradients of :math:`\\sum_a \\langle v_a, B_a \\rangle` by the multilinearity of :math:`F` (module docstring):
    one fused pass (numba), or, when this must itself be differentiable (``create_graph``) or runs on CUDA,
    calls of :math:`F` and :math:`B` with one argument replaced."""
    spec, tile, hidden_sizes = ctx.meta
    x, index, sh, hidden, linear, grad = ctx.saved_tensors
    args = [x, sh, hidden, linear]
    wanted = [ctx.needs_input_grad[i] for i in (2, 4, 5, 6)]
    want_grad = ctx.needs_input_grad[8]
    vs = [v if v is not None and computed else None for v, computed in zip(vs, ctx.needs)]
    if not torch.is_grad_enabled() and _on_numba(sh):
        needs = [want_grad, *wanted]
        found = fused_product_backward_backward(spec, tile, x, index, sh, hidden, linear, hidden_sizes, grad, *vs,
                                                needs)
        g_grad, gx, gsh, gh, gl = (g if need else None for g, need in zip(found, needs))
        return None, None, gx, None, gsh, gh, gl, None, g_grad, None
    found: List[Optional[torch.Tensor]] = [None] * 4
    g_grad = None
    for a, v in enumerate(vs):
        if v is None:
            continue
        replaced = args[:a] + [v] + args[a + 1 :]
        if want_grad:
            z = fused_product(spec, tile, replaced[0], index, replaced[1], replaced[2], replaced[3], hidden_sizes)
            g_grad = z if g_grad is None else g_grad + z
        needs = [want and b != a for b, want in enumerate(wanted)]
        if any(needs):
            parts = fused_product_backward(spec, tile, replaced[0], index, replaced[1], replaced[2], replaced[3],
                                           hidden_sizes, grad, needs)
            for b, need in enumerate(needs):
                if need:
                    found[b] = parts[b] if found[b] is None else found[b] + parts[b]
    return None, None, found[0], None, found[1], found[2], found[3], None, g_grad, None


fused_product_backward.register_autograd(_backward_backward, setup_context=_save_backward)

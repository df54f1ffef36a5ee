r"""The fused tensor product as two PyTorch custom operators, differentiable to any order.

``e3attn::fused_product`` computes :math:`z = F(x, Y, h, L)` (every output of a
:class:`~e3attn.tensor_product.SphericalTensorProduct`, concatenated) and
``e3attn::fused_product_backward`` its four gradients :math:`B = (B_x, B_Y, B_h, B_L)` for an output
gradient :math:`g`. Both take the product's irreps as a string (its structure comes from
:func:`~e3attn.kernels.layout.layout_for`), the hidden features of all outputs side by side
``[E, sum_t h_t]`` and the last layers flattened and concatenated.

:math:`F` is linear in each of :math:`x, Y, h, L` separately, so the second derivative needs no
kernel of its own. For the gradients :math:`v_a` arriving at :math:`B_a(g; x, Y, h, L)`:

.. math::

    \frac{\partial}{\partial g} \sum_a \langle v_a, B_a \rangle = \sum_a F(\ldots, a \to v_a, \ldots),
    \qquad
    \frac{\partial}{\partial b} \sum_a \langle v_a, B_a \rangle = \sum_{a \ne b} B_b(g; \ldots, a \to v_a, \ldots)

(the directional derivative of :math:`\langle g, F \rangle` along :math:`v`), so the backward of the
backward calls the same two operators again, with one argument replaced, and every derivative
stays on the fused kernels.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import numba
import numpy as np
import torch

from . import cpu
from .layout import layout_for

__all__ = ["fused_product", "fused_product_backward"]

_INPUTS = ("x", "sh", "hidden", "linear")


def _offsets(sizes) -> np.ndarray:
    return np.cumsum([0, *sizes[:-1]]).astype(np.int64)


def _cpu_arguments(spec: str, x, index, sh, hidden, linear, hidden_sizes: List[int]):
    """The arguments shared by both CPU kernels, as contiguous NumPy arrays."""
    layout = layout_for(spec)
    hidden_sizes = np.asarray(hidden_sizes, dtype=np.int64)
    numel = np.asarray(layout.weight_numel, dtype=np.int64)
    if index is None:
        index = torch.arange(sh.shape[0])
    widths, dims = layout.blocks[:, 4], layout.blocks[:, 3]
    return (
        x.detach().contiguous().numpy(), index.contiguous().numpy(), sh.detach().contiguous().numpy(),
        hidden.detach().contiguous().numpy(), linear.detach().contiguous().numpy(),
    ), (
        layout.path_x, layout.path_y, layout.path_p, layout.path_c.astype(x.numpy().dtype), layout.num_paths,
        layout.blocks, layout.channels, _offsets(hidden_sizes), hidden_sizes, _offsets(hidden_sizes * numel), numel,
        int((widths * layout.blocks[:, 2]).max(initial=1)), int(widths.max(initial=1)), int(dims.max(initial=1)),
    )


def _threads() -> None:
    """Run the kernels on as many threads as PyTorch's operations."""
    numba.set_num_threads(max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)))


def _tile(tile: int) -> int:
    return tile if tile > 0 else 64  # measured best of 8-64 on the guide configuration


def _check_device(sh: torch.Tensor) -> None:
    if sh.device.type != "cpu":
        raise NotImplementedError(f"no fused tensor product kernel for device {sh.device.type!r}")


@torch.library.custom_op("e3attn::fused_product", mutates_args=())
def fused_product(spec: str, tile: int, x: torch.Tensor, index: Optional[torch.Tensor], sh: torch.Tensor,
                  hidden: torch.Tensor, linear: torch.Tensor, hidden_sizes: List[int]) -> torch.Tensor:
    """:math:`F`: every output of the product named by ``spec``, concatenated ``[E, out_dim]``."""
    _check_device(sh)
    layout = layout_for(spec)
    out = sh.new_empty(sh.shape[0], layout.out_dim)
    data, structure = _cpu_arguments(spec, x, index, sh, hidden, linear, hidden_sizes)
    _threads()
    cpu.forward(*data, *structure, _tile(tile), out.numpy())
    return out


@fused_product.register_fake
def _(spec, tile, x, index, sh, hidden, linear, hidden_sizes):
    return sh.new_empty(sh.shape[0], layout_for(spec).out_dim)


@torch.library.custom_op("e3attn::fused_product_backward", mutates_args=())
def fused_product_backward(spec: str, tile: int, x: torch.Tensor, index: Optional[torch.Tensor], sh: torch.Tensor,
                           hidden: torch.Tensor, linear: torch.Tensor, hidden_sizes: List[int], grad: torch.Tensor,
                           needs: List[bool]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:math:`B`: the gradients of ``x``, ``sh``, ``hidden`` and ``linear`` flagged in ``needs`` (others empty)."""
    _check_device(sh)
    need_x, need_sh, need_hidden, need_linear = needs
    need_inputs = need_x or need_sh
    data, structure = _cpu_arguments(spec, x, index, sh, hidden, linear, hidden_sizes)
    num = sh.shape[0]
    gx_edges = x.new_empty(num if need_inputs else 0, x.shape[1])
    gsh = sh.new_empty(num if need_inputs else 0, sh.shape[1])
    ghidden = hidden.new_empty(num if need_hidden else 0, hidden.shape[1])
    glin_groups = linear.new_empty(cpu.GROUPS, linear.shape[0] if need_linear else 0)
    _threads()
    cpu.backward(*data, grad.detach().contiguous().numpy(), *structure, _tile(tile), need_inputs, need_hidden,
                 need_linear, gx_edges.numpy(), gsh.numpy(), ghidden.numpy(), glin_groups.numpy())
    empty = x.new_empty(0)
    if not need_x:
        gx = empty
    elif index is None:
        gx = gx_edges
    else:
        gx = torch.zeros_like(x).index_add_(0, index, gx_edges)
    glin = glin_groups.sum(0) if need_linear else empty.clone()
    return gx, (gsh if need_sh else empty.clone()), ghidden if need_hidden else empty.clone(), glin


@fused_product_backward.register_fake
def _(spec, tile, x, index, sh, hidden, linear, hidden_sizes, grad, needs):
    return tuple(t.new_empty(t.shape) if need else t.new_empty(0) for t, need in zip((x, sh, hidden, linear), needs))


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


def _backward_backward(ctx, *vs: torch.Tensor):
    """Gradients of :math:`\\sum_a \\langle v_a, B_a \\rangle` by the multilinearity of :math:`F` (module docstring)."""
    spec, tile, hidden_sizes = ctx.meta
    x, index, sh, hidden, linear, grad = ctx.saved_tensors
    args = [x, sh, hidden, linear]
    wanted = [ctx.needs_input_grad[i] for i in (2, 4, 5, 6)]
    want_grad = ctx.needs_input_grad[8]
    found: List[Optional[torch.Tensor]] = [None] * 4
    g_grad = None
    for a, (v, computed) in enumerate(zip(vs, ctx.needs)):
        if v is None or not computed:
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

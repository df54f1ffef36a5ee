r"""The segment softmax with its first two derivatives in closed form (for autograd), as ``e3attn._jet`` for
elementwise functions.

For logits :math:`s` ``[E, H]`` grouped into segments (the incoming edges of a node),
:math:`\alpha = \mathrm{softmax}(s)` and :math:`\beta = \sqrt{\alpha}` per segment. With :math:`S(x)_e =
\sum_{e' \sim e} x_{e'}` the sum over the segment of :math:`e`, the gradient in :math:`s` of
:math:`\langle g_\alpha, \alpha \rangle + \langle g_\beta, \beta \rangle` is

.. math::

    \nabla_s = t - \alpha\, S(t), \qquad t = \alpha\, g_\alpha + \tfrac12 \beta\, g_\beta,

and, :math:`S` being self-adjoint, that gradient's own derivatives along :math:`u` (a force-training step's second
derivative) are, with :math:`\tilde u = u - S(u \alpha)`,

.. math::

    \partial_{g_\alpha} = \tilde u\, \alpha, \qquad \partial_{g_\beta} = \tfrac12 \tilde u\, \beta, \qquad
    \partial_s = \text{the gradient above for } g_\alpha \to \tilde u\, g_\alpha - u\, S(t),\
    g_\beta \to \tfrac12 \tilde u\, g_\beta:

a few segment sums and products, where autograd would record the softmax's formula, then its derivative's. A
third derivative, batched gradients and the cases of ``e3attn._jet`` take the plain formula.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from ._jet import closed_forms_apply, plain_gradient, plain_second_derivatives, transformed

__all__ = ["softmax_with_closed_form_derivatives"]

Plain = Callable[[torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]


def softmax_with_closed_form_derivatives(src: torch.Tensor, index: torch.Tensor, num_segments: int, plain: Plain,
                                         segment_sum: Callable) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""``plain(src) = (alpha, sqrt_alpha)``, differentiated in closed form (see the module docstring) with the
    segment sums ``segment_sum(x, index, num_segments)`` ``[num_segments, ...]``; ``plain`` itself where closed
    forms are not used."""
    if not closed_forms_apply(src):
        return plain(src)
    return _Softmax.apply(src, index, num_segments, plain, segment_sum)


def _segment(sums: Callable, x: torch.Tensor, index: torch.Tensor, num_segments: int) -> torch.Tensor:
    """:math:`S(x)`: the sum over each row's segment, per row."""
    return sums(x, index, num_segments).index_select(0, index)


def _gradient(g_alpha: Optional[torch.Tensor], g_beta: Optional[torch.Tensor], alpha: torch.Tensor,
              beta: torch.Tensor, segment: Callable[[torch.Tensor], torch.Tensor]):
    """``(t - alpha S(t), S(t))``, ``t = alpha g_alpha + beta g_beta / 2`` (a missing gradient is 0)."""
    t = alpha * g_alpha if g_alpha is not None else None
    if g_beta is not None:
        half = 0.5 * beta * g_beta
        t = half if t is None else t + half
    if t is None:
        t = torch.zeros_like(alpha)
    total = segment(t)
    return t - alpha * total, total


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, src, index, num_segments, plain, segment_sum):
        with torch.no_grad():
            alpha, beta = plain(src)
        ctx.save_for_backward(src, index, alpha, beta)
        ctx.functions = num_segments, plain, segment_sum
        ctx.set_materialize_grads(False)
        return alpha, beta

    @staticmethod
    def backward(ctx, g_alpha, g_beta):
        src, index, alpha, beta = ctx.saved_tensors
        num_segments, plain, segment_sum = ctx.functions
        if any(g is not None and transformed(g) for g in (g_alpha, g_beta)):  # batched: of the plain formula
            return plain_gradient(plain, src, (g_alpha, g_beta)), None, None, None, None
        g_s = _Gradient.apply(g_alpha, g_beta, src, index, alpha.detach(), beta.detach(), num_segments, plain,
                              segment_sum)
        return g_s, None, None, None, None


class _Gradient(torch.autograd.Function):
    """The gradient in the logits, differentiable once more in closed form."""

    @staticmethod
    def forward(ctx, g_alpha, g_beta, src, index, alpha, beta, num_segments, plain, segment_sum):
        segment = lambda x: _segment(segment_sum, x, index, num_segments)  # noqa: E731
        g_s, total = _gradient(g_alpha, g_beta, alpha, beta, segment)
        ctx.save_for_backward(g_alpha, g_beta, src, index, alpha, beta, total)
        ctx.functions = num_segments, plain, segment_sum
        ctx.set_materialize_grads(False)
        return g_s

    @staticmethod
    def backward(ctx, u):
        g_alpha, g_beta, src, index, alpha, beta, total = ctx.saved_tensors
        num_segments, plain, segment_sum = ctx.functions
        none = (None,) * 6
        if u is None:
            return (None, None, None) + none
        if torch.is_grad_enabled() or transformed(u):  # a third derivative, batched gradients: the plain formula's
            (ga, gb), gs = plain_second_derivatives(plain, src, (g_alpha, g_beta), u)
            return (ga, gb, gs) + none
        segment = lambda x: _segment(segment_sum, x, index, num_segments)  # noqa: E731
        tilde = u - segment(u * alpha)
        half = 0.5 * tilde
        ga = tilde * alpha if ctx.needs_input_grad[0] else None
        gb = half * beta if ctx.needs_input_grad[1] else None
        on_alpha = -u * total if g_alpha is None else tilde * g_alpha - u * total
        gs = _gradient(on_alpha, None if g_beta is None else half * g_beta, alpha, beta, segment)[0]
        return (ga, gb, gs) + none

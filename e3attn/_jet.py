r"""Elementwise functions of one variable with their first two derivatives in closed form (for autograd).

A force-training step differentiates the model twice, and PyTorch's autograd records every operation of a
function's formula, then of its derivative's, each a kernel launch. For a function of one variable applied
elementwise (the radial basis, the cutoffs), :func:`jet` instead computes its value :math:`f(x)` and derivatives
:math:`f'(x), f''(x)` without recording them, and differentiates with them:

.. math::

    \partial_x \langle g, f(x) \rangle = \textstyle\sum_k g_k f_k'(x), \qquad
    \partial_g \text{ and } \partial_x \text{ of that along } u:\ u f'(x),\ u \textstyle\sum_k g_k f_k''(x)

(a few operations each way, whatever the formula). Inside :func:`first_derivatives_only` (a caller that will take
one derivative, such as forces for molecular dynamics) :math:`f''` is left out, and computed again only if a
second derivative is taken after all. A third derivative, a derivative inside ``torch.compile``,
a ``torch.func`` transform, batched gradients (``is_grads_batched``) or forward-mode AD is that of the plain
formula (``plain``): the same derivatives to rounding, wherever the plain formula's own are accurate (for the
Bessel basis near :math:`r = 0` the closed forms are the more accurate). Forward-mode AD through a graph
recorded outside it is not supported.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Iterator, Optional, Tuple

import torch

Plain = Callable[[torch.Tensor], torch.Tensor]
Jet = Callable[[torch.Tensor, bool], Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]]


_SECOND = contextvars.ContextVar("e3attn_jet_second", default=True)


@contextlib.contextmanager
def first_derivatives_only() -> Iterator[None]:
    """Within the block, :func:`jet` prepares first derivatives only (see the module docstring)."""
    token = _SECOND.set(False)
    try:
        yield
    finally:
        _SECOND.reset(token)


def jet(x: torch.Tensor, plain: Plain, derivatives: Jet) -> torch.Tensor:
    """``plain(x)`` (``x [...]`` to ``[...]`` or ``[..., K]``), differentiated with ``derivatives(x, second) =
    (f, f', f'' if second else None)`` (see the module docstring); ``plain`` itself where closed forms are not
    used."""
    if (not (x.requires_grad and torch.is_grad_enabled()) or torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()
            or torch.autograd.forward_ad._current_level >= 0):
        return plain(x)
    return _Value.apply(x, plain, derivatives)


def _transformed(grad: torch.Tensor) -> bool:
    """Whether a gradient reaches a backward batched or inside a ``torch.func`` transform."""
    return torch._C._are_functorch_transforms_active() or torch._C._functorch.is_batchedtensor(grad)


def _sum_trailing(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``t`` summed over its dimensions beyond those of ``x`` (the components ``K`` of a vector function)."""
    return t.sum(-1) if t.dim() > x.dim() else t


def _along(u: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``u [...]`` times ``d [...]`` or ``[..., K]``."""
    return u[..., None] * d if d.dim() > u.dim() else u * d


class _Value(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plain, derivatives):
        with torch.no_grad():
            f, d1, d2 = derivatives(x, _SECOND.get())
        ctx.save_for_backward(x, d1, d2)
        ctx.functions = plain, derivatives
        return f

    @staticmethod
    def backward(ctx, g):
        x, d1, d2 = ctx.saved_tensors
        plain, derivatives = ctx.functions
        if _transformed(g):  # batched gradients (is_grads_batched, vmap): of the plain formula
            with torch.enable_grad():
                (gx,) = torch.autograd.grad(plain(x), x, g, create_graph=torch.is_grad_enabled())
            return gx, None, None
        return _Gradient.apply(g, x, d1, d2, plain, derivatives), None, None


class _Gradient(torch.autograd.Function):
    """``sum_k g_k f_k'(x)``, differentiable once more in closed form."""

    @staticmethod
    def forward(ctx, g, x, d1, d2, plain, derivatives):
        ctx.save_for_backward(g, x, d1, d2)
        ctx.functions = plain, derivatives
        return _sum_trailing(g * d1, x)

    @staticmethod
    def backward(ctx, u):
        g, x, d1, d2 = ctx.saved_tensors
        plain, derivatives = ctx.functions
        if torch.is_grad_enabled() or _transformed(u):  # a third derivative, batched gradients: the plain formula's
            with torch.enable_grad():  # on x and g themselves: the result stays differentiable through them
                g_ = g if g.requires_grad else g.detach().requires_grad_()
                (first,) = torch.autograd.grad(plain(x), x, g_, create_graph=True)
                gg, gx = torch.autograd.grad(first, (g_, x), u, create_graph=torch.is_grad_enabled(),
                                             materialize_grads=True)
            return gg, gx, None, None, None, None
        if d2 is None:  # left out by first_derivatives_only
            d2 = derivatives(x, True)[2]
        return _along(u, d1), u * _sum_trailing(g * d2, x), None, None, None, None

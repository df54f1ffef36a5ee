r"""Elementwise functions of one variable with their first two derivatives in closed form (for autograd).

A force-training step differentiates the model twice, and PyTorch's autograd records every operation of a
function's formula, then of its derivative's, each a kernel launch. For a function of one variable applied
elementwise (the radial basis, the cutoffs, the radial networks' activation), :func:`jet` instead computes its
value :math:`f(x)` and derivatives :math:`f'(x), f''(x)` without recording them, and differentiates with them:

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
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import torch

from ._tracing import tracing

Plain = Callable[[torch.Tensor], torch.Tensor]
Jet = Callable[[torch.Tensor, bool], Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]]


_REDUCED = (torch.float16, torch.bfloat16)

_SECOND = contextvars.ContextVar("e3attn_jet_second", default=True)


@contextlib.contextmanager
def first_derivatives_only() -> Iterator[None]:
    """Within the block, :func:`jet` prepares first derivatives only (see the module docstring)."""
    token = _SECOND.set(False)
    try:
        yield
    finally:
        _SECOND.reset(token)


def jet(x: torch.Tensor, plain: Plain, derivatives: Jet, plain_first: bool = False) -> torch.Tensor:
    """``plain(x)`` (``x [...]`` to ``[...]`` or ``[..., K]``), differentiated with ``derivatives(x, second) =
    (f, f', f'' if second else None)`` (see the module docstring); ``plain`` itself where closed forms are not
    used. With ``plain_first`` (a function whose first derivative autograd takes in one fused operation, such as
    ``silu``), inside :func:`first_derivatives_only` the plain formula runs."""
    if not closed_forms_apply(x) or (plain_first and not _SECOND.get()):
        return plain(x)
    return _Value.apply(x, plain, derivatives)


def closed_forms_apply(x: torch.Tensor) -> bool:
    """Whether a function of ``x`` is differentiated with closed forms: ``x`` requires a gradient, autograd
    records, and neither ``torch.compile`` (or ``make_fx``, :func:`~e3attn._tracing.tracing`), a ``torch.func``
    transform nor forward-mode AD is running."""
    return (x.requires_grad and torch.is_grad_enabled() and not tracing()
            and not torch._C._are_functorch_transforms_active() and torch.autograd.forward_ad._current_level < 0)


def transformed(grad: torch.Tensor) -> bool:
    """Whether a gradient reaches a backward batched (``is_grads_batched``, ``vmap``) or inside a ``torch.func``
    transform."""
    return (torch._C._are_functorch_transforms_active() or torch._C._functorch.is_batchedtensor(grad)
            or torch._C._functorch.is_legacy_batchedtensor(grad))


def plain_gradient(plain: Callable, x: torch.Tensor, cotangents: Sequence[Optional[torch.Tensor]]) -> torch.Tensor:
    r"""The closed forms' fallback for batched gradients: :math:`\sum_j \partial_x \langle g_j, \mathrm{plain}(x)_j
    \rangle` by autograd of the plain formula (a missing cotangent ``g_j`` is zero); differentiable again where
    grad mode is on."""
    with torch.enable_grad():
        outputs = plain(x)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    gs = [torch.zeros_like(o) if g is None else g for g, o in zip(cotangents, outputs)]
    (gx,) = torch.autograd.grad(outputs, x, gs, create_graph=torch.is_grad_enabled())
    return gx


def plain_second_derivatives(plain: Callable, x: torch.Tensor, cotangents: Sequence[Optional[torch.Tensor]],
                             u: torch.Tensor) -> Tuple[List[Optional[torch.Tensor]], torch.Tensor]:
    r"""The closed forms' fallback: the derivatives along ``u`` of the gradient :math:`\sum_j \partial_x
    \langle g_j, \mathrm{plain}(x)_j \rangle` in the cotangents :math:`g_j` (``None`` for those that need none)
    and in ``x``, by autograd of the plain formula; differentiable again where grad mode is on.

    Partial derivatives only: ``x`` and the cotangents enter as aliases, so the caller's graph, through which a
    cotangent depends on ``x`` (in a model it always does), is not walked here as well; autograd follows it with
    the derivatives returned."""
    with torch.enable_grad():
        x_ = x.view_as(x)
        outputs = plain(x_)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        gs = [torch.zeros_like(o) if g is None else (g.view_as(g) if g.requires_grad else g)
              for g, o in zip(cotangents, outputs)]
        (first,) = torch.autograd.grad(outputs, x_, gs, create_graph=True)
        wrt = [g for g in gs if g.requires_grad] + [x_]
        grads = list(torch.autograd.grad(first, wrt, u, create_graph=torch.is_grad_enabled(), materialize_grads=True))
    gx = grads.pop()
    return [grads.pop(0) if g is not None and g.requires_grad else None for g in cotangents], gx


def working(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32 if it is in a reduced precision, else itself."""
    return x.float() if x.dtype in _REDUCED else x


def _sum_trailing(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``t`` summed over its dimensions beyond those of ``x`` (the components ``K`` of a vector function)."""
    return t.sum(-1) if t.dim() > x.dim() else t


def _along(u: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``u [...]`` times ``d [...]`` or ``[..., K]``."""
    return u[..., None] * d if d.dim() > u.dim() else u * d


class _Value(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plain, derivatives):
        # outside autocast, and in float32 at least: a formula in bfloat16 operations (several rounded steps of a
        # derivative) loses digits that autograd's fused derivatives keep
        with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
            f, d1, d2 = derivatives(working(x), _SECOND.get())
        f = f.to(x.dtype)
        ctx.save_for_backward(x, d1, d2)
        ctx.functions = plain, derivatives
        return f

    @staticmethod
    def backward(ctx, g):
        x, d1, d2 = ctx.saved_tensors
        plain, derivatives = ctx.functions
        if transformed(g):  # batched gradients (is_grads_batched, vmap): of the plain formula
            return plain_gradient(plain, x, (g,)), None, None
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
        if torch.is_grad_enabled() or transformed(u):  # a third derivative, batched gradients: the plain formula's
            (gg,), gx = plain_second_derivatives(plain, x, (g,), u)
            return gg, gx, None, None, None, None
        if d2 is None:  # left out by first_derivatives_only
            d2 = derivatives(working(x), True)[2]
        return _along(u, d1), u * _sum_trailing(g * d2, x), None, None, None, None

r"""The heads' products of :class:`~e3attn.node_contraction.NodeContraction` in one pass over the edges (numba).

With ``t [E, heads * K]``, ``b [E, heads]`` and ``h [E, K]`` (the radial networks' hidden features), the
trilinear form :math:`\sum_{e, a, k} t_{e, a K + k}\, b_{e, a}\, h_{e, k}` has three contractions,
:func:`~e3attn.heads.head_dot` (:math:`\partial_b`: the logits), :func:`~e3attn.heads.head_outer`
(:math:`\partial_t`: the values' edge weights) and :func:`~e3attn.heads.head_sum` (:math:`\partial_h`), each
the others' derivative:

.. math::

    s = D(t, h) \Rightarrow \partial_t = O(g, h),\ \partial_h = S(g, t); \qquad
    t = O(b, h) \Rightarrow \partial_b = D(g, h),\ \partial_h = S(b, g).

In PyTorch each is a broadcast product and a sum: a few passes over ``[E, heads, K]`` tensors each way.
:func:`head_dot` and :func:`head_outer` here compute the same in one pass per direction, as
``torch.autograd.Function`` for plain eager CPU tensors (:func:`~e3attn.kernels.eager_on_cpu`). A gradient that must
itself be differentiable (training on forces) is taken with the PyTorch formulas, which autograd differentiates
again.
"""
from __future__ import annotations

import numba
import numpy as np
import torch

from .. import heads
from . import _plain_eager
from .cpu import _JIT, _forward_groups
from .threads import groups_for, parallel

__all__ = ["head_dot", "head_outer"]

_TILE = 256  # edges per group unit (any split gives the same result: no reduction across edges)


@numba.njit(**_JIT)
def _products(t, b, h, heads, gi, groups, out_dot, out_outer, out_sum):
    """For the edges of group ``gi``: ``out_dot = D(t, h)``, ``out_outer = O(b, h)``, ``out_sum = S(b, t)``
    (each where it has rows; the inputs it does not need may be empty)."""
    num, k = h.shape
    zero = np.zeros(1, h.dtype)[0]  # sums in the inputs' dtype
    for e in range(gi * num // groups, (gi + 1) * num // groups):
        he = h[e]
        if out_dot.shape[0]:
            te = t[e]
            for a in range(heads):
                total = zero
                for j in range(k):
                    total += te[a * k + j] * he[j]
                out_dot[e, a] = total
        if out_outer.shape[0]:
            row = out_outer[e]
            for a in range(heads):
                w = b[e, a]
                for j in range(k):
                    row[a * k + j] = w * he[j]
        if out_sum.shape[0]:
            te, row = t[e], out_sum[e]
            row[:] = 0.0
            for a in range(heads):
                w = b[e, a]
                for j in range(k):
                    row[j] += w * te[a * k + j]


def _run(t, b, h, heads: int, dot: bool, outer: bool, summed: bool):
    """The wanted products (``dot``: ``[E, heads]``, ``outer``: ``[E, heads K]``, ``summed``: ``[E, K]``; the
    others empty) on the kernel."""
    num, k = h.shape
    outs = (h.new_empty((num, heads) if dot else (0, heads)), h.new_empty((num, heads * k) if outer else (0, 1)),
            h.new_empty((num, k) if summed else (0, 1)))
    empty = h.new_empty(0, 1).numpy()
    arrays = [x.detach().contiguous().numpy() if x is not None else empty for x in (t, b, h)]
    outputs = [o.numpy() for o in outs]
    work = num * heads * k * (dot + outer + summed)
    groups = groups_for(work, _forward_groups(num, _TILE))
    parallel(lambda g: _products(*arrays, heads, g, groups, *outputs), groups, work)
    return outs


class _HeadDot(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, h):
        ctx.save_for_backward(t, h)
        return _run(t, None, h, t.shape[1] // h.shape[1], True, False, False)[0]

    @staticmethod
    def backward(ctx, g):
        t, h = ctx.saved_tensors
        need_t, need_h = ctx.needs_input_grad
        if torch.is_grad_enabled() or not _plain_eager((g, t, h)):
            return (heads.head_outer(g, h) if need_t else None), (heads.head_sum(g, t) if need_h else None)
        _, gt, gh = _run(t, g.contiguous(), h, g.shape[1], False, need_t, need_h)
        return (gt if need_t else None), (gh if need_h else None)


class _HeadOuter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, b, h):
        ctx.save_for_backward(b, h)
        return _run(None, b, h, b.shape[1], False, True, False)[1]

    @staticmethod
    def backward(ctx, g):
        b, h = ctx.saved_tensors
        need_b, need_h = ctx.needs_input_grad
        if torch.is_grad_enabled() or not _plain_eager((g, b, h)):
            return (heads.head_dot(g, h) if need_b else None), (heads.head_sum(b, g) if need_h else None)
        gb, _, gh = _run(g.contiguous(), b, h, b.shape[1], need_b, False, need_h)
        return (gb if need_b else None), (gh if need_h else None)


def _check(name: str, x: torch.Tensor, h: torch.Tensor, columns: int) -> None:
    if x.dim() != 2 or x.shape[0] != h.shape[0] or x.dtype != h.dtype or x.shape[1] != columns:
        raise ValueError(f"{name} must be a {h.dtype} tensor [{h.shape[0]}, {columns}] (h is {list(h.shape)}), got "
                         f"{x.dtype} {list(x.shape)}")


def head_dot(t: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    r""":func:`e3attn.heads.head_dot` on the kernel: ``t [E, heads * K]``, ``h [E, K]`` (float32 or float64, CPU) to
    ``[E, heads]``."""
    if h.dim() != 2 or h.shape[1] == 0 or h.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"h must be a float32 or float64 tensor [E, K > 0], got {h.dtype} {list(h.shape)}")
    _check("t", t, h, t.shape[1] - t.shape[1] % h.shape[1] if t.dim() == 2 else -1)
    return _HeadDot.apply(t, h)


def head_outer(b: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    r""":func:`e3attn.heads.head_outer` on the kernel: ``b [E, heads]``, ``h [E, K]`` (float32 or float64, CPU) to
    ``[E, heads * K]``."""
    if h.dim() != 2 or h.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"h must be a float32 or float64 tensor [E, K], got {h.dtype} {list(h.shape)}")
    _check("b", b, h, b.shape[1] if b.dim() == 2 else -1)
    return _HeadOuter.apply(b, h)

r"""The angular moments of :class:`~e3attn.models.NeighbourDensity` summed at the nodes, in one compiled pass per
contraction (numba).

With the edges sorted by destination (``rowptr [N + 1]``, as in :mod:`e3attn.kernels.segments`), per-edge channel
weights ``a [E, L, K]`` (degree :math:`l \ge 1` in row :math:`l - 1`) and the harmonics ``y [E, M]`` of degrees
1 to :math:`L` (:math:`M = (L + 1)^2 - 1` columns, column :math:`m` of degree :math:`l(m)`), the trilinear form

.. math::

    T(G, a, y) = \sum_i \sum_{e \to i} \sum_{m, k} G_{i, m, k}\, y_{e, m}\, a_{e, l(m), k}

has three contractions, each the others' derivative:

.. math::

    A(a, y)_{i, m, k} &= \sum_{e \to i} y_{e, m}\, a_{e, l(m), k} \quad (\partial_G T\text{: the moments}) \\
    B(G, y)_{e, l, k} &= \sum_{m : l(m) = l} G_{i, m, k}\, y_{e, m} \quad (\partial_a T) \\
    C(G, a)_{e, m} &= \sum_k G_{i, m, k}\, a_{e, l(m), k} \quad (\partial_y T)

(:math:`i` the destination of :math:`e`), so :math:`A`'s gradients are :math:`B(g, y)` and :math:`C(g, a)`,
:math:`B`'s are :math:`A(h, y)` and :math:`C(G, h)`, :math:`C`'s are :math:`A(a, h)` and :math:`B(G, h)`: every
order of derivative (forces and their training) runs on the one kernel, never on ``[E, M, K]`` tensors, which
the plain formulation (a gather, a broadcast product and a scatter, and as many again for each derivative) forms
several times. ``torch.autograd.Function`` s for plain eager CPU tensors (:func:`~e3attn.kernels.eager_on_cpu`
says where), like :mod:`e3attn.kernels.heads_ops`; a gradient that is not a plain tensor (batched, as
``torch.autograd.grad(..., is_grads_batched=True)`` and ``torch.func`` give) is taken with the same contractions
in PyTorch operations, which autograd differentiates again.
"""
from __future__ import annotations

import numba
import numpy as np
import torch

from . import _plain_eager
from .cpu import _JIT
from .segment_checks import check_segments
from .threads import groups_for, parallel

__all__ = ["angular_moments_csr"]


@numba.njit(**_JIT)
def _contract(a, y, g, rowptr, degree, gi, groups, out_a, out_b, out_c):
    """For the nodes of group ``gi``: ``out_a = A(a, y)``, ``out_b = B(g, y)``, ``out_c = C(g, a)``, each where
    it has rows (the inputs an output does not need may be empty). One function for all three: numba compiles
    each function for seconds."""
    num = rowptr.shape[0] - 1
    components, channels = degree.shape[0], out_a.shape[2] if out_a.shape[0] else g.shape[2]
    for i in range(gi * num // groups, (gi + 1) * num // groups):
        start, stop = rowptr[i], rowptr[i + 1]
        if out_a.shape[0]:
            acc = out_a[i]
            acc[:, :] = 0.0
            for e in range(start, stop):
                for m in range(components):
                    w, row = y[e, m], a[e, degree[m]]
                    for k in range(channels):
                        acc[m, k] += w * row[k]
        if out_b.shape[0]:
            gi_ = g[i]
            for e in range(start, stop):
                row = out_b[e]
                row[:, :] = 0.0
                for m in range(components):
                    w, l = y[e, m], degree[m]
                    for k in range(channels):
                        row[l, k] += w * gi_[m, k]
        if out_c.shape[0]:
            gi_ = g[i]
            for e in range(start, stop):
                for m in range(components):
                    row = a[e, degree[m]]
                    total = 0.0 * row[0]
                    for k in range(channels):
                        total += gi_[m, k] * row[k]
                    out_c[e, m] = total


def _run(a, y, g, rowptr, degree, want_a: bool, want_b: bool, want_c: bool):
    """The wanted contractions (``A [N, M, K]``, ``B [E, L, K]``, ``C [E, M]``; the others None) on the kernel."""
    ref = next(t for t in (a, y, g) if t is not None)
    num_nodes, num_edges = rowptr.shape[0] - 1, (a if a is not None else y).shape[0]
    components, channels = degree.shape[0], (a if a is not None else g).shape[2]
    shape_b = (num_edges, int(degree.numpy()[-1]) + 1, channels)
    outs = (ref.new_empty((num_nodes, components, channels)) if want_a else None,
            ref.new_empty(shape_b) if want_b else None, ref.new_empty((num_edges, components)) if want_c else None)
    empty = {2: ref.new_empty((0, 1)).numpy(), 3: ref.new_empty((0, 1, 1)).numpy()}  # numba types by dimension
    inputs = [t.detach().contiguous().numpy() if t is not None else empty[dim] for t, dim in ((a, 3), (y, 2), (g, 3))]
    outputs = [o.numpy() if o is not None else empty[dim] for o, dim in zip(outs, (3, 3, 2))]
    work = num_edges * components * channels * (want_a + want_b + want_c)
    groups = groups_for(work, max(1, min(num_nodes, 4 * torch.get_num_threads())))
    parallel(lambda gi: _contract(*inputs, rowptr.numpy(), degree.numpy(), gi, groups, *outputs), groups, work)
    return outs


def _plain(which: str, a, y, g, rowptr, degree) -> torch.Tensor:
    """The contraction ``which`` (``"A"``, ``"B"`` or ``"C"``) of the given inputs in PyTorch operations (for
    gradients that the kernel cannot take: batched ones)."""
    dst = torch.repeat_interleave(torch.arange(rowptr.shape[0] - 1, device=rowptr.device), rowptr.diff())
    if which == "A":
        terms = a.index_select(1, degree) * y[:, :, None]
        return terms.new_zeros((rowptr.shape[0] - 1,) + terms.shape[1:]).index_add(0, dst, terms)
    gathered = g.index_select(0, dst)  # [E, M, K]
    if which == "B":
        terms = gathered * y[:, :, None]
        return terms.new_zeros(terms.shape[0], int(degree.numpy()[-1]) + 1, terms.shape[2]).index_add(1, degree, terms)
    return (gathered * a.index_select(1, degree)).sum(2)


class _Moments(torch.autograd.Function):
    """:math:`A(a, y)`."""

    @staticmethod
    def forward(ctx, a, y, rowptr, degree):
        ctx.save_for_backward(a, y, rowptr, degree)
        return _run(a, y, None, rowptr, degree, True, False, False)[0]

    @staticmethod
    def backward(ctx, g):
        a, y, rowptr, degree = ctx.saved_tensors
        need_a, need_y = ctx.needs_input_grad[:2]
        if not _plain_eager((g,)):
            return (_plain("B", None, y, g, rowptr, degree) if need_a else None,
                    _plain("C", a, None, g, rowptr, degree) if need_y else None, None, None)
        if torch.is_grad_enabled():  # differentiable gradients: one function per contraction
            return (_Adjoint.apply(g, y, rowptr, degree, "B") if need_a else None,
                    _Adjoint.apply(g, a, rowptr, degree, "C") if need_y else None, None, None)
        _, ga, gy = _run(a if need_y else None, y if need_a else None, g, rowptr, degree, False, need_a, need_y)
        return ga, gy, None, None


class _Adjoint(torch.autograd.Function):
    """:math:`B(G, x)` (``which="B"``, :math:`x = y`) or :math:`C(G, x)` (``which="C"``, :math:`x = a`)."""

    @staticmethod
    def forward(ctx, g, x, rowptr, degree, which):
        ctx.save_for_backward(g, x, rowptr, degree)
        ctx.which = which
        if which == "B":
            return _run(None, x, g, rowptr, degree, False, True, False)[1]
        return _run(x, None, g, rowptr, degree, False, False, True)[2]

    @staticmethod
    def backward(ctx, h):
        g, x, rowptr, degree = ctx.saved_tensors
        need_g, need_x = ctx.needs_input_grad[:2]
        # B(G, y): the gradients A(h, y) and C(G, h); C(G, a): A(a, h) and B(G, h)
        if not _plain_eager((h,)):
            a, y = (h, x) if ctx.which == "B" else (x, h)
            return (_plain("A", a, y, None, rowptr, degree) if need_g else None,
                    _plain("C" if ctx.which == "B" else "B", h, h, g, rowptr, degree) if need_x else None,
                    None, None, None)
        moments = (_Moments.apply(h, x, rowptr, degree) if ctx.which == "B" else _Moments.apply(x, h, rowptr, degree)
                   ) if need_g else None
        other = _Adjoint.apply(g, h, rowptr, degree, "C" if ctx.which == "B" else "B") if need_x else None
        return moments, other, None, None, None


def angular_moments_csr(a: torch.Tensor, y: torch.Tensor, rowptr: torch.Tensor, degree: torch.Tensor) -> torch.Tensor:
    r"""The moments :math:`A(a, y)` ``[N, M, K]`` of ``a [E, L, K]`` and ``y [E, M]`` (float32 or float64 CPU
    tensors) for the edges sorted by destination (``rowptr [N + 1]``, checked); ``degree [M]``: :math:`l(m) - 1`
    of every column of ``y``, rising (int64)."""
    if a.dim() != 3 or a.device.type != "cpu" or a.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"a must be a float32 or float64 CPU tensor [E, L, K], got {a.dtype} {list(a.shape)} on "
                         f"{a.device.type}")
    rows = degree.numpy() if degree.dim() == 1 and degree.dtype == torch.int64 and degree.device.type == "cpu" else None
    if rows is None or rows.shape[0] == 0 or rows[0] < 0 or rows[-1] != a.shape[1] - 1 or np.any(rows[1:] < rows[:-1]):
        raise ValueError(f"degree must be a rising 1-d int64 tensor from 0 to {a.shape[1] - 1}, got {degree.tolist()}")
    if y.dim() != 2 or tuple(y.shape) != (a.shape[0], degree.shape[0]) or y.dtype != a.dtype:
        raise ValueError(f"y must be a {a.dtype} tensor [{a.shape[0]}, {degree.shape[0]}], got {y.dtype} "
                         f"{list(y.shape)}")
    check_segments(rowptr, a.shape[0], rowptr.shape[0] - 1, a.device)
    return _Moments.apply(a, y, rowptr, degree)

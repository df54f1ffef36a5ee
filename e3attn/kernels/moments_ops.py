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
the plain formulation (:mod:`e3attn.kernels.moments`: a gather, a broadcast product and a scatter, and as many
again for each derivative) forms several times. One ``torch.autograd.Function`` for plain eager CPU tensors
(:func:`~e3attn.kernels.eager_on_cpu` says where), like :mod:`e3attn.kernels.heads_ops`, takes every contraction,
named by its slot (``"g"`` :math:`A`, ``"a"`` :math:`B`, ``"y"`` :math:`C`); a gradient that is not a plain tensor
(batched, as ``torch.autograd.grad(..., is_grads_batched=True)`` and ``torch.func`` give) is taken with the same
contractions in PyTorch operations (:func:`~e3attn.kernels.moments.contract`), which autograd differentiates again.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import numba
import numpy as np
import torch

from . import _plain_eager
from .._remembered import checked, remember
from .cpu import _JIT
from .moments import SLOTS, contract
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


def _run(a, y, g, rowptr, degree, wanted: Tuple[str, ...]) -> Dict[str, torch.Tensor]:
    """The contractions of the ``wanted`` slots (:data:`~e3attn.kernels.moments.SLOTS`: ``"g"`` :math:`A`
    ``[N, M, K]``, ``"a"`` :math:`B` ``[E, L, K]``, ``"y"`` :math:`C` ``[E, M]``) at ``(a, y, g)``, in one pass of
    the kernel; an argument that no wanted contraction reads may be None."""
    ref = next(t for t in (a, y, g) if t is not None)
    num_nodes, num_edges = rowptr.shape[0] - 1, (a if a is not None else y).shape[0]
    components, channels = degree.shape[0], (a if a is not None else g).shape[2]
    shapes = dict(g=(num_nodes, components, channels), a=(num_edges, int(degree.numpy()[-1]) + 1, channels),
                  y=(num_edges, components))
    outs = {slot: ref.new_empty(shapes[slot]) for slot in wanted}
    empty = {2: ref.new_empty((0, 1)).numpy(), 3: ref.new_empty((0, 1, 1)).numpy()}  # numba types by dimension
    inputs = [t.detach().contiguous().numpy() if t is not None else empty[dim] for t, dim in ((a, 3), (y, 2), (g, 3))]
    outputs = [outs[slot].numpy() if slot in outs else empty[dim] for slot, dim in (("g", 3), ("a", 3), ("y", 2))]
    work = num_edges * components * channels * len(wanted)
    groups = groups_for(work, max(1, min(num_nodes, 4 * torch.get_num_threads())))
    parallel(lambda gi: _contract(*inputs, rowptr.numpy(), degree.numpy(), gi, groups, *outputs), groups, work)
    return outs


class _Contraction(torch.autograd.Function):
    """The contraction of ``slot`` at the two other arguments ``u, v`` (in the order of
    :data:`~e3attn.kernels.moments.SLOTS`). Its gradient for another slot is that slot's contraction with the
    incoming gradient in ``slot``: one class for :math:`A`, :math:`B`, :math:`C` and all their derivatives."""

    @staticmethod
    def forward(ctx, slot, u, v, rowptr, degree):
        ctx.save_for_backward(u, v, rowptr, degree)
        ctx.slot = slot
        return _run(**_arguments(slot, u, v, None), rowptr=rowptr, degree=degree, wanted=(slot,))[slot]

    @staticmethod
    def backward(ctx, h):
        u, v, rowptr, degree = ctx.saved_tensors
        others = [s for s in SLOTS if s != ctx.slot]
        args = _arguments(ctx.slot, u, v, h)
        wanted = tuple(s for s, need in zip(others, ctx.needs_input_grad[1:3]) if need)
        if not _plain_eager((h,)):  # a batched gradient: in PyTorch operations, which autograd differentiates
            dst = torch.repeat_interleave(torch.arange(rowptr.shape[0] - 1, device=rowptr.device), rowptr.diff())
            grads = {s: contract(s, **args, dst=dst, num_nodes=rowptr.shape[0] - 1, degree=degree) for s in wanted}
        elif torch.is_grad_enabled():  # differentiable gradients: one function per contraction
            grads = {s: _Contraction.apply(s, *(args[t] for t in SLOTS if t != s), rowptr, degree) for s in wanted}
        else:  # both gradients in one pass
            grads = _run(**args, rowptr=rowptr, degree=degree, wanted=wanted)
        return (None, *(grads.get(s) for s in others), None, None)


def _arguments(slot: str, u, v, at_slot) -> Dict[str, Optional[torch.Tensor]]:
    """The trilinear form's arguments by name: ``u, v`` in the slots other than ``slot``, ``at_slot`` in it."""
    return dict(zip([s for s in SLOTS if s != slot], (u, v)), **{slot: at_slot})


def angular_moments_csr(a: torch.Tensor, y: torch.Tensor, rowptr: torch.Tensor, degree: torch.Tensor) -> torch.Tensor:
    r"""The moments :math:`A(a, y)` ``[N, M, K]`` of ``a [E, L, K]`` and ``y [E, M]`` (float32 or float64 CPU
    tensors) for the edges sorted by destination (``rowptr [N + 1]``, checked); ``degree [M]``: :math:`l(m) - 1`
    of every column of ``y``, rising (int64; its values checked once per tensor and version)."""
    if a.dim() != 3 or a.device.type != "cpu" or a.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"a must be a float32 or float64 CPU tensor [E, L, K], got {a.dtype} {list(a.shape)} on "
                         f"{a.device.type}")
    _check_degree(degree, a.shape[1])
    if y.dim() != 2 or tuple(y.shape) != (a.shape[0], degree.shape[0]) or y.dtype != a.dtype:
        raise ValueError(f"y must be a {a.dtype} tensor [{a.shape[0]}, {degree.shape[0]}], got {y.dtype} "
                         f"{list(y.shape)}")
    check_segments(rowptr, a.shape[0], rowptr.shape[0] - 1, a.device)
    return _Contraction.apply("g", a, y, rowptr, degree)


def _check_degree(degree: torch.Tensor, rows: int) -> None:
    """``degree`` must rise from 0 to ``rows - 1`` (the kernel indexes ``a``'s rows by it without bounds checks)."""
    key = ("degree", rows)
    if degree.dim() == 1 and degree.dtype == torch.int64 and degree.device.type == "cpu":
        if checked(degree, key) is not None:
            return
        values = degree.numpy()
        if values.shape[0] and values[0] == 0 and values[-1] == rows - 1 and not np.any(np.diff(values) < 0):
            remember(degree, key, True)
            return
    raise ValueError(f"degree must be a rising 1-d int64 tensor from 0 to {rows - 1}, got {degree.tolist()}")

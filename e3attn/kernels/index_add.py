r"""``e3attn::index_add``: ATen's ``index_add`` as an operator that compilers call rather than generate code for.

.. math::

    \mathrm{out} = \mathrm{self}, \qquad
    \mathrm{out}[\dots, \mathrm{index}_e, \dots] \mathrel{+}= \mathrm{source}[\dots, e, \dots]
    \quad \text{along } \mathrm{dim}, \text{ for every } e,

the values of ``torch.index_add(self, dim, index, source)``, which computes it on every device, fake tensors
included, with its gradients (``grad`` for ``self``, ``grad.index_select(dim, index)`` for ``source``). The
traced graphs of e3attn's compiled steps call it in place of ``aten.index_add``
(:func:`e3attn._tracing.index_adds_as_calls`): inductor would lower each one to an accumulating ``index_put``,
which the deterministic algorithms that those graphs compile with leave to ATen's ``index_put`` that sorts the
indices first, several times slower than ATen's ``index_add`` on the sizes of a training step. (A numba loop of
the rows, :func:`e3attn.kernels.segments.add_rows`, was tried in its place: as fast alone, but the compiled step
with it 1.2 times slower in one run of ``benchmarks/compiled_step.py --inductor-index-add``.)

Example::

    >>> import torch
    >>> torch.ops.e3attn.index_add(torch.zeros(3, 2), 0, torch.tensor([2, 0, 2]), torch.ones(3, 2))
    tensor([[1., 1.],
            [0., 0.],
            [2., 2.]])
"""
from __future__ import annotations

import torch

__all__ = ["index_add"]


def index_add(self: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """``torch.index_add(self, dim, index, source)``: the kernel of ``e3attn::index_add``."""
    return torch.index_add(self, dim, index, source)


_LIBRARY = torch.library.Library("e3attn", "FRAGMENT")
_LIBRARY.define("index_add(Tensor self, int dim, Tensor index, Tensor source) -> Tensor")
# one kernel for every device, Meta (and so fake tensors) included: compilers keep the operator as a call
_LIBRARY.impl("index_add", index_add, "CompositeExplicitAutograd")


def _save(ctx, inputs, output) -> None:
    ctx.dim, ctx.index = inputs[1], inputs[2]


def _backward(ctx, grad: torch.Tensor):
    # d out / d self = 1; d out / d source = the rows of grad at the index (a gather)
    return grad, None, None, grad.index_select(ctx.dim, ctx.index)


torch.library.register_autograd("e3attn::index_add", _backward, setup_context=_save)

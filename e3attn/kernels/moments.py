r"""The three contractions of the angular moments' trilinear form (:mod:`e3attn.kernels.moments_ops`) in PyTorch
operations: the plain formulation of :class:`~e3attn.models.NeighbourDensity`, and what the kernel's autograd
functions fall back on for gradients it cannot take (batched ones).

With ``a [E, L, K]``, ``y [E, M]``, ``G [N, M, K]``, the destination ``dst [E]`` of every edge and ``degree [M]``
(:math:`l(m) - 1` of every column of ``y``), each contraction is named by the argument of
:math:`T(G, a, y) = \sum_e \sum_{m, k} G_{\mathrm{dst}_e, m, k}\, y_{e, m}\, a_{e, l(m), k}` it differentiates for:
``"g"`` the moments :math:`A(a, y)` ``[N, M, K]``, ``"a"`` :math:`B(G, y)` ``[E, L, K]``, ``"y"`` :math:`C(G, a)`
``[E, M]``. Each forms ``[E, M, K]`` tensors (a gather, a broadcast product and a scatter or a sum).
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["SLOTS", "contract"]

SLOTS = ("a", "y", "g")  # the arguments of the trilinear form, in this order everywhere


def contract(slot: str, a: Optional[torch.Tensor], y: Optional[torch.Tensor], g: Optional[torch.Tensor],
             dst: torch.Tensor, num_nodes: int, degree: torch.Tensor) -> torch.Tensor:
    """The derivative of the trilinear form for ``slot`` (``"a"``, ``"y"`` or ``"g"``) at the two other arguments
    (the one of ``slot`` is not read and may be None).

    Example::

        >>> a, y, degree = torch.randn(4, 1, 2), torch.randn(4, 3), torch.zeros(3, dtype=torch.long)
        >>> dst = torch.tensor([0, 0, 1, 1])
        >>> moments = contract("g", a, y, None, dst, 2, degree)
        >>> torch.allclose(moments[0], a[0, 0] * y[0, :, None] + a[1, 0] * y[1, :, None])
        True
    """
    if slot == "g":
        terms = a.index_select(1, degree) * y[:, :, None]  # [E, M, K]
        return terms.new_zeros((num_nodes,) + terms.shape[1:]).index_add(0, dst, terms)
    gathered = g.index_select(0, dst)  # [E, M, K]
    if slot == "a":
        terms = gathered * y[:, :, None]
        return terms.new_zeros(terms.shape[0], int(degree[-1]) + 1, terms.shape[2]).index_add(1, degree, terms)
    if slot == "y":
        return (gathered * a.index_select(1, degree)).sum(2)
    raise ValueError(f"slot must be one of {SLOTS}, got {slot!r}")

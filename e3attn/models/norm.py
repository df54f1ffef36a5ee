r"""Equivariant layer normalisation of irreps features, one node at a time."""
from __future__ import annotations

import torch

from .._checks import check_dtype, check_positive
from .._irreps import IrrepsLike, as_irreps, entries, split_entries

__all__ = ["EquivariantLayerNorm"]


class EquivariantLayerNorm(torch.nn.Module):
    r"""Layer normalisation that commutes with O(3), one node at a time.

    The even scalars (every ``0e`` channel, :math:`u \in S`) of a node get an ordinary
    layer norm; every other channel (:math:`u \in V`: odd scalars and :math:`l > 0`, each
    a vector :math:`x_u` of :math:`2l_u + 1` components) is divided by one common root mean
    square of their norms:

    .. math::

        \mu = \frac{1}{|S|}\sum_{u \in S} x_u, \qquad
        \sigma^2 = \frac{1}{|S|}\sum_{u \in S} (x_u - \mu)^2, \qquad
        y_u = \gamma_u \frac{x_u - \mu}{\sqrt{\sigma^2 + \epsilon}} + \beta_u \quad (u \in S) \\
        \rho^2 = \frac{1}{|V|}\sum_{u \in V} \frac{\|x_u\|^2}{2 l_u + 1}, \qquad
        y_u = \gamma_u \frac{x_u}{\sqrt{\rho^2 + \epsilon}} \quad (u \in V)

    :math:`\rho` is invariant and nothing is added to non-invariant channels (no mean,
    no bias), so :math:`y(D(g)\,x) = D(g)\,y(x)` for every :math:`g \in O(3)`. One common
    :math:`\rho` (rather than one per irrep) keeps the ratios between irreps: channels that
    vanish by symmetry (odd scalars of an achiral shape, ``1e`` of a planar one) stay
    small instead of having their rounding noise blown up to unit size. Nodes do not
    interact, so the result does not depend on how graphs are batched (unlike a batch
    norm). A single even scalar (``|S| = 1``) is normalised to :math:`\beta` alone, as in
    any layer norm of one feature.

    Args:
        irreps: irreps of the features.
        eps: :math:`\epsilon`, added to the variances.
        affine: learn :math:`\gamma` (initialised to 1) and :math:`\beta` (initialised to 0);
            otherwise :math:`\gamma = 1, \beta = 0`.

    Shapes:
        ``[N, irreps.dim]`` to ``[N, irreps.dim]``.

    Example::

        >>> norm = EquivariantLayerNorm("8x0e + 4x1o")
        >>> y = norm(torch.randn(5, 20))
        >>> y[:, :8].mean(1).abs().max() < 1e-6, y[:, 8:].pow(2).sum(1).div(12).sub(1).abs().max() < 1e-4
        (tensor(True), tensor(True))
    """

    def __init__(self, irreps: IrrepsLike, eps: float = 1e-5, affine: bool = True) -> None:
        super().__init__()
        self.irreps = as_irreps(irreps, "irreps")
        self.eps = check_positive(eps, "eps")
        self._entries = entries(self.irreps)
        self._dim, self._text = self.irreps.dim, str(self.irreps)  # plain values for forward (torch.compile)
        self._even = [(l, p) == (0, 1) for _, l, p in self._entries]
        self._num_even = sum(mul for (mul, _, _), even in zip(self._entries, self._even) if even)
        self._num_other = sum(mul for (mul, _, _), even in zip(self._entries, self._even) if not even)
        self.affine = affine
        if affine:
            self.weight = torch.nn.Parameter(torch.ones(self._num_even + self._num_other))
            self.bias = torch.nn.Parameter(torch.zeros(self._num_even))

    def extra_repr(self) -> str:
        return f"{self.irreps}, eps={self.eps}, affine={self.affine}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self._dim:
            raise ValueError(f"x must have shape [N, {self._dim}] (irreps {self._text}), got {list(x.shape)}")
        if self.affine:
            check_dtype(x, "x", self.weight.dtype, "the module")
        parts = split_entries(x, self._entries)
        even = [part for part, is_even in zip(parts, self._even) if is_even]
        other = [part for part, is_even in zip(parts, self._even) if not is_even]
        if even:
            scalars = torch.cat(even, dim=1)  # [N, |S|, 1]
            mean = scalars.mean(dim=1, keepdim=True)
            inv_std = torch.rsqrt((scalars - mean).pow(2).mean(dim=1, keepdim=True) + self.eps)
        if other:
            rho2 = sum(part.pow(2).mean(dim=2).sum(dim=1) for part in other) / self._num_other
            inv_rho = torch.rsqrt(rho2 + self.eps)[:, None, None]
        outs = []
        channel = bias = 0
        for part, (mul, _, _), is_even in zip(parts, self._entries, self._even):
            part = (part - mean) * inv_std if is_even else part * inv_rho
            if self.affine:
                part = part * self.weight[channel : channel + mul, None]
                if is_even:
                    part = part + self.bias[bias : bias + mul, None]
                    bias += mul
            channel += mul
            outs.append(part.flatten(1))
        return torch.cat(outs, dim=1) if outs else x

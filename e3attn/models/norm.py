r"""Equivariant layer normalisation of irreps features, one node at a time."""
from __future__ import annotations

import torch

from .._checks import check_dtype, check_positive
from .._constants import Float64ConstantsModule
from .._irreps import IrrepsLike, as_irreps, entries

__all__ = ["EquivariantLayerNorm"]


class EquivariantLayerNorm(Float64ConstantsModule):
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
        self._dim, self._text = self.irreps.dim, str(self.irreps)  # plain values for forward (torch.compile)
        channel, even, inverse_dim = [], [], []  # of every column
        channels = 0
        for mul, l, p in entries(self.irreps):
            for _ in range(mul):
                channel += [channels] * (2 * l + 1)
                even += [(l, p) == (0, 1)] * (2 * l + 1)
                inverse_dim += [1.0 / (2 * l + 1)] * (2 * l + 1)
                channels += 1
        even = torch.tensor(even, dtype=torch.float64)
        self._num_even = int(even.sum())
        self._num_other = channels - self._num_even
        # The statistics as matrix products, a few operations whatever the irreps (and to differentiate twice):
        # (sigma^2, rho^2) = centred^2 @ moments, mu = x @ (the first column: the even ones' mean); their factors
        # back on the columns by @ spread.
        stats = [(even, even / self._num_even)] if self._num_even else []
        if self._num_other:
            stats.append((1 - even, (1 - even) * torch.tensor(inverse_dim, dtype=torch.float64) / self._num_other))
        self.register_constant("even", even)
        self.register_constant("moments", torch.stack([w for _, w in stats], 1) if stats else torch.zeros(self._dim, 0))
        self.register_constant("spread", torch.stack([m for m, _ in stats]) if stats else torch.zeros(0, self._dim))
        # the affine weights on the columns: weight @ weight_columns, bias @ bias_columns (zero on the others)
        channel = torch.tensor(channel, dtype=torch.long)
        self.register_constant("weight_columns", torch.arange(channels)[:, None] == channel)
        rank = torch.cumsum(even, 0).long() - 1  # an even column's rank among the even columns
        self.register_constant("bias_columns", (torch.arange(self._num_even)[:, None] == rank) * even)
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
        if self._dim == 0:
            return x
        # returned in x's dtype (promoted with the weights'), computed in float32 at least, never in autocast's
        # lower precision: the products are sums, and in half precision the derivative of rsqrt(rho^2 + eps) at
        # zero features, eps^(-3/2), overflows (NaN gradients)
        dtype = torch.promote_types(x.dtype, self.weight.dtype) if self.affine else x.dtype
        work = torch.promote_types(dtype, torch.float32)
        with torch.autocast(x.device.type, enabled=False):
            x = x.to(work)
            if self._num_even:
                x = x - (x @ self.constant("moments", work)[:, :1]) * self.constant("even", work)
            scale = torch.rsqrt((x * x) @ self.constant("moments", work) + self.eps) @ self.constant("spread", work)
            if not self.affine:
                return (x * scale).to(dtype)
            x = x * (scale * (self.weight.to(work) @ self.constant("weight_columns", work)))
            out = x + self.bias.to(work) @ self.constant("bias_columns", work) if self._num_even else x
            return out.to(dtype)

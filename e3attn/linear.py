r"""Equivariant linear map between irreps (channel mixing within each irrep type)."""
from __future__ import annotations

import math
from typing import List

import torch

from ._block_matrix import BlockMatrix
from ._checks import check_dtype
from ._irreps import IrrepsLike, as_irreps, entries, entry_starts, split_entries, starts

__all__ = ["IrrepsLinear"]


class IrrepsLinear(torch.nn.Module):
    r"""Equivariant linear layer without biases, e3nn's ``o3.Linear`` normalisation.

    .. math::

        y_{c, w, m} = \frac{1}{\sqrt{\sum_{a \to c} U_a}} \sum_{a \to c} \sum_{u=1}^{U_a} W^{(a c)}_{u w}\, x_{a, u, m}

    where :math:`a \to c` runs over the input irreps equal to output irrep :math:`c`.
    The weights are one flat parameter, ordered like e3nn's ``o3.Linear``
    (path ``(a, c)`` in order of ``a`` then ``c``, each a ``[U_a, W_c]`` block),
    so they can be copied to and from e3nn. Output irreps that no input reaches are zero.
    For small irreps the map runs as one matrix product, the weights scattered into a dense
    ``[irreps_in.dim, irreps_out.dim]`` matrix (while that needs at most 4 times the multiply-adds of the
    blocks: a few PyTorch operations instead of a few per block); otherwise one product per block.

    Args:
        irreps_in: input irreps.
        irreps_out: output irreps.

    Shapes:
        ``[N, irreps_in.dim]`` to ``[N, irreps_out.dim]``.

    Example::

        >>> lin = IrrepsLinear("10x0e + 5x1o", "11x0e + 4x1o")
        >>> lin(torch.randn(3, 25)).shape
        torch.Size([3, 23])
    """

    def __init__(self, irreps_in: IrrepsLike, irreps_out: IrrepsLike) -> None:
        super().__init__()
        self.irreps_in = as_irreps(irreps_in, "irreps_in")
        self.irreps_out = as_irreps(irreps_out, "irreps_out")
        self._in, self._out = entries(self.irreps_in), entries(self.irreps_out)
        self._paths = [
            (a, c)
            for a, (_, la, pa) in enumerate(self._in)
            for c, (_, lc, pc) in enumerate(self._out)
            if (la, pa) == (lc, pc)
        ]
        sizes = [self._in[a][0] * self._out[c][0] for a, c in self._paths]
        self._sizes = sizes
        self.weight = torch.nn.Parameter(torch.randn(sum(sizes)))
        fan_in = [sum(self._in[a][0] for a, c2 in self._paths if c2 == c) for c in range(len(self._out))]
        self._norm = [1.0 / math.sqrt(n) if n > 0 else 0.0 for n in fan_in]
        starts_in, starts_out = entry_starts(self._in), entry_starts(self._out)
        self._matrix = BlockMatrix(self.irreps_in.dim, self.irreps_out.dim, [
            (offset, self._in[a][0], self._out[c][0], 2 * self._in[a][1] + 1, starts_in[a], starts_out[c],
             self._norm[c])
            for offset, (a, c) in zip(starts(sizes), self._paths)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_dtype(x, "x", self.weight.dtype, "the module")
        if self._matrix.dense:  # small irreps: one matrix product (e3attn._block_matrix); x's dtype under autocast
            return (x @ self._matrix.matrix(self.weight)).to(x.dtype)
        xs = split_entries(x, self._in)
        ws = self.weight.split(self._sizes)
        outs: List[torch.Tensor] = [x.new_zeros(x.shape[0], mul, 2 * l + 1) for mul, l, _ in self._out]
        for (a, c), w in zip(self._paths, ws):
            w = w.reshape(self._in[a][0], self._out[c][0]) * self._norm[c]
            outs[c] = outs[c] + torch.einsum("nui,uw->nwi", xs[a], w)
        if not outs:
            return x.new_zeros(x.shape[0], 0)
        return torch.cat([o.flatten(1) for o in outs], dim=1)


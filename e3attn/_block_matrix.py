r"""Channel-mixing maps between irreps as one dense matrix, where that is cheap.

An equivariant linear map between irreps mixes channels within each irrep type: a weight :math:`W_{uw}` of block
:math:`(a, c)` multiplies every component :math:`m` of input channel :math:`u` into output channel :math:`w`. Applied
per block (one ``einsum`` per block, then the outputs summed and concatenated) it costs a few dozen PyTorch operations
and autograd nodes, whatever the number of rows; scattered into one dense ``[in, out]`` matrix it is one matrix
product, at the price of multiplying the zeros between the blocks. :class:`BlockMatrix` holds where every weight goes
(an index and a float64 scale per entry) and decides from the structure alone which form is cheaper.
"""
from __future__ import annotations

from typing import Iterable, Tuple

import torch

from ._constants import Float64ConstantsModule

__all__ = ["BlockMatrix"]

# the dense product is used while it needs at most this many times the multiply-adds of the blocks
DENSE_RATIO = 4


class BlockMatrix(Float64ConstantsModule):
    r"""Where the weights of a channel-mixing map go in its dense ``[rows, cols]`` matrix.

    Each block ``(weight_offset, U, W, d, row, col, scale)`` puts ``weight[weight_offset + u W + w] * scale`` at
    ``(row + u d + i, col + w d + i)`` for ``u < U``, ``w < W``, ``i < d``; entries no block reaches are zero.
    :attr:`dense` says whether the dense product is the cheaper form (at most :data:`DENSE_RATIO` times the
    multiply-adds of the blocks).
    """

    def __init__(self, rows: int, cols: int, blocks: Iterable[Tuple[int, int, int, int, int, int, float]]) -> None:
        super().__init__()
        self.rows, self.cols = rows, cols
        index = torch.zeros(rows, cols, dtype=torch.long)
        scale = torch.zeros(rows, cols, dtype=torch.float64)
        work = 0
        for offset, mul_in, mul_out, dim, row, col, factor in blocks:
            u, w, i = torch.meshgrid(torch.arange(mul_in), torch.arange(mul_out), torch.arange(dim), indexing="ij")
            index[row + u * dim + i, col + w * dim + i] = offset + u * mul_out + w
            scale[row + u * dim + i, col + w * dim + i] = factor
            work += mul_in * mul_out * dim
        self.dense = rows * cols <= DENSE_RATIO * work
        self.register_buffer("index", index.reshape(-1), persistent=False)
        self.register_constant("scale", scale)

    def matrix(self, weight: torch.Tensor) -> torch.Tensor:
        """The dense ``[rows, cols]`` matrix of the flat ``weight`` (its dtype and device)."""
        return weight.reshape(-1).index_select(0, self.index).view(self.rows, self.cols) * self.constant(
            "scale", weight.dtype)

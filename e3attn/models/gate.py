r"""Gated nonlinearity for irreps features, with the normalised activations of e3nn."""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Callable, Tuple

import numpy as np
import torch

from .._irreps import IrrepsLike, as_irreps, entries, split_entries

__all__ = ["Gate", "second_moment_constant"]

_ACTIVATIONS = {
    "silu": (torch.nn.functional.silu, lambda z: z / (1.0 + np.exp(-z))),
    "tanh": (torch.tanh, np.tanh),
    "sigmoid": (torch.sigmoid, lambda z: 1.0 / (1.0 + np.exp(-z))),
}


@lru_cache(maxsize=None)
def second_moment_constant(name: str) -> float:
    r""":math:`c = 1 / \sqrt{E[\phi(z)^2]}` for :math:`z \sim N(0, 1)` and the activation ``name``.

    Computed by 200-point Gauss-Hermite quadrature, so :math:`c\,\phi(z)` has unit second
    moment (e3nn's ``normalize2mom``, without its random sampling).

    .. math:: E[\phi(z)^2] = \frac{1}{\sqrt{2\pi}} \int \phi(z)^2 e^{-z^2/2}\, dz \approx \frac{1}{\sqrt{2\pi}} \sum_k w_k \phi(z_k)^2

    Example::

        >>> round(second_moment_constant("tanh"), 4)
        1.5925
    """
    z, w = np.polynomial.hermite_e.hermegauss(200)
    values = _ACTIVATIONS[name][1](z)
    return float(1.0 / math.sqrt(np.sum(w * values**2) / math.sqrt(2.0 * math.pi)))


def _scaled(name: str) -> Tuple[Callable[[torch.Tensor], torch.Tensor], float]:
    """The activation ``name`` and its :func:`second_moment_constant` (module-level objects: the Gate pickles)."""
    return _ACTIVATIONS[name][0], second_moment_constant(name)


class Gate(torch.nn.Module):
    r"""Gated nonlinearity: scalars through activations, every other irrep scaled by its own gate.

    The input is the features :math:`x` (``irreps``) followed by one extra even scalar
    :math:`g_u` per non-scalar copy :math:`u`; the output has the irreps ``irreps``, in
    the same order:

    .. math::

        y_u = \begin{cases}
            c_\mathrm{silu}\,\mathrm{silu}(x_u) & x_u \text{ even scalar (0e)} \\
            c_\mathrm{tanh}\,\tanh(x_u) & x_u \text{ odd scalar (0o)} \\
            c_\sigma\,\sigma(g_u)\, x_u & l_u > 0
        \end{cases}

    with :math:`c_\phi` = :func:`second_moment_constant` (as in e3nn's ``nn.Gate``).
    :math:`\tanh` is odd, so odd scalars stay odd; the gates are invariant, so every
    :math:`l > 0` copy is scaled without being rotated: the map is O(3)-equivariant. The
    gates follow the features (``irreps_in = irreps + G x 0e``, with :math:`G` the number
    of non-scalar copies), so when every multiplicity of ``irreps`` is divisible by a
    number of heads, so is every multiplicity of ``irreps_in``.

    Args:
        irreps: irreps of the features (and of the output).

    Shapes:
        ``[N, irreps_in.dim]`` to ``[N, irreps.dim]``.

    Example::

        >>> gate = Gate("8x0e + 2x0o + 4x1o")
        >>> gate.irreps_in, gate.irreps_out
        (8x0e+2x0o+4x1o+4x0e, 8x0e+2x0o+4x1o)
        >>> gate(torch.randn(3, 26)).shape
        torch.Size([3, 22])
    """

    def __init__(self, irreps: IrrepsLike) -> None:
        super().__init__()
        self.irreps_out = as_irreps(irreps, "irreps")
        self._entries = entries(self.irreps_out)
        self.num_gates = sum(mul for mul, l, _ in self._entries if l > 0)
        gates = as_irreps(f"{self.num_gates}x0e" if self.num_gates else "", "gates")
        self.irreps_in = self.irreps_out + gates
        # read in forward as plain values (torch.compile cannot guard on e3nn Irreps)
        self._dims, self._text = (self.irreps_in.dim, self.irreps_out.dim), str(self.irreps_in)
        self._scalar = {1: _scaled("silu"), -1: _scaled("tanh")}
        self._gate = _scaled("sigmoid")

    def extra_repr(self) -> str:
        return f"{self.irreps_in} -> {self.irreps_out}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self._dims[0]:
            raise ValueError(f"x must have shape [N, {self._dims[0]}] (irreps {self._text}), got {list(x.shape)}")
        features, gates = x.split([self._dims[1], self.num_gates], dim=1)
        gate, c = self._gate
        gates = c * gate(gates)
        outs = []
        first = 0
        for part, (mul, l, p) in zip(split_entries(features, self._entries), self._entries):
            if l == 0:
                activation, c = self._scalar[p]
                part = c * activation(part)
            else:
                part = part * gates[:, first : first + mul, None]
                first += mul
            outs.append(part.flatten(1))
        return torch.cat(outs, dim=1) if outs else features

r"""Spherical harmonics of edge directions as one matrix product of monomials."""
from __future__ import annotations

import functools
from typing import List, Tuple

import numpy as np
import torch
from e3nn import o3

from ._checks import check_floating, check_int
from ._constants import Float64ConstantsModule

__all__ = ["SphericalHarmonics"]


def _monomials(l: int) -> List[Tuple[int, int, int]]:
    """Exponents ``(a, b, c)`` of the monomials :math:`x^a y^b z^c` of degree ``l``."""
    return [(a, b, l - a - b) for a in range(l, -1, -1) for b in range(l - a, -1, -1)]


def _recurrence(l: int) -> Tuple[List[int], List[int]]:
    """For every monomial of degree ``l > 0``: its parent (index among those of degree ``l - 1``) and the
    variable (0, 1, 2 for x, y, z) that multiplies it, the first one with a positive exponent."""
    prev, mono = _monomials(l - 1), _monomials(l)
    variables = [0 if a else (1 if b else 2) for a, b, _ in mono]
    return [prev.index(tuple(e - (i == v) for i, e in enumerate(m))) for m, v in zip(mono, variables)], variables


@functools.lru_cache(maxsize=None)
def monomial_recurrence(lmax: int) -> Tuple[np.ndarray, np.ndarray]:
    """The monomials of degrees ``0..lmax`` in :class:`SphericalHarmonics`' order (degree by degree, 1 first):
    for each, the index of its parent in that order and its variable (both 0 for the monomial 1)."""
    parents, variables, offset = [0], [0], 0
    for l in range(1, lmax + 1):
        p, v = _recurrence(l)
        parents += [offset + i for i in p]
        variables += v
        offset += len(_monomials(l - 1))
    return np.asarray(parents, dtype=np.int64), np.asarray(variables, dtype=np.int64)


class SphericalHarmonics(Float64ConstantsModule):
    r"""Real spherical harmonics :math:`Y^l(\hat r)`, :math:`l = 0 \dots l_\mathrm{max}`, of e3nn's convention.

    e3nn's harmonics of degree :math:`l` (``"component"`` normalisation,
    :math:`\|Y^l\|^2 = 2l + 1` on the unit sphere) are homogeneous polynomials
    of degree :math:`l` in the coordinates of :math:`\hat r = \vec r / |\vec r|`:

    .. math::

        Y^l_m(\hat r) = \sum_{a + b + c = l} M^l_{abc, m}\, \hat x^a \hat y^b \hat z^c

    The monomials are built degree by degree (one product per degree), and all
    harmonics come out of a single matrix product with the float64 constant
    :math:`M`, found once by solving e3nn's polynomials on fixed random points
    (exact up to rounding: a homogeneous polynomial is fixed by its values on
    the sphere; the SVD-based least squares is reproducible to the last bit,
    so a rebuilt layer computes exactly what it computed before). Equal to ``o3.SphericalHarmonics(range(lmax + 1), normalize=True,
    normalization="component")`` (tested to 1e-12 in float64), including the
    zero vector (mapped like :func:`torch.nn.functional.normalize`), in fewer
    operations, and traceable by ``torch.compile``.

    Args:
        lmax: largest degree.

    Shapes:
        ``[..., 3]`` to ``[..., (lmax + 1)^2]``.

    Example::

        >>> SphericalHarmonics(3)(torch.randn(5, 3)).shape
        torch.Size([5, 16])
    """

    def __init__(self, lmax: int) -> None:
        super().__init__()
        self.lmax = lmax = check_int(lmax, "lmax")
        gen = torch.Generator().manual_seed(0)
        blocks, parents, variables = [], [], []
        for l in range(lmax + 1):
            mono = _monomials(l)
            if l > 0:  # x^a y^b z^c = (parent of degree l - 1) * (first variable with a positive exponent)
                parent, var = _recurrence(l)
                parents.append(parent)
                variables.append(var)
            points = torch.randn(4 * len(mono) + 8, 3, generator=gen, dtype=torch.float64)
            powers = torch.stack([points[:, 0] ** a * points[:, 1] ** b * points[:, 2] ** c for a, b, c in mono], 1)
            target = o3.spherical_harmonics(l, points, normalize=False, normalization="component")
            blocks.append(torch.linalg.lstsq(powers, target, driver="gelsd").solution)
        self.register_constant("coefficients", torch.block_diag(*blocks))  # [monomials, (lmax + 1)^2]
        self.register_buffer("_parents", torch.tensor(sum(parents, []), dtype=torch.long), persistent=False)
        self.register_buffer("_variables", torch.tensor(sum(variables, []), dtype=torch.long), persistent=False)
        self._sizes = [len(_monomials(l)) for l in range(1, lmax + 1)]

    def extra_repr(self) -> str:
        return f"lmax={self.lmax}"

    def forward(self, vectors: torch.Tensor) -> torch.Tensor:
        check_floating(vectors, "vectors")
        shape = vectors.shape[:-1]
        u = torch.nn.functional.normalize(vectors.reshape(-1, 3), dim=-1).T  # [3, E]: rows are long vectors
        monomials = [torch.ones_like(u[:1])]
        start = 0
        for size in self._sizes:
            rows = slice(start, start + size)
            parents, variables = self._parents[rows], self._variables[rows]
            monomials.append(monomials[-1].index_select(0, parents) * u.index_select(0, variables))
            start += size
        # [E, (lmax + 1)^2], contiguous: the consumers (e.g. the kernels) need no copy. The monomials are made
        # contiguous as [E, M] first: the backward of a product with a transposed factor guards on E (E == 1?),
        # which torch.compile cannot do when E is the data-dependent size of a graph built in the compiled region
        out = torch.cat(monomials, dim=0).T.contiguous() @ self.constant("coefficients", u.dtype)
        return out.reshape(shape + (out.shape[1],))

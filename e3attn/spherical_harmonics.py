r"""Spherical harmonics of edge directions as one matrix product of monomials."""
from __future__ import annotations

import functools
from typing import List, Tuple

import numpy as np
import torch
from e3nn import o3

from ._checks import check_floating, check_int
from ._constants import Float64ConstantsModule
from ._jet import closed_forms_apply, plain_gradient, plain_second_derivatives, transformed, working

__all__ = ["SphericalHarmonics"]

LMAX = 12
"""The largest degree: that of e3nn's spherical harmonics, which :class:`SphericalHarmonics` equals."""


def check_degree(value, name: str) -> int:
    """``value``, a degree of spherical harmonics (an integer from 0 to ``LMAX``, 12), as a Python ``int``; a
    ``ValueError`` naming ``name`` otherwise (checked before anything is sized by it)."""
    degree = check_int(value, name)
    if degree > LMAX:
        raise ValueError(f"{name} must be at most {LMAX} (the degrees of e3nn's spherical harmonics), got {degree}")
    return degree

_EPS = 1e-12  # the floor of torch.nn.functional.normalize


def _monomials(l: int) -> List[Tuple[int, int, int]]:
    """Exponents ``(a, b, c)`` of the monomials :math:`x^a y^b z^c` of degree ``l``."""
    return [(a, b, l - a - b) for a in range(l, -1, -1) for b in range(l - a, -1, -1)]


def _derivative_tables(lmax: int, coefficients: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""The first and second derivatives of the polynomials ``monomials @ coefficients`` in the coordinates, as
    coefficients of the same monomials: ``[M, 3, K]`` (:math:`\partial_a P_k`) and ``[M, 3, 3, K]``
    (:math:`\partial_a \partial_b P_k`), by the power rule, exactly."""
    monomials = [m for l in range(lmax + 1) for m in _monomials(l)]
    index = {m: i for i, m in enumerate(monomials)}
    size, width = coefficients.shape
    first = torch.zeros(size, 3, width, dtype=torch.float64)
    second = torch.zeros(size, 3, 3, width, dtype=torch.float64)
    for i, m in enumerate(monomials):
        for a in range(3):
            if m[a] == 0:
                continue
            lower = tuple(e - (j == a) for j, e in enumerate(m))
            first[index[lower], a] += m[a] * coefficients[i]
            for b in range(3):
                if lower[b] > 0:
                    lowest = tuple(e - (j == b) for j, e in enumerate(lower))
                    second[index[lowest], a, b] += m[a] * lower[b] * coefficients[i]
    return first, second


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

    Differentiated in closed form: the gradients and Hessians of the harmonics in :math:`\vec r` are polynomials
    of :math:`\hat r` too (the power rule on the monomials, and Euler's identity :math:`\hat r \cdot \nabla P =
    l P` for the normalisation), which a force-training step contracts with its cotangents on the monomials: its
    first and second derivatives of the harmonics take a few small matrix products, not autograd's derivatives
    of the recurrence and the normalisation. A third derivative, batched gradients, ``torch.compile``,
    ``torch.func`` and forward-mode AD take the plain formula (as ``e3attn._jet``).

    Args:
        lmax: largest degree, at most 12 (the degrees of e3nn's spherical harmonics).

    Shapes:
        ``[..., 3]`` to ``[..., (lmax + 1)^2]``.

    Example::

        >>> SphericalHarmonics(3)(torch.randn(5, 3)).shape
        torch.Size([5, 16])
    """

    def __init__(self, lmax: int) -> None:
        super().__init__()
        self.lmax = lmax = check_degree(lmax, "lmax")
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
        coefficients = torch.block_diag(*blocks)  # [monomials, (lmax + 1)^2]
        self.register_constant("coefficients", coefficients)
        # the derivatives' polynomials, contracted with a cotangent g or a direction w (see _Gradient)
        first, second = _derivative_tables(lmax, coefficients)  # [M, 3, K], [M, 3, 3, K]
        size, width = coefficients.shape
        degree = torch.arange(width, dtype=torch.float64).sqrt().floor()
        self.register_constant("degree", degree)  # l of every column
        self.register_constant("degree_plus_two", degree + 2)
        self.register_constant("gradient_table", torch.cat([first, first * degree], 1).permute(2, 1, 0).reshape(
            width, 6 * size))  # g -> sum_k g_k dP_k and sum_k g_k l_k dP_k, on the monomials
        self.register_constant("direction_table", first.reshape(3 * size, width))  # (monomial x w) -> sum_a w_a dP_a
        self.register_constant("hessian_table", second.permute(1, 3, 2, 0).reshape(3 * width, 3 * size))
        self.register_buffer("_parents", torch.tensor(sum(parents, []), dtype=torch.long), persistent=False)
        self.register_buffer("_variables", torch.tensor(sum(variables, []), dtype=torch.long), persistent=False)
        self._sizes = [len(_monomials(l)) for l in range(1, lmax + 1)]

    def extra_repr(self) -> str:
        return f"lmax={self.lmax}"

    def forward(self, vectors: torch.Tensor) -> torch.Tensor:
        check_floating(vectors, "vectors")
        if self.lmax == 0:  # a constant
            return self._plain(vectors)
        if not closed_forms_apply(vectors):
            return self._plain(vectors)
        return _Value.apply(vectors, self)

    def _monomials(self, u: torch.Tensor) -> torch.Tensor:
        """The monomials of ``u [3, E]`` (rows are long vectors), ``[E, M]``."""
        monomials = [torch.ones_like(u[:1])]
        start = 0
        for size in self._sizes:
            rows = slice(start, start + size)
            parents, variables = self._parents[rows], self._variables[rows]
            monomials.append(monomials[-1].index_select(0, parents) * u.index_select(0, variables))
            start += size
        # contiguous as [E, M]: the consumers (e.g. the kernels) need no copy of the harmonics. And the backward of a
        # product with a transposed factor guards on E (E == 1?), which torch.compile cannot do when E is the
        # data-dependent size of a graph built in the compiled region
        return torch.cat(monomials, dim=0).T.contiguous()

    def _plain(self, vectors: torch.Tensor) -> torch.Tensor:
        u = torch.nn.functional.normalize(vectors.reshape(-1, 3), dim=-1).T
        out = self._monomials(u) @ self.constant("coefficients", u.dtype)
        return out.reshape(vectors.shape[:-1] + (out.shape[1],))


# ------------------------------------------------------------------ derivatives in closed form
#
# With s = max(r, 1e-12) and u = v / s (torch.nn.functional.normalize), a harmonic of degree l is a homogeneous
# polynomial P of u, so u . grad P = l P (Euler), and where r >= 1e-12 (below, u = v / 1e-12: the first terms only)
#
#   s d_a Y = d_a P - u_a l P,
#   s^2 d_a d_b Y = d_a d_b P - l (u_a d_b P + u_b d_a P) + l (l + 2) u_a u_b P - delta_ab l P.
#
# The derivatives of P are polynomials of the same monomials (the tables of SphericalHarmonics), contracted with the
# cotangent g and the direction w before they meet the monomials, so nothing of size [E, 3, 3, K] is formed:
#   sum_k g_k d_a Y_k                          = (G_a - u_a gamma) / s,
#   sum_a w_a d_a Y_k                          = (W_k - (w . u) l_k P_k) / s,
#   sum_{a, k} w_a g_k d_a d_b Y_k             = (A_b - (w . u) B_b - u_b (w . B) + beta (w . u) u_b - w_b gamma) / s^2,
# with G_a = sum_k g_k d_a P_k, B_a = sum_k g_k l_k d_a P_k, W_k = sum_a w_a d_a P_k, A_b = sum_{a, k} w_a g_k
# d_a d_b P_k, gamma = sum_k g_k l_k P_k, beta = sum_k g_k l_k (l_k + 2) P_k.


class _Value(torch.autograd.Function):
    @staticmethod
    def forward(ctx, vectors, module):
        with torch.no_grad(), torch.autocast(vectors.device.type, enabled=False):
            v = working(vectors.reshape(-1, 3))
            r = v.norm(dim=-1, keepdim=True)
            s = r.clamp_min(_EPS)
            u = v / s
            far = r >= _EPS
            uf = torch.where(far, u, 0.0)  # u where the projection terms apply
            monomials = module._monomials(u.T)
            y = monomials @ module.constant("coefficients", v.dtype)
            ly = y * module.constant("degree", v.dtype)
        ctx.save_for_backward(vectors, monomials, uf, s, far, ly)
        ctx.module = module
        return y.to(vectors.dtype).reshape(vectors.shape[:-1] + (y.shape[1],))

    @staticmethod
    def backward(ctx, g):
        vectors, monomials, uf, s, far, ly = ctx.saved_tensors
        if transformed(g):  # batched gradients (is_grads_batched, vmap): of the plain formula
            return plain_gradient(ctx.module._plain, vectors, (g,)), None
        return _Gradient.apply(g, vectors, monomials, uf, s, far, ly, ctx.module), None


def _on_monomials(t: torch.Tensor, table: torch.Tensor, monomials: torch.Tensor) -> torch.Tensor:
    """``t @ table`` read as ``[E, C, M]`` coefficients of the monomials, evaluated: ``[E, C]``."""
    size = monomials.shape[1]
    return ((t @ table).view(t.shape[0], table.shape[1] // size, size) * monomials[:, None, :]).sum(-1)


class _Gradient(torch.autograd.Function):
    """The gradient in the vectors, differentiable once more in closed form."""

    @staticmethod
    def forward(ctx, g, vectors, monomials, uf, s, far, ly, module):
        with torch.autocast(vectors.device.type, enabled=False):  # a backward under autocast (forces in --amp)
            gk = g.reshape(-1, ly.shape[1]).to(ly.dtype)
            both = _on_monomials(gk, module.constant("gradient_table", ly.dtype), monomials)  # [G | B]
            weighted = gk * ly
            gamma = weighted.sum(-1, keepdim=True)
            beta = weighted @ module.constant("degree_plus_two", ly.dtype)
            gv = ((both[:, :3] - uf * gamma) / s).reshape(vectors.shape).to(vectors.dtype)
        ctx.save_for_backward(g, vectors, monomials, uf, s, far, ly, both[:, 3:], gamma, beta[:, None])
        ctx.module = module
        return gv

    @staticmethod
    def backward(ctx, w):
        g, vectors, monomials, uf, s, far, ly, b, gamma, beta = ctx.saved_tensors
        module = ctx.module
        if torch.is_grad_enabled() or transformed(w):  # a third derivative, batched gradients: the plain formula's
            (gg,), gv = plain_second_derivatives(module._plain, vectors, (g,), w)
            return (gg, gv) + (None,) * 6
        with torch.autocast(vectors.device.type, enabled=False):
            gk, wa = g.reshape(-1, ly.shape[1]).to(ly.dtype), w.reshape(-1, 3).to(ly.dtype)
            along = (wa * uf).sum(-1, keepdim=True)  # w . u
            table = module.constant("direction_table", ly.dtype)
            gg = ((monomials[:, :, None] * wa[:, None, :]).flatten(1) @ table - along * ly) / s
            a = _on_monomials((wa[:, :, None] * gk[:, None, :]).flatten(1),
                              module.constant("hessian_table", ly.dtype), monomials)
            gv = a - along * b + uf * (beta * along - (wa * b).sum(-1, keepdim=True)) - wa * (gamma * far)
        return gg.reshape(g.shape), (gv / (s * s)).reshape(vectors.shape), None, None, None, None, None, None

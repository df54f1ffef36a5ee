r"""Radial part of the layer: smooth cutoffs, basis embeddings of edge lengths, radial MLPs."""
from __future__ import annotations

import math
from typing import List, Sequence

import numpy as np
import torch

from ._checks import check_dtype, check_floating, check_int, check_positive
from ._constants import Float64ConstantsModule
from ._jet import jet

__all__ = ["soft_unit_step", "log_soft_unit_step", "cutoff_weight", "RadialEmbedding", "RadialMLP"]

# ``smooth_finite`` bump normalisation, the constant of e3nn's ``soft_one_hot_linspace``.
_SMOOTH_FINITE_NORM = 1.14136 * math.exp(2.0)
_GAUSSIAN_NORM = 1.0 / 1.12
_ENVELOPE_P = 6


# Below this, u(x) = exp(-1/x) and u'(x) = exp(-1/x) / x^2 are exactly 0 even in float64 (exp(-800) underflows).
_SOFT_STEP_FLOOR = 1.0 / 800


def log_soft_unit_step(x: torch.Tensor) -> torch.Tensor:
    r"""Logarithm of :func:`soft_unit_step`: :math:`-1/x` for :math:`x > 0`, :math:`-\infty` otherwise.

    The gradient :math:`1/x^2` is 0 where :math:`x \le 0` and finite wherever it is
    representable (:math:`x` above about :math:`5 \times 10^{-20}` in float32; in
    :class:`~e3attn.EquivariantAttention` :math:`x = 10 (1 - r / r_\mathrm{max})` is either
    0 or far above that).
    """
    return jet(x, _log_soft_unit_step, _log_soft_unit_step_derivatives)


def _log_soft_unit_step(x: torch.Tensor) -> torch.Tensor:
    positive = x > 0
    return torch.where(positive, -1.0 / torch.where(positive, x, 1.0), -math.inf)


def _log_soft_unit_step_derivatives(x: torch.Tensor, second: bool):
    positive = x > 0
    inv = 1.0 / torch.where(positive, x, 1.0)
    square = torch.where(positive, inv * inv, 0.0)
    return torch.where(positive, -inv, -math.inf), square, -2.0 * square * inv if second else None


def soft_unit_step(x: torch.Tensor) -> torch.Tensor:
    r"""Smooth (:math:`C^\infty`) step function.

    .. math:: u(x) = \begin{cases} e^{-1/x} & x > 0 \\ 0 & x \le 0 \end{cases}

    Every derivative vanishes at :math:`x = 0`, so anything multiplied by
    :math:`u` switches on and off smoothly. Gradients are finite everywhere:
    below :math:`x = 1/800`, where :math:`u` and :math:`u'` underflow to exactly 0
    in float64 and float32, both are set to 0 (the naive :math:`e^{-1/x} / x^2`
    would be :math:`0 \cdot \infty` = NaN for :math:`x < 10^{-19}` in float32).

    Example::

        >>> soft_unit_step(torch.tensor([-1.0, 0.0, 1.0]))
        tensor([0.0000, 0.0000, 0.3679])
    """
    return jet(x, _soft_unit_step, _soft_unit_step_derivatives)


def _soft_unit_step(x: torch.Tensor) -> torch.Tensor:
    on = x > _SOFT_STEP_FLOOR
    return torch.where(on, torch.exp(-1.0 / torch.where(on, x, 1.0)), 0.0)


def _soft_unit_step_derivatives(x: torch.Tensor, second: bool):
    """:math:`u`, :math:`u' = u / x^2` and :math:`u'' = u (1 - 2x) / x^4` (0 where :math:`u` is)."""
    on = x > _SOFT_STEP_FLOOR
    inv = 1.0 / torch.where(on, x, 1.0)
    u = torch.where(on, torch.exp(-inv), 0.0)
    first = u * inv * inv
    return u, first, first * inv * (inv - 2.0) if second else None


def cutoff_weight(r: torch.Tensor, max_radius: float) -> torch.Tensor:
    r"""Smooth cutoff weight of an edge of length :math:`r`.

    .. math:: w(r) = u\!\left(10 \left(1 - \frac{r}{r_\mathrm{max}}\right)\right)

    with :math:`u` the :func:`soft_unit_step`: :math:`e^{-0.1}` at :math:`r = 0`,
    exactly 0 from :math:`r_\mathrm{max}` on, and infinitely differentiable in
    :math:`r` in between. At :math:`r = 0` its slope
    :math:`w'(0) = -e^{-0.1} / (10\, r_\mathrm{max})` is not zero: as a function of
    two positions with :math:`r = |\vec x_j - \vec x_i|` it has a kink where the points
    coincide (finite first, NaN second derivatives there).
    """
    return soft_unit_step(10.0 * (1.0 - r / check_positive(max_radius, "max_radius")))


def _polynomial_envelope(d: torch.Tensor, p: int = _ENVELOPE_P) -> torch.Tensor:
    r"""DimeNet's polynomial envelope of :math:`d = r / r_\mathrm{max}`: 1 at 0, 0 with 2 derivatives at 1."""
    inside = d < 1
    d = d.clamp_max(1.0)  # finite in the branch not taken (and its zero gradient)
    env = 1 + d**p * (d * (p * (p + 2) - p * (p + 1) // 2 * d) - (p + 1) * (p + 2) // 2)  # Horner's form
    return torch.where(inside, env, 0.0)


def _polynomial_envelope_derivatives(d: torch.Tensor, second: bool, p: int = _ENVELOPE_P):
    """The envelope and its first two derivatives in :math:`d` (0 from :math:`d = 1` on)."""
    a, b, c = (p + 1) * (p + 2) // 2, p * (p + 2), p * (p + 1) // 2
    inside = d < 1
    d = d.clamp_max(1.0)
    low = d ** (p - 2)
    values = [1 + low * d * d * (d * (b - c * d) - a), low * d * (d * ((p + 1) * b - (p + 2) * c * d) - p * a)]
    if second:
        values.append(low * (d * ((p + 1) * p * b - (p + 2) * (p + 1) * c * d) - p * (p - 1) * a))
    return tuple(torch.where(inside, v, 0.0) for v in values) + ((None,) if not second else ())


def _sinc_derivatives(t: torch.Tensor, second: bool):
    """:math:`s(t) = \\sin(t) / t` and its first two derivatives, by their series where the formulas cancel."""
    far = t.abs() > 1e-2
    safe = torch.where(far, t, 1.0)
    s = torch.sin(safe) / safe
    first = (torch.cos(safe) - s) / safe
    t2 = t * t
    return (torch.where(far, s, 1 - t2 * (1 / 6 - t2 / 120)),
            torch.where(far, first, t * (-1 / 3 + t2 * (1 / 30 - t2 / 840))),
            torch.where(far, -s - 2.0 * first / safe, -1 / 3 + t2 * (1 / 10 - t2 / 168)) if second else None)


def _product(f, g):
    """A product and its derivatives (the second where the factors have theirs), from those of its factors."""
    second = f[2] * g[0] + 2 * f[1] * g[1] + f[0] * g[2] if f[2] is not None else None
    return f[0] * g[0], f[1] * g[0] + f[0] * g[1], second


class RadialEmbedding(Float64ConstantsModule):
    r"""Embedding of edge lengths in ``number_of_basis`` functions that vanish smoothly at ``max_radius``.

    Three bases, all multiplied by :math:`\sqrt{n}` (``n = number_of_basis``) so
    that the embedding has components of order one:

    * ``"smooth_finite"`` (default, as e3nn's ``soft_one_hot_linspace(..., cutoff=True)``):
      bumps centred at :math:`c_k = k\,\delta,\ k = 1..n`, :math:`\delta = r_\mathrm{max}/(n+1)`,

      .. math:: e_k(r) = 1.14136\, e^{2}\, u(d_k + 1)\, u(1 - d_k), \qquad d_k = (r - c_k)/\delta

      with :math:`u` the :func:`soft_unit_step`. Each bump is :math:`C^\infty`
      with compact support, so the embedding is exactly 0 at :math:`r = 0`
      and from :math:`r_\mathrm{max}` on.
    * ``"gaussian"``: :math:`e_k(r) = \exp(-((r - c_k)/\delta)^2) / 1.12\ \cdot f_\mathrm{env}(r / r_\mathrm{max})`,
      centres :math:`c_k` evenly spaced on :math:`[0, r_\mathrm{max}]`.
    * ``"bessel"``: :math:`e_k(r) = \sqrt{2/r_\mathrm{max}}\, \sin(k\pi r/r_\mathrm{max}) / r
      \cdot f_\mathrm{env}(r / r_\mathrm{max})`, finite at :math:`r = 0`.

    :math:`f_\mathrm{env}` is DimeNet's polynomial envelope (:math:`p = 6`),
    1 at :math:`r = 0` and 0 with its first two derivatives at :math:`r_\mathrm{max}`.

    Args:
        number_of_basis: number of basis functions :math:`n`.
        max_radius: cutoff radius :math:`r_\mathrm{max}`.
        basis: ``"smooth_finite"``, ``"gaussian"`` or ``"bessel"``.

    Shapes:
        ``r`` ``[...]`` to ``[..., number_of_basis]``.

    Example::

        >>> emb = RadialEmbedding(10, max_radius=1.3)
        >>> emb(torch.tensor([0.0, 0.5, 1.3, 2.0])).shape
        torch.Size([4, 10])
    """

    BASES = ("smooth_finite", "gaussian", "bessel")

    def __init__(self, number_of_basis: int, max_radius: float, basis: str = "smooth_finite") -> None:
        super().__init__()
        number_of_basis = check_int(number_of_basis, "number_of_basis", 1)
        max_radius = check_positive(max_radius, "max_radius")
        if basis not in self.BASES:
            raise ValueError(f"basis must be one of {self.BASES}, got {basis!r}")
        self.number_of_basis = number_of_basis
        self.max_radius = max_radius
        self.basis = basis
        n, rmax = number_of_basis, self.max_radius
        if basis == "smooth_finite":
            grid = torch.linspace(0.0, rmax, n + 2, dtype=torch.float64)
            self.step, norm = rmax / (n + 1), _SMOOTH_FINITE_NORM
            self.register_constant("centers", grid[1:-1])
        elif basis == "gaussian":
            self.step, norm = (rmax / (n - 1) if n > 1 else rmax), _GAUSSIAN_NORM
            self.register_constant("centers", torch.linspace(0.0, rmax, n, dtype=torch.float64))
        else:
            self.step, norm = rmax, math.sqrt(2.0 / rmax) * math.pi / rmax
            self.register_constant("centers", torch.arange(1, n + 1, dtype=torch.float64))
        self.scale = norm * math.sqrt(n)  # every basis function's constant factor, sqrt(n) included

    def extra_repr(self) -> str:
        return f"number_of_basis={self.number_of_basis}, max_radius={self.max_radius}, basis={self.basis!r}"

    def forward(self, r: torch.Tensor) -> torch.Tensor:
        check_floating(r, "r")
        return jet(r, self._plain, self._derivatives)

    def _derivatives(self, r: torch.Tensor, second: bool):
        """The embedding and its first (and, if ``second``, second) derivative in :math:`r`, ``[...,
        number_of_basis]`` each."""
        centers, step, rmax = self.constant("centers", r.dtype), self.step, self.max_radius
        d = (r[..., None] - centers) / step
        if self.basis == "smooth_finite":  # exp(h), h = -2 / (1 - d^2)
            gap = 1 - d * d
            inside = gap > 0
            inverse = 1.0 / torch.where(inside, gap, 1.0)
            value = torch.where(inside, torch.exp(-2.0 * inverse), 0.0)
            dh = -4.0 * d * inverse * inverse / step
            d2h = (-4.0 - 16.0 * d * d * inverse) * inverse * inverse / step**2 if second else None
            out = (value, value * dh, value * (dh * dh + d2h) if second else None)
        else:  # a basis function times the envelope
            env = _polynomial_envelope_derivatives(r / rmax, second)
            envelope = (env[0][..., None], env[1][..., None] / rmax, env[2][..., None] / rmax**2 if second else None)
            if self.basis == "gaussian":
                value = torch.exp(-d * d)
                basis = (value, -2.0 * d * value / step, (4.0 * d * d - 2.0) * value / step**2 if second else None)
            else:  # c sinc(c r / rmax) = c s(t), t = omega r, omega = pi c / rmax
                omega = math.pi * centers / rmax
                s = _sinc_derivatives(omega * r[..., None], second)
                basis = (centers * s[0], centers * omega * s[1], centers * omega * omega * s[2] if second else None)
            out = _product(basis, envelope)
        return tuple(v * self.scale if v is not None else None for v in out)

    def _plain(self, r: torch.Tensor) -> torch.Tensor:
        centers = self.constant("centers", r.dtype)
        if self.basis == "smooth_finite":
            # u(d + 1) u(1 - d) = exp(-1/(1 + d) - 1/(1 - d)) = exp(-2 / (1 - d^2)) for |d| < 1, else 0
            d = (r[..., None] - centers) / self.step
            gap = 1 - d * d
            inside = gap > 0
            gap = torch.where(inside, gap, 1.0)
            out = torch.where(inside, (-2 / gap).exp(), 0.0)
        elif self.basis == "gaussian":
            d = (r[..., None] - centers) / self.step
            out = torch.exp(-d.pow(2)) * _polynomial_envelope(r / self.max_radius)[..., None]
        else:
            # sin(k pi r / rmax) / r == (k pi / rmax) sinc(k r / rmax): finite at r = 0
            out = centers * torch.sinc(centers * (r[..., None] / self.max_radius))
            out = out * _polynomial_envelope(r / self.max_radius)[..., None]
        return out * self.scale


def _second_moment_constant() -> float:
    r""":math:`1/\sqrt{E[\mathrm{silu}(z)^2]}` for :math:`z \sim N(0, 1)`, by Gauss-Hermite quadrature."""
    z, w = np.polynomial.hermite_e.hermegauss(200)
    silu = z / (1.0 + np.exp(-z))
    return float(1.0 / math.sqrt(np.sum(w * silu**2) / math.sqrt(2 * math.pi)))


_SILU_NORM = _second_moment_constant()


def _silu_derivatives(x: torch.Tensor, second: bool):
    r""":math:`\mathrm{silu}(x) = x \sigma(x)`, :math:`\sigma (1 + x (1 - \sigma))` and
    :math:`\sigma (1 - \sigma) (2 + x (1 - 2 \sigma))`."""
    sigma = torch.sigmoid(x)
    value = x * sigma
    first = sigma + value * (1 - sigma)
    return value, first, (sigma - sigma * sigma) * (2 + x - 2 * value) if second else None


class RadialMLP(torch.nn.Module):
    r"""Radial networks: maps the edge embedding to per-edge tensor product weights.

    Several independent two-layer networks without biases (one per weight set,
    e.g. keys and values), normalised like e3nn's ``FullyConnectedNet``:

    .. math::

        h^{(t)} = c\ \mathrm{silu}\!\left(\frac{e\, W_1^{(t)}}{\sqrt{n}}\right),\qquad
        w^{(t)} = \frac{h^{(t)} W_2^{(t)}}{\sqrt{h}}

    with :math:`W` initialised :math:`N(0, 1)` and :math:`c` making
    :math:`E[(c\,\mathrm{silu}(z))^2] = 1`. The first layers of all networks run
    as one matrix product.

    Args:
        number_of_basis: input size :math:`n`.
        hidden: hidden size :math:`h` of every network.
        outputs: output size of each network.

    Shapes:
        ``[E, number_of_basis]`` to a list of ``[E, outputs[t]]``.

    Example::

        >>> mlp = RadialMLP(10, 16, [240, 330])
        >>> [w.shape for w in mlp(torch.randn(5, 10))]
        [torch.Size([5, 240]), torch.Size([5, 330])]
    """

    def __init__(self, number_of_basis: int, hidden: int, outputs: Sequence[int]) -> None:
        super().__init__()
        self.number_of_basis = check_int(number_of_basis, "number_of_basis", 1)
        self.hidden = hidden = check_int(hidden, "radial_neurons", 1)
        self.outputs = [check_int(n, f"outputs[{i}]") for i, n in enumerate(outputs)]
        self.weight1 = torch.nn.Parameter(torch.randn(self.number_of_basis, hidden * len(self.outputs)))
        self.weight2 = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(hidden, n)) for n in self.outputs])

    def forward(self, emb: torch.Tensor) -> List[torch.Tensor]:
        return [h @ w for h, w in zip(self.hidden_features(emb), self.output_layers())]

    def hidden_features(self, emb: torch.Tensor) -> List[torch.Tensor]:
        r"""The hidden layers :math:`h^{(t)}`, ``[E, hidden]`` each.

        ``forward(emb)[t] == hidden_features(emb)[t] @ output_layers()[t]``.
        """
        check_dtype(emb, "emb", self.weight1.dtype, "the module")
        return self.activate(emb @ self.input_layer())

    def input_layer(self) -> torch.Tensor:
        r"""The normalised first layers of all networks side by side, :math:`W_1 / \sqrt{n}` ``[n, T hidden]``."""
        return self.weight1 / math.sqrt(self.number_of_basis)

    def activate(self, pre: torch.Tensor, normalise: bool = True) -> List[torch.Tensor]:
        r"""The hidden layers :math:`h^{(t)}` from the first layers' outputs ``pre = emb @ input_layer()``
        (without their factor :math:`c` if not ``normalise``)."""
        h = jet(pre, torch.nn.functional.silu, _silu_derivatives, plain_first=True)
        return list((h * _SILU_NORM if normalise else h).split(self.hidden, dim=1))

    def output_layers(self, fold_activation_norm: bool = False) -> List[torch.Tensor]:
        r"""The normalised second layers :math:`W_2^{(t)} / \sqrt{h}`, ``[hidden, outputs[t]]`` each; with
        ``fold_activation_norm``, :math:`c\, W_2^{(t)} / \sqrt{h}`, for hidden features without their
        :math:`c` (``activate(pre, normalise=False)``: one operation on ``[E, hidden]`` tensors less each way)."""
        scale = (_SILU_NORM if fold_activation_norm else 1.0) / math.sqrt(self.hidden)
        return [w * scale for w in self.weight2]

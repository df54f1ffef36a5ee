"""O(3) and translation equivariance: :func:`equivariance_error` and :func:`assert_equivariant`."""
from __future__ import annotations

import itertools
import math
from functools import lru_cache
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from e3nn import o3

from .._checks import check_int
from ._common import IrrepsSpec, _default_dtype, _outputs, _spec, _tolerance, _working_dtype, default_tolerance

__all__ = ["equivariance_error", "assert_equivariant"]



@lru_cache(maxsize=None)
def _generator_projectors(l: int) -> List[Tuple[np.ndarray, np.ndarray, np.ndarray]]:
    r"""Spectral projectors of e3nn's generators :math:`X_x, X_y` of degree ``l``.

    :math:`i X = \sum_m m\, P_m` with the eigenvalues :math:`m = -l \dots l` (integers, rounded to
    them exactly) and the projectors :math:`P_m = v_m v_m^\dagger`; returned as ``(m, Re P, Im P)``
    with every :math:`P_m` flattened to a row.
    """
    with _default_dtype(torch.float64):
        generators = o3.so3_generators(l).numpy()
    projectors = []
    for x in generators[:2]:
        m, v = np.linalg.eigh(1j * x)
        p = (v.T[:, :, None] * v.T.conj()[:, None, :]).reshape(len(m), -1)
        projectors.append((m.round(), p.real.copy(), p.imag.copy()))
    return projectors


def _wigner_D(l: int, alpha: float, beta: float, gamma: float) -> torch.Tensor:
    r"""e3nn's :math:`D^l(\alpha, \beta, \gamma) = e^{\alpha X_y} e^{\beta X_x} e^{\gamma X_y}` in float64, to rounding.

    Each exponential is :math:`e^{tX} = \sum_m e^{-itm} P_m = \sum_m \cos(tm) \operatorname{Re} P_m
    + \sin(tm) \operatorname{Im} P_m` from the exact spectrum of the generator (e3nn
    evaluates them with ``torch.matrix_exp``, which is off by up to about
    :math:`2 \times 10^{-10}` for some angles: enough to fail an exactly equivariant
    float64 model).
    """
    (mx, rx, ix), (my, ry, iy) = _generator_projectors(l)
    n = 2 * l + 1

    def exp(m: np.ndarray, re: np.ndarray, im: np.ndarray, t: float) -> np.ndarray:
        return (np.cos(t * m) @ re + np.sin(t * m) @ im).reshape(n, n)

    return torch.from_numpy(exp(my, ry, iy, alpha) @ exp(mx, rx, ix, beta) @ exp(my, ry, iy, gamma))


def _rotation_y(t: float) -> np.ndarray:
    c, s = math.cos(t), math.sin(t)
    return np.array([[c, 0.0, s], [0.0, 1.0, 0.0], [-s, 0.0, c]])


def _rotation_x(t: float) -> np.ndarray:
    c, s = math.cos(t), math.sin(t)
    return np.array([[1.0, 0.0, 0.0], [0.0, c, -s], [0.0, s, c]])


class _Transformation:
    r"""A random :math:`g = (R, \vec t)` of :math:`E(3)` in float64 and its action on inputs and outputs.

    :math:`R = \pm R(\alpha, \beta, \gamma)` with uniformly distributed (Haar) Euler angles; the
    Cartesian matrix and every Wigner matrix :math:`D^l` are built from the same angles, so they
    agree to rounding (about :math:`10^{-15}`).
    """

    def __init__(self, parity: int, translate: bool) -> None:
        u = torch.rand(3, dtype=torch.float64).tolist()  # Haar measure: alpha, gamma uniform, cos(beta) uniform
        alpha, beta, gamma = 2 * math.pi * u[0], math.acos(2 * u[1] - 1), 2 * math.pi * u[2]
        self.parity = parity
        self.angles = (alpha, beta, gamma)
        matrix = _rotation_y(alpha) @ _rotation_x(beta) @ _rotation_y(gamma)  # e3nn's angles_to_matrix
        self.matrix = torch.from_numpy((-1.0) ** parity * matrix)
        self.shift = 10 * torch.randn(1, 3, dtype=torch.float64) if translate else None
        self._wigner: Dict[int, torch.Tensor] = {}
        self._representations: Dict[o3.Irreps, torch.Tensor] = {}

    def representation(self, irreps: o3.Irreps) -> torch.Tensor:
        """The block-diagonal :math:`D(g)` of ``irreps``, ``[irreps.dim, irreps.dim]``."""
        if irreps not in self._representations:
            blocks = []
            for mul, ir in irreps:
                if ir.l not in self._wigner:
                    self._wigner[ir.l] = _wigner_D(ir.l, *self.angles)
                blocks += [self._wigner[ir.l] * ir.p**self.parity] * mul
            empty = torch.zeros(0, 0, dtype=torch.float64)
            self._representations[irreps] = torch.block_diag(*blocks) if blocks else empty
        return self._representations[irreps]

    def act(self, x, spec: IrrepsSpec, name: str):
        """``x`` transformed according to ``spec`` (``None``: unchanged)."""
        if spec is None:
            return x
        dim = 3 if isinstance(spec, str) else spec.dim
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != dim:
            shape = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name} must be a tensor [..., {dim}] to act on it as {spec}, got {shape}")
        if isinstance(spec, str):
            y = x @ self.matrix.to(x.device).T
            return y if self.shift is None else y + self.shift.to(x.device)
        return x @ self.representation(spec).to(x.device).T


def equivariance_error(
    func: Callable,
    args_in: Sequence,
    irreps_in: Sequence[IrrepsSpec],
    irreps_out: Sequence[IrrepsSpec],
    *,
    ntrials: int = 2,
    do_parity: bool = True,
    do_translation: bool = True,
) -> Dict[Tuple[int, bool], List[float]]:
    r"""Largest equivariance error of ``func`` under random rotations, parity and translations.

    For random :math:`g = (R, \vec t)` with :math:`R \in O(3)` (parity
    included when ``do_parity``) the error is

    .. math:: \max \left| f(D_\mathrm{in}(g)\,x) - D_\mathrm{out}(g)\, f(x) \right|

    with e3nn's representations :math:`D` (as :func:`e3nn.util.test.equivariance_error`).
    The group action is computed in float64: the rotation matrix and every Wigner
    matrix are built from the same random Euler angles (the exponentials of e3nn's
    generators from their exact spectra), so that they agree to about
    :math:`10^{-15}` for every rotation. (``D_from_matrix`` can be off by
    :math:`2 \times 10^{-10}`, which would fail an exactly equivariant float64
    model at the 1e-10 tolerance.) The transformed inputs are cast back to each
    argument's own dtype before calling ``func``, under the caller's default
    dtype: a float32 model is measured against exactly rotated inputs, not
    against float32 rounding of the rotation.

    Args:
        func: function of ``*args_in`` returning a tensor or a tuple of tensors.
        args_in: the inputs.
        irreps_in: per input: irreps (str or ``o3.Irreps``), ``"cartesian_points"``
            for positions (rotated and translated), or ``None`` (left alone: batch, edge_index).
        irreps_out: per output, as ``irreps_in``.
        ntrials: number of random transformations of each kind.
        do_parity: also test improper rotations (parity).
        do_translation: also translate ``"cartesian_points"`` inputs.

    Returns:
        ``{(parity, translated): [max error of each output]}``, ``parity`` 0 or 1.

    Raises:
        AssertionError: naming the output, when an output of ``func`` (on the
            original or on transformed inputs) holds NaN or infinite values.
    """
    ntrials = check_int(ntrials, "ntrials", 1)
    irreps_in = [_spec(spec, f"irreps_in[{i}]") for i, spec in enumerate(irreps_in)]
    irreps_out = [_spec(spec, f"irreps_out[{i}]") for i, spec in enumerate(irreps_out)]
    if len(irreps_in) != len(args_in):
        raise ValueError(f"irreps_in must describe each of the {len(args_in)} inputs, got {len(irreps_in)} entries")
    dtypes = [a.dtype if isinstance(a, torch.Tensor) and a.is_floating_point() else None for a in args_in]
    args64 = [a.detach().to(torch.float64) if dt is not None else a for a, dt in zip(args_in, dtypes)]

    def call(args: Sequence, what: str) -> List[torch.Tensor]:
        cast = [a.to(dt) if dt is not None else a for a, dt in zip(args, dtypes)]
        outputs = _outputs(func(*cast), what)
        if len(outputs) != len(irreps_out):
            raise ValueError(f"func returned {len(outputs)} outputs but irreps_out describes {len(irreps_out)}")
        return [o.detach().to(torch.float64) for o in outputs]

    reference = call(args64, "for the original inputs")
    parities = [0, 1] if do_parity else [0]
    translations = [False, True] if do_translation and any(isinstance(s, str) for s in irreps_in) else [False]
    errors = {key: [0.0] * len(reference) for key in itertools.product(parities, translations)}
    for _ in range(ntrials):
        for parity, translated in errors:
            g = _Transformation(parity, translated)
            moved = [g.act(a, spec, f"input {i}") for i, (a, spec) in enumerate(zip(args64, irreps_in))]
            outputs = call(moved, f"for transformed inputs (parity={parity}, translation={translated})")
            for i, (out, ref, spec) in enumerate(zip(outputs, reference, irreps_out)):
                expected = g.act(ref, spec, f"output {i}")
                if out.shape != expected.shape:
                    raise ValueError(f"output {i} changed shape under the transformation: {list(ref.shape)} -> "
                                     f"{list(out.shape)}")
                error = (out - expected).abs().max().item() if out.numel() else 0.0
                errors[parity, translated][i] = max(errors[parity, translated][i], error)
    return errors


def assert_equivariant(
    func: Callable,
    args_in: Sequence,
    irreps_in: Sequence[IrrepsSpec],
    irreps_out: Sequence[IrrepsSpec],
    *,
    tol: Optional[float] = None,
    **kwargs,
) -> float:
    """Assert that :func:`equivariance_error` is at most ``tol`` and return the largest error.

    ``tol`` defaults to :func:`default_tolerance` of the inputs' floating dtype
    (1e-10 in float64, 1e-4 in float32). Keyword arguments go to :func:`equivariance_error`.

    Raises:
        AssertionError: listing the error of every output and transformation, or
            naming an output that is not finite.
    """
    tol = default_tolerance(_working_dtype(args_in)) if tol is None else _tolerance(tol)
    errors = equivariance_error(func, args_in, irreps_in, irreps_out, **kwargs)
    worst = max((e for errs in errors.values() for e in errs), default=0.0)
    if not worst <= tol:
        lines = [
            f"  parity={parity} translation={translated}: {errs}" for (parity, translated), errs in errors.items()
        ]
        raise AssertionError(f"equivariance error {worst:.3e} > tolerance {tol:.1e}\n" + "\n".join(lines))
    return worst

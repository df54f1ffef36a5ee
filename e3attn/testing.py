r"""Test helpers for users' own models: O(3) equivariance, permutation equivariance, smoothness across the cutoff.

Every helper takes a plain function of tensors, so it works for a single
:class:`~e3attn.EquivariantAttention`, a whole model, or any function of
positions and features.

Example::

    >>> import e3attn, e3attn.testing
    >>> layer = e3attn.EquivariantAttention("4x0e + 2x1o", "4x0e + 2x1o", "4x0e + 2x1o", "2x0e + 2x1o", 1.5).double()
    >>> pos, f = torch.randn(10, 3, dtype=torch.float64), layer.irreps_input.randn(10, -1, dtype=torch.float64)
    >>> err = e3attn.testing.assert_equivariant(
    ...     lambda pos, f: layer(f, pos), [pos, f], ["cartesian_points", layer.irreps_input], [layer.irreps_output])
    >>> err < 1e-10
    True
"""
from __future__ import annotations

import contextlib
import itertools
import math
from functools import lru_cache
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from e3nn import o3

from ._checks import check_int, check_positive, check_real
from ._irreps import as_irreps

__all__ = [
    "default_tolerance",
    "equivariance_error",
    "assert_equivariant",
    "permutation_error",
    "assert_permutation_equivariant",
    "neighbour_scan",
    "assert_smooth_cutoff",
]

IrrepsSpec = Union[None, str, o3.Irreps]
_POINTS = "cartesian_points"
_DIRECTION = (0.48, -0.36, 0.8)  # a generic unit vector
_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-1}


def default_tolerance(dtype: torch.dtype) -> float:
    """Error tolerated for ``dtype``: 1e-10 in float64, 1e-4 in float32."""
    return _TOLERANCE[dtype]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _outputs(value, what: str) -> List[torch.Tensor]:
    """The outputs of ``func`` as a list of tensors; each must be finite (``what``: which call, for the error)."""
    outputs = [value] if isinstance(value, torch.Tensor) else list(value) if isinstance(value, (list, tuple)) else None
    if outputs is None:
        raise TypeError(f"func must return a tensor or a tuple of tensors, got {type(value).__name__} {what}")
    for i, out in enumerate(outputs):
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"output {i} of func must be a tensor, got {type(out).__name__} {what}")
        bad = int((~torch.isfinite(out.detach())).sum())
        if bad:
            raise AssertionError(
                f"output {i} (of {len(outputs)}) of func is not finite {what}: "
                f"{bad} of {out.numel()} entries are NaN or infinite"
            )
    return outputs


def _working_dtype(args: Sequence) -> torch.dtype:
    dtypes = [a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
    return dtypes[0] if dtypes else torch.get_default_dtype()


def _spec(value: IrrepsSpec, name: str) -> IrrepsSpec:
    return value if value is None or (isinstance(value, str) and value == _POINTS) else as_irreps(value, name)


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


def _tolerance(tol: float) -> float:
    return check_real(tol, "tol", "a non-negative number", lambda x: x >= 0)


def permutation_error(
    func: Callable,
    args_in: Sequence,
    *,
    node_args: Optional[Sequence[int]] = None,
    node_outputs: Optional[Sequence[bool]] = None,
    generator: Optional[torch.Generator] = None,
) -> float:
    r"""Error of ``func`` under a random relabelling :math:`\pi` of the nodes.

    .. math:: \max \left| f(\pi x) - \pi f(x) \right|

    Args:
        func: function of ``*args_in`` returning a tensor or tuple of tensors.
        args_in: the inputs.
        node_args: indices of the arguments indexed by node along dim 0 (pos,
            features, batch); default: every tensor argument.
        node_outputs: per output, whether it is indexed by node (permuted) or
            not (e.g. pooled per graph: must be unchanged); default: all by node.
        generator: random generator for the permutation.

    Raises:
        AssertionError: naming the output, when an output (before or after the
            permutation) holds NaN or infinite values.
    """
    node_args = [i for i, a in enumerate(args_in) if isinstance(a, torch.Tensor)] if node_args is None else node_args
    num_nodes = args_in[node_args[0]].shape[0]
    perm = torch.randperm(num_nodes, generator=generator).to(args_in[node_args[0]].device)
    permuted = [a[perm] if i in node_args else a for i, a in enumerate(args_in)]
    before = _outputs(func(*args_in), "for the original inputs")
    after = _outputs(func(*permuted), "for the permuted inputs")
    node_outputs = [True] * len(before) if node_outputs is None else node_outputs
    errors = [
        (b2 - (b1[perm] if is_node else b1)).abs().max().item() if b1.numel() else 0.0
        for b1, b2, is_node in zip(before, after, node_outputs)
    ]
    return max(errors, default=0.0)


def assert_permutation_equivariant(func: Callable, args_in: Sequence, *, tol: Optional[float] = None, **kwargs) -> float:
    """Assert that :func:`permutation_error` is at most ``tol`` (default by dtype) and return it.

    Raises:
        AssertionError: when the error exceeds ``tol`` or an output is not finite.
    """
    tol = default_tolerance(_working_dtype(args_in)) if tol is None else _tolerance(tol)
    error = permutation_error(func, args_in, **kwargs)
    if not error <= tol:
        raise AssertionError(f"permutation equivariance error {error:.3e} > tolerance {tol:.1e}")
    return error


def neighbour_scan(
    func: Callable,
    pos: torch.Tensor,
    *args,
    distances: torch.Tensor,
    node: int = -1,
    center: int = 0,
    direction: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    r"""Outputs of ``func(pos, *args)`` as point ``node`` moves away from point ``center``.

    For every :math:`d` in ``distances`` the point ``node`` is placed at
    :math:`x_\mathrm{center} + d\,\hat n` (``direction`` :math:`\hat n`,
    default a fixed generic unit vector) and ``func`` is evaluated.

    Returns:
        ``[len(distances), *output.shape]``.

    Raises:
        AssertionError: when an output holds NaN or infinite values, naming the distance.
    """
    n = torch.tensor(_DIRECTION, dtype=pos.dtype, device=pos.device) if direction is None else direction
    n = n / n.norm()
    outs = []
    for d in distances.to(pos.dtype):
        moved = pos.clone()
        moved[node] = pos[center] + d * n
        (out,) = _outputs(func(moved, *args), f"at distance {d.item():.6g} of point {node} from point {center}")
        outs.append(out.detach())
    return torch.stack(outs)


def assert_smooth_cutoff(
    func: Callable,
    pos: torch.Tensor,
    *args,
    max_radius: float,
    node: int = -1,
    center: int = 0,
    eps: float = 1e-6,
    tol: float = 1e-6,
    num: int = 100,
) -> Dict[str, float]:
    r"""Assert that ``func(pos, *args)`` is smooth as point ``node`` crosses the cutoff of point ``center``.

    Checks, with :math:`d` the distance of ``node`` from ``center``:

    * the jump across the cutoff is below ``tol``: the change
      :math:`f(r_\mathrm{max} + \epsilon) - f(r_\mathrm{max} - \epsilon)` minus
      the change a smooth function makes over the same step just before,
      :math:`f(r_\mathrm{max} - \epsilon) - f(r_\mathrm{max} - 3\epsilon)`
      (so outputs of other points, which vary smoothly with the moving point,
      do not count as jumps; ``"jump_raw"`` reports the plain difference);
    * continuity on :math:`d \in [0, 2 r_\mathrm{max}]` sampled at ``num + 1``
      points: the largest change between neighbouring samples shrinks at least
      2-fold when the grid is refined 4-fold (about 4-fold for a smooth
      function; a jump would not shrink at all);
    * the gradient of ``func(...).sum()`` w.r.t. ``pos`` is finite at
      :math:`d = 0, 10^{-6}, r_\mathrm{max} \pm \epsilon, 2 r_\mathrm{max}`.

    Use float64 inputs: in float32, ``eps = 1e-6`` is below the resolution.

    Returns:
        the measured ``{"jump": ..., "jump_raw": ..., "max_step": ..., "max_step_refined": ...}``.

    Raises:
        AssertionError: describing the failed check, or naming the distance at
            which an output is not finite.
    """
    r = check_positive(max_radius, "max_radius")
    eps, tol = check_positive(eps, "eps"), check_positive(tol, "tol")
    num = check_int(num, "num", 1)
    before2, before, after = neighbour_scan(
        func, pos, *args, distances=torch.tensor([r - 3 * eps, r - eps, r + eps]), node=node, center=center
    )
    jump_raw = (after - before).abs().max().item()
    jump = ((after - before) - (before - before2)).abs().max().item()
    if not jump < tol:
        raise AssertionError(f"output jumps by {jump:.3e} >= {tol:.1e} across the cutoff r = {r} +- {eps}")

    def max_step(k: int) -> float:
        outs = neighbour_scan(func, pos, *args, distances=torch.linspace(0, 2 * r, k + 1), node=node, center=center)
        return (outs[1:] - outs[:-1]).abs().max().item()

    coarse, fine = max_step(num), max_step(4 * num)
    if not fine * 2 <= coarse:
        raise AssertionError(f"output is not continuous in the distance: max step {coarse:.3e} -> {fine:.3e} on refining")

    direction = torch.tensor(_DIRECTION, dtype=pos.dtype, device=pos.device)
    for d in [0.0, 1e-6, r - eps, r + eps, 2 * r]:
        moved = pos.detach().clone()
        moved[node] = pos[center].detach() + d * direction
        moved.requires_grad_(True)
        (out,) = _outputs(func(moved, *args), f"at distance {d:.6g} of point {node} from point {center}")
        (grad,) = torch.autograd.grad(out.sum(), moved, allow_unused=True)
        if grad is not None and not bool(torch.isfinite(grad).all()):
            raise AssertionError(f"gradient w.r.t. positions is not finite at distance {d}")
    return {"jump": jump, "jump_raw": jump_raw, "max_step": coarse, "max_step_refined": fine}

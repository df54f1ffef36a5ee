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

from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from e3nn import o3
from e3nn.util.test import equivariance_error as _e3nn_equivariance_error

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


def _outputs(value) -> List[torch.Tensor]:
    return [value] if isinstance(value, torch.Tensor) else list(value)


def _working_dtype(args: Sequence) -> torch.dtype:
    dtypes = [a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
    return dtypes[0] if dtypes else torch.get_default_dtype()


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

    Built on :func:`e3nn.util.test.equivariance_error`. The group action is
    computed in float64 (with float64 as the default dtype, since e3nn builds
    its Wigner D matrices in the default dtype) and the transformed inputs are
    cast back to each argument's own dtype before calling ``func``, under the
    caller's default dtype: a float32 model is measured against exactly rotated
    inputs, not against float32 rounding of the rotation.

    Args:
        func: function of ``*args_in`` returning a tensor or a tuple of tensors.
        args_in: the inputs.
        irreps_in: per input: irreps (str or ``o3.Irreps``), ``"cartesian_points"``
            for positions (rotated and translated), or ``None`` (left alone: batch, edge_index).
        irreps_out: per output, as ``irreps_in``.
        ntrials: number of random transformations.
        do_parity: also test improper rotations (parity).
        do_translation: also translate ``"cartesian_points"`` inputs.

    Returns:
        ``{(parity, translated): [max error of each output]}``.
    """
    dtypes = [a.dtype if isinstance(a, torch.Tensor) else None for a in args_in]
    args64 = [
        a.detach().to(torch.float64) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args_in
    ]

    caller_default = torch.get_default_dtype()

    def wrapped(*args):
        cast = [a.to(dt) if dt is not None and a.is_floating_point() else a for a, dt in zip(args, dtypes)]
        with _default_dtype(caller_default):
            return [o.detach().to(torch.float64) for o in _outputs(func(*cast))]

    irreps_in = [o3.Irreps(i) if i not in (None, "cartesian_points") else i for i in irreps_in]
    irreps_out = [o3.Irreps(i) if i not in (None, "cartesian_points") else i for i in irreps_out]
    with _default_dtype(torch.float64):
        errors = _e3nn_equivariance_error(
            wrapped, args64, irreps_in, irreps_out, ntrials=ntrials, do_parity=do_parity, do_translation=do_translation
        )
    return {key: [float(e) for e in value] for key, value in errors.items()}


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
        AssertionError: listing the error of every output and transformation.
    """
    tol = default_tolerance(_working_dtype(args_in)) if tol is None else tol
    errors = equivariance_error(func, args_in, irreps_in, irreps_out, **kwargs)
    worst = max((e for errs in errors.values() for e in errs), default=0.0)
    if not worst <= tol:
        lines = [
            f"  parity={parity} translation={translated}: {errs}" for (parity, translated), errs in errors.items()
        ]
        raise AssertionError(f"equivariance error {worst:.3e} > tolerance {tol:.1e}\n" + "\n".join(lines))
    return worst


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
    """
    node_args = [i for i, a in enumerate(args_in) if isinstance(a, torch.Tensor)] if node_args is None else node_args
    num_nodes = args_in[node_args[0]].shape[0]
    perm = torch.randperm(num_nodes, generator=generator).to(args_in[node_args[0]].device)
    permuted = [a[perm] if i in node_args else a for i, a in enumerate(args_in)]
    before, after = _outputs(func(*args_in)), _outputs(func(*permuted))
    node_outputs = [True] * len(before) if node_outputs is None else node_outputs
    errors = [
        (b2 - (b1[perm] if is_node else b1)).abs().max().item() if b1.numel() else 0.0
        for b1, b2, is_node in zip(before, after, node_outputs)
    ]
    return max(errors, default=0.0)


def assert_permutation_equivariant(func: Callable, args_in: Sequence, *, tol: Optional[float] = None, **kwargs) -> float:
    """Assert that :func:`permutation_error` is at most ``tol`` (default by dtype) and return it."""
    tol = default_tolerance(_working_dtype(args_in)) if tol is None else tol
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
    """
    n = torch.tensor(_DIRECTION, dtype=pos.dtype, device=pos.device) if direction is None else direction
    n = n / n.norm()
    outs = []
    for d in distances.to(pos.dtype):
        moved = pos.clone()
        moved[node] = pos[center] + d * n
        outs.append(func(moved, *args).detach())
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
        AssertionError: describing the failed check.
    """
    r = float(max_radius)
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
    if not fine * 2 <= coarse or not torch.isfinite(torch.tensor(coarse)):
        raise AssertionError(f"output is not continuous in the distance: max step {coarse:.3e} -> {fine:.3e} on refining")

    direction = torch.tensor(_DIRECTION, dtype=pos.dtype, device=pos.device)
    for d in [0.0, 1e-6, r - eps, r + eps, 2 * r]:
        moved = pos.detach().clone()
        moved[node] = pos[center].detach() + d * direction
        moved.requires_grad_(True)
        (grad,) = torch.autograd.grad(func(moved, *args).sum(), moved, allow_unused=True)
        if grad is not None and not bool(torch.isfinite(grad).all()):
            raise AssertionError(f"gradient w.r.t. positions is not finite at distance {d}")
    return {"jump": jump, "jump_raw": jump_raw, "max_step": coarse, "max_step_refined": fine}

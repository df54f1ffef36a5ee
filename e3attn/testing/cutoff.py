"""Smoothness across the cutoff: :func:`neighbour_scan` and :func:`assert_smooth_cutoff`."""
from __future__ import annotations

from typing import Callable, Dict, Optional

import torch

from .._checks import check_int, check_positive
from ._common import DIRECTION, _outputs

__all__ = ["neighbour_scan", "assert_smooth_cutoff"]


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
    n = torch.tensor(DIRECTION, dtype=pos.dtype, device=pos.device) if direction is None else direction
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

    Use float64 inputs: in float32, ``eps = 1e-6`` is below the resolution. The distances are built in the dtype
    of ``pos``, and refused when ``r_max - 3 eps``, ``r_max - eps`` and ``r_max + eps`` do not rise there (the jump
    test would be blind).

    Returns:
        the measured ``{"jump": ..., "jump_raw": ..., "max_step": ..., "max_step_refined": ...}``.

    Raises:
        AssertionError: describing the failed check, or naming the distance at
            which an output is not finite.
        ValueError: when ``eps`` is below the resolution of ``pos``'s dtype at ``max_radius``.
    """
    r = check_positive(max_radius, "max_radius")
    eps, tol = check_positive(eps, "eps"), check_positive(tol, "tol")
    num = check_int(num, "num", 1)
    near = torch.tensor([r - 3 * eps, r - eps, r + eps], dtype=pos.dtype, device=pos.device)
    if not bool((near[1:] > near[:-1]).all()):
        raise ValueError(f"eps={eps:g} is below the resolution of {pos.dtype} at max_radius={r:g} (r - 3 eps, "
                         f"r - eps and r + eps round to {near.tolist()}): use float64 positions or a larger eps")
    before2, before, after = neighbour_scan(func, pos, *args, distances=near, node=node, center=center)
    jump_raw = (after - before).abs().max().item()
    jump = ((after - before) - (before - before2)).abs().max().item()
    if not jump < tol:
        raise AssertionError(f"output jumps by {jump:.3e} >= {tol:.1e} across the cutoff r = {r} +- {eps}")

    def max_step(k: int) -> float:
        grid = torch.linspace(0, 2 * r, k + 1, dtype=pos.dtype, device=pos.device)
        outs = neighbour_scan(func, pos, *args, distances=grid, node=node, center=center)
        return (outs[1:] - outs[:-1]).abs().max().item()

    coarse, fine = max_step(num), max_step(4 * num)
    if not fine * 2 <= coarse:
        raise AssertionError(f"output is not continuous in the distance: max step {coarse:.3e} -> {fine:.3e} on refining")

    direction = torch.tensor(DIRECTION, dtype=pos.dtype, device=pos.device)
    for d in [0.0, 1e-6, r - eps, r + eps, 2 * r]:
        moved = pos.detach().clone()
        moved[node] = pos[center].detach() + d * direction
        moved.requires_grad_(True)
        (out,) = _outputs(func(moved, *args), f"at distance {d:.6g} of point {node} from point {center}")
        (grad,) = torch.autograd.grad(out.sum(), moved, allow_unused=True)
        if grad is not None and not bool(torch.isfinite(grad).all()):
            raise AssertionError(f"gradient w.r.t. positions is not finite at distance {d}")
    return {"jump": jump, "jump_raw": jump_raw, "max_step": coarse, "max_step_refined": fine}

"""What the test helpers share: the tolerances by dtype, the checks of ``func``'s outputs, the kinds of inputs."""
from __future__ import annotations

import contextlib
from typing import List, Sequence, Union

import torch
from e3nn import o3

from .._checks import check_real
from .._irreps import as_irreps

IrrepsSpec = Union[None, str, o3.Irreps]
POINTS = "cartesian_points"
DIRECTION = (0.48, -0.36, 0.8)  # a generic unit vector
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
    return value if value is None or (isinstance(value, str) and value == POINTS) else as_irreps(value, name)


def _tolerance(tol: float) -> float:
    return check_real(tol, "tol", "a non-negative number", lambda x: x >= 0)

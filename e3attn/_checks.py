"""Input validation shared by the public functions: clear errors naming the argument.

Numbers: Python and NumPy numbers are accepted alike and returned as Python ``int``/``float``;
booleans (Python or NumPy) are never numbers. Tensors: the dtype of every argument is checked at the
public entry points, before any internal operation, so a mismatch names the argument.

Checks of tensor *values* (finite positions, indices in range) need the data on the host (on a GPU, a
wait for it); they are skipped while ``torch.compile`` traces, and inside :func:`values_checked_by_caller`
(shapes and dtypes are still checked), see :func:`_skip_values`.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
import numbers
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch

from ._tracing import tracing


_CALLER_CHECKED = contextvars.ContextVar("e3attn_values_checked_by_caller", default=False)


@contextlib.contextmanager
def values_checked_by_caller() -> Iterator[None]:
    """Within this context the checks of tensor values are skipped: for a caller that made the inputs itself and
    knows them valid (the ASE calculator, whose positions the neighbour search checks and whose graph it built),
    calling the model many times on them."""
    token = _CALLER_CHECKED.set(True)
    try:
        yield
    finally:
        _CALLER_CHECKED.reset(token)


def _skip_values() -> bool:
    """Whether to skip the checks of tensor values: while ``torch.compile`` or ``make_fx`` traces (they would be
    data-dependent branches, :func:`~e3attn._tracing.tracing`) and inside :func:`values_checked_by_caller`."""
    return tracing() or _CALLER_CHECKED.get()


def check_int(value: Any, name: str, minimum: int = 0) -> int:
    """``value`` (a Python or NumPy integer, at least ``minimum``) as a Python ``int``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) or value < minimum:
        expected = {0: "a non-negative integer", 1: "a positive integer"}.get(minimum, f"an integer >= {minimum}")
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return int(value)


def check_real(
    value: Any, name: str, expected: str = "a number", valid: Callable[[float], bool] = lambda x: not math.isnan(x)
) -> float:
    """``value`` (a Python or NumPy real number for which ``valid`` holds) as a Python ``float``.

    ``expected`` describes the valid values in the error, e.g. ``"a positive finite number"``.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real) or not valid(float(value)):
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return float(value)


def check_positive(value: Any, name: str) -> float:
    """``value`` as a positive finite Python ``float`` (see :func:`check_real`)."""
    return check_real(value, name, "a positive finite number", lambda x: 0.0 < x < math.inf)


_PRESENT = {  # without touching the device: no CUDA context is created (torchrun ranks parse their options first)
    "cpu": lambda index: index in (None, 0),
    "cuda": lambda index: torch.cuda.is_available() and (index or 0) < torch.cuda.device_count(),
    "mps": lambda index: torch.backends.mps.is_available() and index in (None, 0),
}


def device_present(device: torch.device) -> bool:
    """Whether this machine has ``device`` (its type, and its index where given)."""
    return device.type in _PRESENT and _PRESENT[device.type](device.index)


def check_device(value: Any, name: str) -> Optional[torch.device]:
    """``value`` as a torch device present on this machine (None stays None), or a ValueError naming ``name``."""
    if value is None:
        return None
    try:
        device = None if isinstance(value, (bool, int)) else torch.device(value)
    except (RuntimeError, TypeError):
        device = None
    if device is None:
        raise ValueError(f"{name} must be a torch device such as 'cpu' or 'cuda:0', got {value!r}")
    if not device_present(device):
        raise ValueError(f"{name} {value!r} is not available on this machine (try {name}='cpu')")
    return device


def spans_volume(cell: np.ndarray) -> bool:
    """Whether the three rows of ``cell`` ``[3, 3]`` span a volume: ``|det|`` beyond rounding of the product of
    their lengths (ASE's ``cell.rank`` counts non-zero rows only: three coplanar vectors have rank 3, no volume)."""
    cell = np.asarray(cell, dtype=np.float64)
    lengths = np.linalg.norm(cell, axis=1).prod()
    return bool(lengths > 0 and abs(np.linalg.det(cell)) > 1e-10 * lengths)


def check_floating(x: torch.Tensor, name: str) -> None:
    """``x`` must be a floating-point tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")


def check_dtype(x: torch.Tensor, name: str, expected: torch.dtype, owner: str = "the module") -> None:
    """``x`` must have the dtype ``expected`` of ``owner`` (e.g. "the layer", whose parameters have it), or, under
    ``torch.autocast`` on its device, any floating dtype (the autocast's outputs feed modules of the model's dtype)."""
    if x.dtype != expected and not (x.is_floating_point() and torch.is_autocast_enabled(x.device.type)):
        raise ValueError(
            f"{name} has dtype {x.dtype}, expected {expected} (the dtype of {owner}): "
            f"convert {name} with .to({expected}) or {owner} with .to({x.dtype})"
        )


def check_radius_fits(max_radius: float, dtype: torch.dtype, name: str = "max_radius") -> None:
    """Distances up to ``max_radius`` must have finite squares in ``dtype`` (vector norms square them)."""
    limit = torch.finfo(dtype).max ** 0.5 / 2
    if max_radius > limit:
        raise ValueError(
            f"{name} = {max_radius:.3g} is too large for {dtype}: squared distances overflow from "
            f"{2 * limit:.3g} on (largest usable {name}: {limit:.3g}); rescale the positions or use float64"
        )


def check_pos(pos: torch.Tensor, name: str = "pos", finite: bool = True) -> None:
    """``pos`` must be a floating tensor of shape ``[N, 3]``, finite unless ``finite=False`` (for callers
    that test the values themselves)."""
    if not isinstance(pos, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape [N, 3], got {type(pos).__name__}")
    if pos.dim() != 2 or pos.shape[1] != 3:
        raise ValueError(f"{name} must have shape [N, 3], got {list(pos.shape)}")
    if not pos.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {pos.dtype}")
    if finite and not _skip_values() and not bool(torch.isfinite(pos).all()):
        raise ValueError(f"{name} contains NaN or infinite values")


def check_features(f: torch.Tensor, dim: int, num_nodes: int, name: str = "f", irreps: str = "") -> None:
    """``f`` must be a floating tensor of shape ``[num_nodes, dim]``."""
    if not isinstance(f, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(f).__name__}")
    what = f" (irreps {irreps})" if irreps else ""
    if f.dim() != 2 or f.shape[1] != dim:
        raise ValueError(f"{name} must have shape [N, {dim}]{what}, got {list(f.shape)}")
    if f.shape[0] != num_nodes:
        raise ValueError(f"{name} has {f.shape[0]} rows but pos has {num_nodes} points")
    if not f.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {f.dtype}")


def check_edge_index(edge_index: torch.Tensor, num_nodes: int, name: str = "edge_index") -> None:
    """``edge_index`` must be an integer tensor ``[2, E]`` with entries in ``[0, num_nodes)``."""
    if not isinstance(edge_index, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape [2, E], got {type(edge_index).__name__}")
    if edge_index.dim() != 2 or edge_index.shape[0] != 2:
        raise ValueError(f"{name} must have shape [2, E], got {list(edge_index.shape)}")
    if edge_index.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name} must be an integer (int64 or int32) tensor, got dtype {edge_index.dtype}")
    if not _skip_values() and edge_index.numel() > 0:  # the size may be data-dependent while tracing
        lo, hi = int(edge_index.min()), int(edge_index.max())
        if lo < 0 or hi >= num_nodes:
            raise ValueError(f"{name} has entries in [{lo}, {hi}], outside the valid node range [0, {num_nodes})")


def check_batch(batch: Optional[torch.Tensor], num_nodes: int, name: str = "batch") -> None:
    """``batch`` must be ``None`` or an integer tensor ``[N]`` of non-negative graph indices."""
    if batch is None:
        return
    if not isinstance(batch, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape [N], got {type(batch).__name__}")
    if batch.dim() != 1 or batch.shape[0] != num_nodes:
        raise ValueError(f"{name} must have shape [{num_nodes}] (one graph index per point), got {list(batch.shape)}")
    if batch.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name} must be an integer tensor, got dtype {batch.dtype}")
    if not _skip_values() and batch.numel() > 0 and int(batch.min()) < 0:
        raise ValueError(f"{name} must hold non-negative graph indices")


def check_edge_vec(edge_vec: torch.Tensor, num_edges: int, name: str = "edge_vec") -> None:
    """``edge_vec`` must be a finite floating tensor ``[E, 3]`` matching the edges."""
    if not isinstance(edge_vec, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape [E, 3], got {type(edge_vec).__name__}")
    if edge_vec.dim() != 2 or edge_vec.shape[1] != 3 or edge_vec.shape[0] != num_edges:
        raise ValueError(f"{name} must have shape [{num_edges}, 3] (one vector per edge), got {list(edge_vec.shape)}")
    if not edge_vec.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {edge_vec.dtype}")
    if not _skip_values() and not bool(torch.isfinite(edge_vec).all()):
        raise ValueError(f"{name} contains NaN or infinite values")

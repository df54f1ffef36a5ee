"""Validation of attention inputs and lazy imports of the optional plotting stack."""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Optional

import torch

from e3attn._checks import check_edge_index, check_int

# e3attn is installed from its repository, not from PyPI: "pip install e3attn[viz]" cannot work.
INSTALL_HINT = "pip install matplotlib networkx (or, in a clone of e3attn, pip install -e '.[viz]')"


def require(module: str, caller: str) -> ModuleType:
    """Import an optional dependency of the ``viz`` extra, or fail with an actionable message."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        package = module.split(".")[0]
        raise ImportError(f"{caller} needs {package}: {INSTALL_HINT}") from err


def check_num_nodes(num_nodes: int, name: str = "num_nodes") -> int:
    """``num_nodes`` (a Python or NumPy integer) as a non-negative Python ``int``."""
    return check_int(num_nodes, name)


def infer_num_nodes(edge_index: torch.Tensor, num_nodes: Optional[int]) -> int:
    """``num_nodes`` if given, else one more than the largest node index (0 without edges)."""
    if num_nodes is not None:
        return check_num_nodes(num_nodes)
    nonempty = isinstance(edge_index, torch.Tensor) and edge_index.numel() > 0
    inferred = int(edge_index.max()) + 1 if nonempty else 0
    check_edge_index(edge_index, inferred)
    return inferred


def edge_weights(edge_index: torch.Tensor, alpha: torch.Tensor, num_nodes: int, name: str = "alpha") -> torch.Tensor:
    """Validate a graph of attention weights and return ``alpha`` as ``[E, H]``.

    ``edge_index`` must be ``[2, E]`` with entries in ``[0, num_nodes)``; ``alpha`` a finite,
    non-negative floating tensor ``[E]`` (one head) or ``[E, H]`` with ``H >= 1``.
    """
    check_num_nodes(num_nodes)
    check_edge_index(edge_index, num_nodes)
    if not isinstance(alpha, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape [E] or [E, H], got {type(alpha).__name__}")
    num_edges = edge_index.shape[1]
    if alpha.dim() not in (1, 2) or alpha.shape[0] != num_edges or (alpha.dim() == 2 and alpha.shape[1] == 0):
        raise ValueError(f"{name} must have shape [{num_edges}] or [{num_edges}, H] with H >= 1, got {list(alpha.shape)}")
    if not alpha.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {alpha.dtype}")
    if not bool(torch.isfinite(alpha).all()):
        raise ValueError(f"{name} contains NaN or infinite values")
    if alpha.numel() > 0 and float(alpha.min()) < 0:
        raise ValueError(f"{name} must be non-negative (attention weights), got a minimum of {float(alpha.min())}")
    return alpha if alpha.dim() == 2 else alpha.unsqueeze(1)

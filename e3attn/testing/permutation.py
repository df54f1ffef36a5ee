"""Permutation equivariance: :func:`permutation_error` and :func:`assert_permutation_equivariant`."""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from ._common import _outputs, _tolerance, _working_dtype, default_tolerance

__all__ = ["permutation_error", "assert_permutation_equivariant"]


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
        ValueError: naming the argument or output whose first dimension is not the number of nodes (an
            ``edge_index`` among the arguments, a pooled output: see ``node_args`` and ``node_outputs``).
    """
    node_args = [i for i, a in enumerate(args_in) if isinstance(a, torch.Tensor)] if node_args is None else node_args
    num_nodes = args_in[node_args[0]].shape[0]
    for i in node_args:
        if not isinstance(args_in[i], torch.Tensor) or args_in[i].dim() == 0 or args_in[i].shape[0] != num_nodes:
            raise ValueError(f"args_in[{i}] is not indexed by node (its first dimension is not the {num_nodes} nodes "
                             f"of args_in[{node_args[0]}]): list the arguments that are in node_args (an edge_index "
                             "is not)")
    perm = torch.randperm(num_nodes, generator=generator).to(args_in[node_args[0]].device)
    permuted = [a[perm] if i in node_args else a for i, a in enumerate(args_in)]
    before = _outputs(func(*args_in), "for the original inputs")
    after = _outputs(func(*permuted), "for the permuted inputs")
    node_outputs = [True] * len(before) if node_outputs is None else node_outputs
    for k, (out, is_node) in enumerate(zip(before, node_outputs)):
        if is_node and (out.dim() == 0 or out.shape[0] != num_nodes):
            raise ValueError(f"output {k} has shape {list(out.shape)}, not one row per node ({num_nodes}): mark "
                             "outputs pooled per graph False in node_outputs")
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

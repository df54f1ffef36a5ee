r"""Test helpers for users' own models: O(3) equivariance, permutation equivariance, smoothness across the cutoff.

Every helper takes a plain function of tensors, so it works for a single
:class:`~e3attn.EquivariantAttention`, a whole model, or any function of
positions and features.

Example::

    >>> import torch, e3attn, e3attn.testing
    >>> layer = e3attn.EquivariantAttention("4x0e + 2x1o", "4x0e + 2x1o", "4x0e + 2x1o", "2x0e + 2x1o", 1.5).double()
    >>> pos, f = torch.randn(10, 3, dtype=torch.float64), layer.irreps_input.randn(10, -1, dtype=torch.float64)
    >>> err = e3attn.testing.assert_equivariant(
    ...     lambda pos, f: layer(f, pos), [pos, f], ["cartesian_points", layer.irreps_input], [layer.irreps_output])
    >>> err < 1e-10
    True
"""
from ._common import default_tolerance
from .cutoff import assert_smooth_cutoff, neighbour_scan
from .equivariance import assert_equivariant, equivariance_error
from .permutation import assert_permutation_equivariant, permutation_error

__all__ = [
    "default_tolerance",
    "equivariance_error",
    "assert_equivariant",
    "permutation_error",
    "assert_permutation_equivariant",
    "neighbour_scan",
    "assert_smooth_cutoff",
]


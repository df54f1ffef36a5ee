r"""The geometry that the layers derive from the edge vectors, in one place for all of them.

:func:`edge_geometry` gives, for edge vectors :math:`\vec r_e`,

.. math:: Y(\hat r_e), \qquad p_e = \mathrm{emb}(r_e)\, W_1, \qquad r_e = |\vec r_e|,

the spherical harmonics, the outputs of a radial network's first layer and the lengths: on the numba kernels
of :mod:`e3attn.kernels.geometry_ops` where the layers' kernels run (plain eager CPU tensors, see
:func:`e3attn.kernels.segments_enabled`) and the first layer is not being trained, one pass over the edges each
way; elsewhere by the PyTorch formulation it is given, which those kernels equal.

A first layer that requires a gradient under autograd is training's: there forces are differentiated again, and
the kernels take such second derivatives of the plain formulation, recomputed, so their forward pass would be
work done twice. Frozen weights get the
kernels (:class:`~e3attn.calculator.E3AttnCalculator` freezes them for its calls: an energy-and-forces call is a
first derivative), as does a forward pass under ``torch.no_grad()``; :func:`~e3attn.models.energy_and_forces`
turns autograd on, so there a model whose parameters require gradients takes the plain formulation.
"""
from __future__ import annotations

from typing import Callable, Tuple

import torch

from . import kernels

__all__ = ["edge_geometry"]

Geometry = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def edge_geometry(edge_vec: torch.Tensor, first_layer: torch.Tensor, harmonics: torch.nn.Module,
                  embedding: torch.nn.Module, plain: Callable[[torch.Tensor, torch.Tensor], Geometry]) -> Geometry:
    r"""``(Y [E, (lmax + 1)^2], p [E, J], r [E])`` of ``edge_vec [E, 3]``: the harmonics of ``harmonics``
    (a :class:`~e3attn.spherical_harmonics.SphericalHarmonics`), ``p = embedding(r) @ first_layer`` for a
    :class:`~e3attn.radial.RadialEmbedding` and a first layer ``[number_of_basis, J]``, and the lengths;
    ``plain(edge_vec, first_layer)`` computes the same in PyTorch operations (and runs where the kernels do not,
    or the first layer is trained: see the module docstring).

    Example::

        >>> from e3attn.radial import RadialEmbedding
        >>> from e3attn.spherical_harmonics import SphericalHarmonics
        >>> sh, emb, w1 = SphericalHarmonics(1), RadialEmbedding(4, 2.0, "bessel"), torch.randn(4, 3)
        >>> plain = lambda v, w: (sh(v), emb(v.norm(dim=-1)) @ w, v.norm(dim=-1))
        >>> v = torch.randn(5, 3)
        >>> y, p, r = edge_geometry(v, w1, sh, emb, plain)
        >>> [t.shape for t in (y, p, r)], bool(torch.allclose(p, plain(v, w1)[1], atol=1e-5))
        ([torch.Size([5, 4]), torch.Size([5, 3]), torch.Size([5])], True)
    """
    trained = first_layer.requires_grad and torch.is_grad_enabled()
    if (not trained and kernels.segments_enabled(edge_vec.device, edge_vec.dtype)
            and kernels.eager_on_cpu(edge_vec, first_layer)):
        from .kernels import geometry_ops  # imports numba: only where the kernels run

        return geometry_ops.edge_geometry(edge_vec, first_layer, harmonics=harmonics, embedding=embedding,
                                          plain=plain)
    return plain(edge_vec, first_layer)

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

:func:`shared_edge_geometry` computes it once for several layers of the same edges (every block of
:class:`~e3attn.models.EquivariantTransformer`): one set of harmonics, one embedding of the lengths, and their first
layers side by side in one product.
"""
from __future__ import annotations

from typing import Callable, List, Sequence, Tuple

import torch

from . import kernels
from .spherical_harmonics import SphericalHarmonics

__all__ = ["edge_geometry", "shared_edge_geometry"]

SCALARS = SphericalHarmonics(0)
"""The harmonics of degree 0 (a constant): those of layers that use only the lengths."""

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


def shared_edge_geometry(edge_vec: torch.Tensor, layers: Sequence[torch.nn.Module]) -> List[Geometry]:
    r"""The :func:`edge_geometry` ``(Y, p, r)`` of ``edge_vec [E, 3]`` for each module of ``layers``, computed once:
    the first layers :math:`W_1` of their radial networks side by side, :math:`[p^{(1)} \dots p^{(T)}] =
    \mathrm{emb}(r)\, [W_1^{(1)} \dots W_1^{(T)}]`, and one set of harmonics, those of the largest degree among the
    layers that have them (``sh``): every such layer gets the columns of its own degree (the harmonics are ordered
    by degree, so those of degree up to :math:`l` are the first :math:`(l + 1)^2` columns); the others get them
    all and ignore them. With several layers, each layer's :math:`p^{(t)}` is a contiguous copy of its columns.

    Every module has a ``radial`` network (:class:`~e3attn.radial.RadialMLP`) and an ``embedding``
    (:class:`~e3attn.radial.RadialEmbedding`); the embeddings must be alike (basis, size, cutoff).

    Example::

        >>> from e3attn import EquivariantAttention
        >>> layers = [EquivariantAttention("4x0e", "4x0e", "4x0e", "4x0e", 2.0, lmax=1) for _ in range(2)]
        >>> v = torch.randn(6, 3)
        >>> (y, p, r), second = shared_edge_geometry(v, layers)
        >>> own = layers[1].embedding(v.norm(dim=-1)) @ layers[1].radial.input_layer()  # keys' and values' networks
        >>> y.shape, p.shape, bool(torch.allclose(second[1], own, atol=1e-6))
        (torch.Size([6, 4]), torch.Size([6, 32]), True)
    """
    if not layers:
        return []
    embedding = layers[0].embedding
    key = (embedding.basis, embedding.number_of_basis, embedding.max_radius)
    harmonics = [layer.sh for layer in layers if getattr(layer, "sh", None) is not None]
    for layer in layers:
        other = layer.embedding
        if (other.basis, other.number_of_basis, other.max_radius) != key:
            raise ValueError(f"layers: every layer must embed the lengths alike to share them, got {embedding} "
                             f"and {other}")
    harmonic = SCALARS  # those of the largest degree (a loop, which torch.compile follows)
    for sh in harmonics:
        if harmonic is SCALARS or sh.lmax > harmonic.lmax:
            harmonic = sh
    first = [layer.radial.input_layer() for layer in layers]

    def plain(v: torch.Tensor, w: torch.Tensor) -> Geometry:
        r = v.norm(dim=-1)
        return harmonic(v), embedding(r) @ w, r

    sh, pre, r = edge_geometry(edge_vec, torch.cat(first, dim=1), harmonic, embedding, plain)
    columns = {harmonic.lmax: sh}  # per degree, contiguous (copied once here, not by every kernel call that reads it)
    for own in (getattr(layer, "sh", None) for layer in layers):
        if own is not None and own.lmax not in columns:
            columns[own.lmax] = sh[:, : (own.lmax + 1) ** 2].contiguous()
    # each layer's first layers contiguous: on a strided slice of p, PyTorch's CPU loop for its activation runs each
    # row in steps of two SIMD vectors and the rest of the row one number at a time (16 columns with AVX-512: all of
    # it, more than ten times slower); the copy takes a fraction of that
    parts = pre.split([w.shape[1] for w in first], dim=1)
    parts = [p.contiguous() for p in parts] if len(parts) > 1 else parts
    return [(columns[layer.sh.lmax] if getattr(layer, "sh", None) is not None else sh, p, r)
            for layer, p in zip(layers, parts)]

r"""The geometry of the edges in one compiled pass per direction: spherical harmonics, radial first layer, lengths.

:func:`edge_geometry` computes, from the edge vectors :math:`\vec r_e`, what the layer derives from them,

.. math::

    Y(\hat r_e), \qquad p_e = \mathrm{emb}(r_e)\, W_1, \qquad r_e = |\vec r_e|,

equal to :class:`~e3attn.spherical_harmonics.SphericalHarmonics`, :class:`~e3attn.radial.RadialEmbedding`
followed by :meth:`RadialMLP.input_layer() <e3attn.radial.RadialMLP.input_layer>` and the norm (the plain
formulation), on the numba kernels of :mod:`e3attn.kernels.geometry`: one pass over the edges forward and one
backward, where the plain formulation runs about 50 PyTorch operations on ``[E, ...]`` tensors. Its first
derivatives run on the kernels too; a gradient that must itself be differentiable (``create_graph=True``:
training on forces), that is batched (``torch.autograd.grad(..., is_grads_batched=True)``: Hessians,
Jacobians) or that is taken inside a ``torch.func`` transform is taken of the plain formulation, recomputed from
the saved edge vectors, so derivatives of every order are those of the plain formulation.

It is a ``torch.autograd.Function`` for plain eager tensors on the CPU (:func:`~e3attn.kernels.eager_on_cpu`); the
layer uses the plain formulation elsewhere, under ``torch.compile`` included (whose code generator fuses those
elementwise operations itself).
"""
from __future__ import annotations

from typing import Callable, Tuple

import torch

from . import _plain_eager, cpu, geometry
from .cpu import _array, _forward_groups
from .threads import groups_for, parallel, reduction_groups

__all__ = ["edge_geometry"]

_TILE = 128
_DTYPES = (torch.float32, torch.float64)
_BASES = {"smooth_finite": geometry.SMOOTH_FINITE, "gaussian": geometry.GAUSSIAN, "bessel": geometry.BESSEL}

Geometry = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def edge_geometry(vectors: torch.Tensor, first_layer: torch.Tensor, harmonics: torch.nn.Module,
                  embedding: torch.nn.Module, plain: Callable[[torch.Tensor, torch.Tensor], Geometry]) -> Geometry:
    r"""``(Y [E, (lmax + 1)^2], p [E, J], r [E])`` of ``vectors [E, 3]`` for the first layer
    ``first_layer [n, J]`` (:meth:`~e3attn.radial.RadialMLP.input_layer`), the spherical harmonics
    ``harmonics`` and the embedding ``embedding`` (see the module docstring). ``plain(vectors, first_layer)``
    computes the same in PyTorch operations (for derivatives that must be differentiable)."""
    if vectors.dim() != 2 or vectors.shape[1] != 3 or vectors.device.type != "cpu" or vectors.dtype not in _DTYPES:
        raise ValueError(f"vectors must be a float32 or float64 CPU tensor [E, 3], got {vectors.dtype} "
                         f"{list(vectors.shape)} on {vectors.device.type}")
    basis = embedding.number_of_basis
    if first_layer.dim() != 2 or first_layer.shape[0] != basis or first_layer.dtype != vectors.dtype:
        raise ValueError(f"first_layer must be [{basis}, J] of {vectors.dtype}, got "
                         f"{first_layer.dtype} {list(first_layer.shape)}")
    return _Geometry.apply(vectors, first_layer, _constants(harmonics, embedding, vectors.dtype), plain)


def _constants(harmonics, embedding, dtype: torch.dtype) -> tuple:
    """The kernels' arguments that describe the harmonics and the embedding, in ``dtype``."""
    from ..spherical_harmonics import monomial_recurrence

    parents, variables = monomial_recurrence(harmonics.lmax)
    return (_array(harmonics.constant("coefficients", dtype)).reshape(-1), harmonics.lmax, _BASES[embedding.basis],
            _array(embedding.constant("centers", dtype)), embedding.step, embedding.max_radius, embedding.scale,
            parents, variables)


def _work(vectors: torch.Tensor, first_layer: torch.Tensor) -> int:
    """Multiply-adds, roughly, for :func:`~e3attn.kernels.threads.parallel`: the first layer and about 200 for
    the harmonics and the embedding per edge."""
    return vectors.shape[0] * (first_layer.numel() + 200)


def _run(vectors: torch.Tensor, first_layer: torch.Tensor, constants: tuple, grads: tuple, outputs: tuple,
         groups: int, work: int) -> None:
    """:func:`~e3attn.kernels.geometry.geometry` on ``groups`` groups of tiles (forward where ``grads`` are
    empty); every unused output an empty array."""
    arrays = [_array(t) for t in grads] + [t.numpy() for t in outputs]
    vec, w1 = _array(vectors), _array(first_layer)
    parallel(lambda g: geometry.geometry(vec, w1, *constants, *arrays[:3], _TILE, g, groups, *arrays[3:]), groups,
             work)


def _forward(vectors: torch.Tensor, first_layer: torch.Tensor, constants: tuple) -> Geometry:
    num, lmax, empty = vectors.shape[0], constants[1], vectors.new_empty(0, 1)
    sh, pre, r = vectors.new_empty(num, (lmax + 1) ** 2), vectors.new_empty(num, first_layer.shape[1]), \
        vectors.new_empty(num, 1)
    work = _work(vectors, first_layer)
    _run(vectors, first_layer, constants, (empty, empty, empty), (sh, pre, r, empty, first_layer.new_empty((0, 1, 1))),
         groups_for(work, _forward_groups(num, _TILE)), work)
    return sh, pre, r.view(num)


def _backward(vectors: torch.Tensor, first_layer: torch.Tensor, constants: tuple, g_sh: torch.Tensor,
              g_pre: torch.Tensor, g_r: torch.Tensor, need_vectors: bool, need_first: bool
              ) -> Tuple[torch.Tensor, torch.Tensor]:
    empty = vectors.new_empty(0, 1)
    g_vec = torch.empty_like(vectors) if need_vectors else vectors.new_empty(0, 3)
    work = 2 * _work(vectors, first_layer)
    # the gradient of the first layer is summed per group (their number set by the work alone: bitwise repeatable)
    split = groups_for(work, _forward_groups(vectors.shape[0], _TILE))
    groups = reduction_groups(work, cpu.GROUPS) if need_first else split
    g_first = first_layer.new_zeros((groups if need_first else 0,) + tuple(first_layer.shape))
    _run(vectors, first_layer, constants, (g_sh, g_pre, g_r.reshape(-1, 1)), (empty, empty, empty, g_vec, g_first),
         groups, work)
    return g_vec if need_vectors else None, g_first.sum(0) if need_first else None


class _Geometry(torch.autograd.Function):
    @staticmethod
    def forward(ctx, vectors, first_layer, constants, plain):
        ctx.save_for_backward(vectors, first_layer)
        ctx.constants, ctx.plain = constants, plain
        if torch.autograd._profiler_enabled():
            with torch.profiler.record_function("e3attn::edge_geometry"):
                return _forward(vectors, first_layer, constants)
        return _forward(vectors, first_layer, constants)

    @staticmethod
    def backward(ctx, g_sh, g_pre, g_r):
        vectors, first_layer = ctx.saved_tensors
        need_vectors, need_first = ctx.needs_input_grad[:2]
        differentiable = torch.is_grad_enabled()
        if differentiable or not _plain_eager((g_sh, g_pre, g_r)):  # that of the plain formulation (also batched)
            inputs = [t for t, need in ((vectors, need_vectors), (first_layer, need_first)) if need]
            with torch.enable_grad():
                outputs = zip(ctx.plain(vectors, first_layer), (g_sh, g_pre, g_r))
            used = [(out, g) for out, g in outputs if out.requires_grad]
            grads = iter(torch.autograd.grad([out for out, _ in used], inputs, [g for _, g in used],
                                             create_graph=differentiable, allow_unused=True))  # (Y: lmax 0)
            g_vec, g_first = (next(grads) if need_vectors else None), (next(grads) if need_first else None)
        else:
            g_vec, g_first = _backward(vectors, first_layer, ctx.constants, g_sh.contiguous(), g_pre.contiguous(),
                                       g_r.contiguous(), need_vectors, need_first)
        return g_vec if need_vectors else None, g_first, None, None

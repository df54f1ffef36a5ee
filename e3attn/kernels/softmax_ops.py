r"""The attention's softmax over the edges grouped by destination, in one compiled pass per direction (numba).

With the edges sorted by destination (``rowptr [N + 1]``, as in :mod:`e3attn.kernels.segments`),
:func:`segment_softmax_csr` computes for logits :math:`s` ``[E, H]`` exactly what
:func:`e3attn.scatter.segment_softmax` ``(..., return_sqrt=True)`` computes (the plain formulation),

.. math::

    \alpha_e = \frac{e^{s_e - m_i}}{Z_i}, \qquad \beta_e = \frac{e^{(s_e - m_i)/2}}{\sqrt{Z_i}}, \qquad
    Z_i = \sum_{e' \to i} e^{s_{e'} - m_i},

with :math:`m_i` the largest logit of node :math:`i` (0 where none is finite, :math:`Z_i = 1` where it is 0 or
NaN, and then constant),
in one pass over the nodes instead of about ten PyTorch operations, and the gradient

.. math::

    \partial_{s_e} = \alpha_e \left(g_{\alpha, e} - \sum_{e' \to i} \alpha_{e'} g_{\alpha, e'}\right)
    + \tfrac{1}{2} \left(\beta_e g_{\beta, e} - \alpha_e \sum_{e' \to i} \beta_{e'} g_{\beta, e'}\right)

in one more. A gradient that must itself be differentiable (``create_graph=True``), that is batched
(``is_grads_batched=True``) or taken inside a ``torch.func`` transform is taken of the plain formulation, recomputed
from the saved logits (whose own derivatives are closed forms, ``e3attn._softmax_jet``; with a NaN logit they are
NaN on its whole segment, where this kernel's first derivative keeps them on its edge). A
``torch.autograd.Function`` for plain eager CPU tensors, like
:mod:`e3attn.kernels.geometry_ops` (:func:`~e3attn.kernels.eager_on_cpu` says where).
"""
from __future__ import annotations

import math
from typing import Callable, Tuple

import numba
import numpy as np
import torch

from . import _plain_eager
from .cpu import _JIT
from .segment_checks import check_segments

__all__ = ["segment_softmax_csr"]


@numba.njit(**_JIT)
def _softmax(s, rowptr, alpha, beta, g_alpha, g_beta, g_s):
    """Forward (``g_s`` empty): ``alpha``, ``beta`` of ``s``; backward: ``g_s`` from ``alpha``, ``beta`` and their
    gradients (one function for both: numba compiles each function for seconds)."""
    for i in range(rowptr.shape[0] - 1):
        start, stop = rowptr[i], rowptr[i + 1]
        for h in range(alpha.shape[1]):
            if g_s.shape[0]:
                sa = sb = total = 0.0
                for e in range(start, stop):
                    sa += alpha[e, h] * g_alpha[e, h]
                    sb += beta[e, h] * g_beta[e, h]
                    total += alpha[e, h]
                if not total > 0:  # Z was set to 1 (nothing finite, or a NaN): it passes no gradient
                    sa = sb = 0.0
                for e in range(start, stop):
                    a, b = alpha[e, h], beta[e, h]
                    g_s[e, h] = a * (g_alpha[e, h] - sa) + 0.5 * (b * g_beta[e, h] - a * sb)
                continue
            m = -np.inf
            for e in range(start, stop):
                if s[e, h] > m or s[e, h] != s[e, h]:  # a NaN maximum, as torch.amax, then m = 0 below
                    m = s[e, h]
            if not (-np.inf < m < np.inf):
                m = 0.0
            z = 0.0
            for e in range(start, stop):
                alpha[e, h] = math.exp(s[e, h] - m)
                z += alpha[e, h]
            z = z if z > 0 else 1.0
            scale = 1 / math.sqrt(z)
            for e in range(start, stop):
                alpha[e, h] /= z
                beta[e, h] = math.exp(0.5 * (s[e, h] - m)) * scale


def segment_softmax_csr(logits: torch.Tensor, rowptr: torch.Tensor,
                        plain: Callable[[torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]
                        ) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""``(alpha, beta)`` ``[E, H]`` of ``logits [E, H]`` for the edges sorted by destination (``rowptr``, checked);
    ``plain(logits)`` computes the same in PyTorch operations (for derivatives that must be differentiable)."""
    if logits.dim() != 2 or logits.device.type != "cpu" or logits.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"logits must be a float32 or float64 CPU tensor [E, H], got {logits.dtype} "
                         f"{list(logits.shape)} on {logits.device.type}")
    check_segments(rowptr, logits.shape[0], rowptr.shape[0] - 1, logits.device)
    return _Softmax.apply(logits, rowptr, plain)


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, rowptr, plain):
        alpha, beta, empty = torch.empty_like(logits), torch.empty_like(logits), logits.new_empty(0, 1).numpy()
        _softmax(logits.detach().contiguous().numpy(), rowptr.numpy(), alpha.numpy(), beta.numpy(), empty, empty, empty)
        ctx.save_for_backward(logits, rowptr, alpha, beta)
        ctx.plain = plain
        return alpha, beta

    @staticmethod
    def backward(ctx, g_alpha, g_beta):
        logits, rowptr, alpha, beta = ctx.saved_tensors
        differentiable = torch.is_grad_enabled()
        if differentiable or not _plain_eager((g_alpha, g_beta)):  # that of the plain formulation (also batched)
            with torch.enable_grad():
                outputs = ctx.plain(logits)
            (g_s,) = torch.autograd.grad(outputs, logits, (g_alpha, g_beta), create_graph=differentiable)
            return g_s, None, None
        g_s = torch.empty_like(logits)
        _softmax(logits.new_empty(0, 1).numpy(), rowptr.numpy(), alpha.numpy(), beta.numpy(),
                 g_alpha.contiguous().numpy(), g_beta.contiguous().numpy(), g_s.numpy())
        return g_s, None, None

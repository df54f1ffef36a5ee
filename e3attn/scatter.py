r"""Scatter and segment-softmax helpers in native PyTorch.

Edges are grouped into *segments* by an index (for attention: the destination
node of every edge). The helpers below reduce per segment with ``index_add_``
and ``scatter_reduce`` so that no compiled extension is needed. When
`torch_scatter <https://github.com/rusty1s/pytorch_scatter>`_ is installed the
same reductions can be run through it with ``backend="torch_scatter"``; both
backends give identical results (tested).
"""
from __future__ import annotations

import functools
from typing import Tuple

import torch

from ._softmax_jet import softmax_with_closed_form_derivatives

__all__ = ["scatter_sum", "scatter_max", "segment_softmax", "has_torch_scatter"]

_BACKENDS = ("torch", "torch_scatter")


def has_torch_scatter() -> bool:
    """Whether the optional ``torch_scatter`` package can be imported."""
    try:
        import torch_scatter  # noqa: F401
    except ImportError:
        return False
    return True


def _check_backend(backend: str) -> None:
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "torch_scatter" and not has_torch_scatter():
        raise ImportError("backend='torch_scatter' needs the optional torch-scatter package (pip install e3attn[pyg])")


def gather_rows(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``values[index]`` for ``values [N, k]``, gathered from the flattened values (the rows of every edge's
    source or destination, say: the layer and :func:`~e3attn.models.edge_vectors` gather with it).

    The gradient is then a one-dimensional ``index_add``. The two-dimensional one of
    ``values.index_select(0, index)`` is miscompiled by ``torch.compile`` on the CPU with 2 or more
    threads (torch 2.13, inductor: wrong gradients and heap corruption), which ``tests/test_compile.py``
    catches.
    """
    k = values.shape[1]
    flat = values.reshape(-1).index_select(0, (k * index[:, None] + torch.arange(k, device=index.device)).reshape(-1))
    return flat.view(-1, k)


def scatter_sum(src: torch.Tensor, index: torch.Tensor, dim_size: int, backend: str = "torch") -> torch.Tensor:
    r"""Sum the rows of ``src`` into ``dim_size`` segments.

    .. math:: \mathrm{out}_i = \sum_{e:\ \mathrm{index}_e = i} \mathrm{src}_e

    Args:
        src: ``[E, ...]`` values.
        index: ``[E]`` segment of every row, in ``[0, dim_size)``.
        dim_size: number of segments; empty segments give zeros.
        backend: ``"torch"`` (``index_add_``) or ``"torch_scatter"``.

    Returns:
        ``[dim_size, ...]``
    """
    _check_backend(backend)
    if backend == "torch_scatter":
        import torch_scatter

        return torch_scatter.scatter(src, index, dim=0, dim_size=dim_size, reduce="sum")
    out = src.new_zeros((dim_size,) + tuple(src.shape[1:]))
    return out.index_add(0, index, src)


def scatter_max(src: torch.Tensor, index: torch.Tensor, dim_size: int, backend: str = "torch") -> torch.Tensor:
    r"""Maximum of the rows of ``src`` in each of ``dim_size`` segments.

    Empty segments give ``-inf``.

    Args:
        src: ``[E, ...]`` values.
        index: ``[E]`` segment of every row.
        dim_size: number of segments.
        backend: ``"torch"`` (``scatter_reduce``) or ``"torch_scatter"``.

    Returns:
        ``[dim_size, ...]``
    """
    _check_backend(backend)
    shape = (dim_size,) + tuple(src.shape[1:])
    if backend == "torch_scatter":
        import torch_scatter

        out = src.new_full(shape, float("-inf"))
        out, _ = torch_scatter.scatter_max(src, index, dim=0, out=out)
        return out
    expanded = index.view((-1,) + (1,) * (src.dim() - 1)).expand_as(src)
    out = src.new_full(shape, float("-inf"))
    return out.scatter_reduce(0, expanded, src, reduce="amax", include_self=True)


def segment_softmax(
    src: torch.Tensor,
    index: torch.Tensor,
    num_segments: int,
    *,
    return_sqrt: bool = False,
    backend: str = "torch",
) -> torch.Tensor | Tuple[torch.Tensor, torch.Tensor]:
    r"""Overflow-safe softmax of ``src`` over the rows that share a segment.

    .. math::

        \alpha_e = \frac{\exp(s_e - m_{i})}{\sum_{e':\ \mathrm{index}_{e'} = i} \exp(s_{e'} - m_{i})},
        \qquad m_i = \max_{e':\ \mathrm{index}_{e'} = i} s_{e'},\quad i = \mathrm{index}_e

    Subtracting the per-segment maximum :math:`m_i` leaves the result unchanged
    but keeps every exponent :math:`\le 0`, so large logits never overflow.
    Entries equal to ``-inf`` are excluded (weight exactly 0); a segment whose
    entries are all ``-inf`` gets :math:`\alpha = 0`, never NaN. A per-edge
    multiplicative weight :math:`w_e \ge 0` is therefore passed as
    ``src + log(w)``.

    Args:
        src: ``[E]`` or ``[E, H]`` logits (one column per head).
        index: ``[E]`` segment of every row.
        num_segments: number of segments.
        return_sqrt: also return :math:`\sqrt{\alpha_e}`, computed as
            :math:`\exp((s_e - m_i)/2) / \sqrt{Z_i}` so that its gradient stays
            finite where :math:`\alpha_e = 0`.
        backend: ``"torch"`` or ``"torch_scatter"``.

    Returns:
        ``alpha`` with the shape of ``src``, or ``(alpha, sqrt_alpha)``.

    Differentiated in closed form (``e3attn._softmax_jet``): the gradient in ``src`` and that gradient's own
    derivatives (a force-training step's second derivative) take a few segment sums, not autograd's
    derivatives of this formula; they are the same to rounding where the logits are not NaN (a NaN logit makes
    the gradients of its whole segment NaN).
    """
    _check_backend(backend)
    plain = functools.partial(_segment_softmax, index=index, num_segments=num_segments, backend=backend)
    alpha, sqrt_alpha = softmax_with_closed_form_derivatives(src, index, num_segments, plain,
                                                             functools.partial(scatter_sum, backend=backend))
    return (alpha, sqrt_alpha) if return_sqrt else alpha


def _segment_softmax(src: torch.Tensor, index: torch.Tensor, num_segments: int,
                     backend: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`segment_softmax`'s ``(alpha, sqrt_alpha)`` by its formula (differentiable by autograd)."""
    m = scatter_max(src.detach(), index, num_segments, backend=backend)
    m = torch.where(torch.isfinite(m), m, 0.0)
    shifted = src - m.index_select(0, index)  # <= 0, -inf for excluded entries
    numerator = shifted.exp()
    z = scatter_sum(numerator, index, num_segments, backend=backend)
    # z >= 1 wherever a segment has a finite entry (its maximum contributes exp(0)),
    # and z == 0 only for segments with nothing to attend to, whose numerators are all 0.
    z = torch.where(z > 0, z, 1.0).index_select(0, index)
    return numerator / z, (0.5 * shifted).exp() * z.rsqrt()

r"""Plain (not equivariant) dot-product attention, dense and sparse.

Attention is a weighted mean. A transformer evaluates it *densely*, over all
query-key pairs at once, as matrix products; a graph network evaluates it
*sparsely*, over the edges of a graph. On the complete graph the two are the
same function:

.. math::

    \mathrm{out}_i = \sum_j \alpha_{ij} v_j, \qquad
    \alpha_{ij} = \frac{\exp(s_{ij} / T)}{\sum_{j'} \exp(s_{ij'} / T)}, \qquad
    s_{ij} = \frac{q_i \cdot k_j}{\sqrt{d}}

where :math:`j` runs over the keys query :math:`i` may attend to: the entries of
a boolean mask (:func:`dense_attention`) or the sources of the edges into node
:math:`i` (:func:`graph_attention`). :math:`T` is the temperature, including
its two limits (see :func:`dense_attention`).
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Tuple

import torch

from ._checks import check_edge_index, check_real
from .scatter import scatter_max, scatter_sum, segment_softmax

__all__ = ["dense_attention", "graph_attention"]

_NEG_INF = float("-inf")


def _check_temperature(temperature: float, dtype: torch.dtype) -> float:
    """``temperature`` as a float: 0, inf, or a normal number of ``dtype`` (so that dividing by it is exact)."""
    t = check_real(temperature, "temperature", "a number in [0, inf] (0 = hard attention, inf = uniform)",
                   lambda x: x >= 0)
    info = torch.finfo(dtype)
    if t != 0 and not math.isinf(t) and not info.tiny <= t <= info.max:
        raise ValueError(
            f"temperature = {t:.3g} is outside the normal range of {dtype} [{info.tiny:.3g}, {info.max:.3g}]: "
            "use temperature=0 (hard attention) or inf (uniform), the limits, or compute in float64"
        )
    return t


def _check_dropout(dropout_p: float) -> float:
    return check_real(dropout_p, "dropout_p", "a probability in [0, 1]", lambda p: 0 <= p <= 1)


def _check_float(name: str, x: torch.Tensor, min_dim: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < min_dim:
        raise ValueError(f"{name} must have at least {min_dim} dimensions, got shape {list(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, min_dim: int) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_float(name, x, min_dim)
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k and v must share a dtype, got q {q.dtype}, k {k.dtype} and v {v.dtype}")
    if q.shape[-1] == 0 or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            "q and k must share a non-empty feature dimension d (last axis), "
            f"got shapes {list(q.shape)} and {list(k.shape)}"
        )


def _scaled(q: torch.Tensor, temperature: float) -> torch.Tensor:
    r"""``q`` divided by :math:`\sqrt{d}` (cheaper than dividing all the logits); unscaled in the limits."""
    if temperature == 0 or math.isinf(temperature):
        return q
    return q / math.sqrt(q.shape[-1])


def _logits(s: torch.Tensor, temperature: float, group_max: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    r"""Logits :math:`s / T` whose softmax is the attention, the limits :math:`T = 0, \infty` included.

    ``s`` holds the scores :math:`q \cdot k / \sqrt{d}` with ``-inf`` for excluded entries;
    ``group_max`` returns, for every entry, the maximum of the entries it competes with.
    For :math:`T \ne 1` the (detached) maximum is subtracted before dividing, which leaves
    the softmax and its gradient unchanged but keeps every logit :math:`\le 0`: a tiny
    :math:`T` cannot overflow to :math:`\infty - \infty`. In the limits the logits become
    ``0`` for the entries that keep a share (the maxima, or all allowed entries) and
    ``-inf`` for the others.
    """
    if math.isinf(temperature):
        return torch.zeros_like(s).masked_fill(s == _NEG_INF, _NEG_INF)
    if temperature == 1:
        return s
    top = group_max(s.detach())
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # groups with nothing allowed
    if temperature == 0:
        keep = (s.detach() == top) & (s != _NEG_INF)
        return torch.zeros_like(s).masked_fill(~keep, _NEG_INF)
    return (s - top) / temperature


def _dropout(weights: torch.Tensor, dropout_p: float) -> torch.Tensor:
    if dropout_p == 0:
        return weights
    return torch.nn.functional.dropout(weights, dropout_p, training=True)


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    dropout_p: float = 0.0,
) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""Scaled dot-product attention over all query-key pairs (the transformer form).

    .. math::

        w_{ij} = \frac{m_{ij} \exp\!\big(s_{ij} / T\big)}{\sum_{j'} m_{ij'} \exp\!\big(s_{ij'} / T\big)},
        \qquad s_{ij} = \frac{q_i \cdot k_j}{\sqrt{d}},
        \qquad \mathrm{out}_i = \sum_j w_{ij}\, v_j

    with :math:`m_{ij} \in \{0, 1\}` the mask. Each row's maximum score is
    subtracted before dividing by :math:`T`, so large logits (:math:`|s| \sim 10^4`)
    and tiny temperatures (:math:`T = 10^{-30}`: one-hot weights) neither overflow
    nor give NaN; a row with nothing to attend to gets :math:`w_{i\cdot} = 0` and
    :math:`\mathrm{out}_i = 0`.

    The two limits of the temperature are evaluated exactly:

    * :math:`T = 0` (hard attention): :math:`w_{ij} = 1 / |A_i|` for
      :math:`j \in A_i = \arg\max_{j': m_{ij'} = 1} q_i \cdot k_{j'}` and 0 otherwise,
      i.e. one-hot at the arg-max, with **ties split evenly** among the (exactly,
      in floating point) equal maxima, which is the limit of the softmax;
    * :math:`T = \infty`: :math:`w_{ij} = m_{ij} / \sum_{j'} m_{ij'}`, uniform
      over the allowed keys.

    In both limits the weights do not depend on ``q`` and ``k``: their gradient
    with respect to ``q`` and ``k`` is zero, gradients still flow through ``v``.

    Args:
        q: ``[..., N, d]`` queries.
        k: ``[..., M, d]`` keys.
        v: ``[..., M, dv]`` values.
        mask: optional boolean tensor broadcastable to ``[..., N, M]``;
            ``True`` means query ``i`` may attend to key ``j``.
        temperature: :math:`T \in [0, \infty]`, ``float("inf")`` included; a
            finite :math:`T > 0` must be a normal number of the dtype of ``q``
            (at least :math:`1.2 \times 10^{-38}` in float32), else ValueError.
        dropout_p: probability of zeroing an attention weight (the kept ones
            are scaled by :math:`1 / (1 - p)`), as in ``torch.nn.MultiheadAttention``.

    Returns:
        ``(out, weights)``: ``out`` is ``[..., N, dv]`` and ``weights`` is
        ``[..., N, M]`` (after dropout), the leading dimensions broadcast over
        ``q``, ``k``, ``v`` and ``mask``.

    Example::

        >>> q, k = torch.tensor([[0.0, 2.0, 1.0]]), torch.tensor([[0.0, 0, 0], [2, 3, 1], [0, 2, 1]])
        >>> out, w = dense_attention(q, k, torch.tensor([[0.0], [0.4], [0.1]]), temperature=3 ** -0.5)
        >>> w  # softmax([0, 7, 5])
        tensor([[8.0254e-04, 8.8009e-01, 1.1911e-01]])
        >>> out
        tensor([[0.3639]])
    """
    _check_qkv(q, k, v, 2)
    temperature = _check_temperature(temperature, q.dtype)
    dropout_p = _check_dropout(dropout_p)
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"k and v must hold the same number of keys M (axis -2), got {list(k.shape)} and {list(v.shape)}"
        )
    try:
        batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    except RuntimeError:
        raise ValueError(
            "the leading (batch) dimensions of q, k and v must broadcast, "
            f"got {list(q.shape)}, {list(k.shape)}, {list(v.shape)}"
        ) from None
    s = _scaled(q, temperature) @ k.transpose(-1, -2)
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            raise ValueError("mask must be a boolean tensor (True = may attend)")
        try:
            torch.broadcast_shapes(mask.shape, batch + s.shape[-2:])
        except RuntimeError:
            raise ValueError(
                f"mask must broadcast to [..., N, M] = {list(batch + s.shape[-2:])}, got shape {list(mask.shape)}"
            ) from None
        s = torch.where(mask, s, _NEG_INF)
    logits = _logits(s, temperature, lambda x: x.amax(dim=-1, keepdim=True))
    empty = None if mask is None else ~mask.any(dim=-1, keepdim=True)
    if empty is None or not bool(empty.any()):
        weights = torch.softmax(logits, dim=-1)
    else:  # rows with nothing to attend to are all -inf: give them finite logits, then zero weights
        weights = torch.softmax(logits.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    weights = _dropout(weights, dropout_p)
    return weights @ v, weights


def graph_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    edge_index: torch.Tensor,
    *,
    temperature: float = 1.0,
    dropout_p: float = 0.0,
) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""Scaled dot-product attention along the edges of a graph (the message-passing form).

    .. math::

        s_e = \frac{q_{\mathrm{dst}(e)} \cdot k_{\mathrm{src}(e)}}{\sqrt{d}}, \qquad
        \alpha_e = \frac{\exp(s_e / T)}{\sum_{e':\ \mathrm{dst}(e') = \mathrm{dst}(e)} \exp(s_{e'} / T)},
        \qquad \mathrm{out}_i = \sum_{e:\ \mathrm{dst}(e) = i} \alpha_e\, v_{\mathrm{src}(e)}

    Node :math:`i` attends to the sources of its incoming edges, so on the
    complete graph this is :func:`dense_attention`, and on any graph it is
    :func:`dense_attention` with the mask :math:`m_{ij} = [(j \to i) \in E]`.
    The softmax is :func:`~e3attn.scatter.segment_softmax` (per-node maximum
    subtracted: overflow-safe). Nodes without incoming edges get 0. The limits
    :math:`T = 0` (ties split evenly) and :math:`T = \infty` are exact, as in
    :func:`dense_attention`. A repeated edge counts as often as it appears.

    Args:
        q: ``[N, d]`` or ``[N, H, d]`` queries of the destination nodes (``H`` heads).
        k: ``[M, d]`` or ``[M, H, d]`` keys of the source nodes (``M = N`` for self-attention).
        v: ``[M, dv]`` or ``[M, H, dv]`` values of the source nodes.
        edge_index: ``[2, E]`` integer tensor, row 0 the source
            (in ``[0, M)``), row 1 the destination (in ``[0, N)``).
        temperature: :math:`T \in [0, \infty]`, as for :func:`dense_attention`.
        dropout_p: probability of zeroing an attention weight (kept ones scaled
            by :math:`1 / (1 - p)`).

    Returns:
        ``(out, alpha)``: ``out`` is ``[N, dv]`` or ``[N, H, dv]``; ``alpha`` is
        ``[E]`` or ``[E, H]`` (after dropout).

    Example::

        >>> q = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
        >>> k = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
        >>> v = torch.tensor([[0.0], [1.0], [2.0]])
        >>> edge_index = torch.tensor([[0, 1, 2, 1], [0, 0, 0, 2]])  # 0->0, 1->0, 2->0, 1->2
        >>> out, alpha = graph_attention(q, k, v, edge_index, temperature=0.0)
        >>> alpha  # node 0: scores (1, 0, 1), the tie is split; node 1: no edges
        tensor([0.5000, 0.0000, 0.5000, 1.0000])
        >>> out
        tensor([[1.],
                [0.],
                [1.]])
    """
    _check_qkv(q, k, v, 2)
    temperature = _check_temperature(temperature, q.dtype)
    dropout_p = _check_dropout(dropout_p)
    if q.dim() > 3 or not q.dim() == k.dim() == v.dim():
        raise ValueError(
            "q, k and v must all be [nodes, d] or all [nodes, H, d], "
            f"got {list(q.shape)}, {list(k.shape)}, {list(v.shape)}"
        )
    if not q.shape[1:-1] == k.shape[1:-1] == v.shape[1:-1]:
        raise ValueError(
            "q, k and v must have the same number of heads H (axis 1), "
            f"got {list(q.shape)}, {list(k.shape)}, {list(v.shape)}"
        )
    if k.shape[0] != v.shape[0]:
        raise ValueError(
            f"k and v must hold the same number of source nodes M (axis 0), got {list(k.shape)} and {list(v.shape)}"
        )
    num_dst, num_src = q.shape[0], k.shape[0]
    check_edge_index(edge_index, max(num_dst, num_src))
    src, dst = edge_index[0].long(), edge_index[1].long()
    if src.numel() > 0 and (int(src.max()) >= num_src or int(dst.max()) >= num_dst):
        raise ValueError(
            f"edge_index sources (row 0) must be < M = {num_src} (rows of k, v) "
            f"and destinations (row 1) < N = {num_dst} (rows of q)"
        )
    s = (_scaled(q, temperature)[dst] * k[src]).sum(dim=-1)
    logits = _logits(s, temperature, lambda x: scatter_max(x, dst, num_dst)[dst])
    alpha = _dropout(segment_softmax(logits, dst, num_dst), dropout_p)
    return scatter_sum(alpha.unsqueeze(-1) * v[src], dst, num_dst), alpha

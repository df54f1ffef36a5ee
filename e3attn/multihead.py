r"""Trainable multi-head attention, dense (transformer) and sparse (graph).

Both modules hold the same parameters: per head :math:`h = 1..H` the
projections :math:`W^Q_h, W^K_h, W^V_h` (stored stacked, as one linear layer
each) and a way to combine the :math:`H` head outputs into one feature vector:

* ``combine="concat"`` ("Attention Is All You Need", Vaswani et al. 2017):

  .. math:: \mathrm{MultiHead}(Q, K, V) = \mathrm{Concat}(\mathrm{head}_1, \dots, \mathrm{head}_H)\, W^O + b^O,
      \qquad \mathrm{head}_h = \mathrm{Attention}(Q W^Q_h, K W^K_h, V W^V_h)

  with head size ``embed_dim // num_heads`` by default;

* ``combine="gaan"`` (the multi-head graph attention of GaAN, Zhang et al. 2018,
  as written in the *Attention Layers* chapter of "Deep Learning for Molecules
  and Materials"): every head keeps the full feature size (square
  :math:`W_h`), and the stack of heads :math:`e'_{ijh}` (node :math:`i`, feature
  :math:`j`, head :math:`h`) is reduced by one learned weight tensor
  :math:`w_{jhl}` that maps the last two axes (feature, head) to features,

  .. math:: \bar e'_{il} = \sum_{j, h} e'_{ijh}\, w_{jhl}.

  This is a linear map of the stacked heads without bias: the same function
  class as ``"concat"`` with :math:`b^O = 0` and :math:`W^O` the reshaped
  :math:`w` (tested), parametrised per head as in the chapter.

:class:`MultiHeadAttention` evaluates the heads with :func:`~e3attn.plain.dense_attention`,
:class:`GraphMultiHeadAttention` with :func:`~e3attn.plain.graph_attention`; with the
same weights they agree on the complete graph.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch

from ._checks import check_dtype, check_int, check_real
from .plain import dense_attention, graph_attention

__all__ = ["MultiHeadAttention", "GraphMultiHeadAttention"]

_COMBINE = ("concat", "gaan")


class _MultiHeadBase(torch.nn.Module):
    """Projections and head combination shared by the dense and the graph module."""

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        head_dim: Optional[int] = None,
        kdim: Optional[int] = None,
        vdim: Optional[int] = None,
        combine: str = "concat",
        dropout: float = 0.0,
        bias: bool = True,
    ) -> None:
        super().__init__()
        embed_dim, num_heads = check_int(embed_dim, "embed_dim", 1), check_int(num_heads, "num_heads", 1)
        if combine not in _COMBINE:
            raise ValueError(f"combine must be one of {_COMBINE}, got {combine!r}")
        if head_dim is None and combine == "concat" and embed_dim % num_heads:
            raise ValueError(
                f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads}) when head_dim is not given"
            )
        dropout = check_real(dropout, "dropout", "a probability in [0, 1)", lambda p: 0 <= p < 1)
        self.embed_dim, self.num_heads, self.combine, self.dropout = embed_dim, num_heads, combine, dropout
        if head_dim is None:
            head_dim = embed_dim // num_heads if combine == "concat" else embed_dim
        self.head_dim = check_int(head_dim, "head_dim", 1)
        self.kdim = embed_dim if kdim is None else check_int(kdim, "kdim", 1)
        self.vdim = embed_dim if vdim is None else check_int(vdim, "vdim", 1)
        width = num_heads * self.head_dim
        self.q_proj = torch.nn.Linear(embed_dim, width, bias=bias)
        self.k_proj = torch.nn.Linear(self.kdim, width, bias=bias)
        self.v_proj = torch.nn.Linear(self.vdim, width, bias=bias)
        if combine == "concat":
            self.out_proj = torch.nn.Linear(width, embed_dim, bias=bias)
        else:
            bound = 1 / math.sqrt(width)
            weight = torch.empty(num_heads, self.head_dim, embed_dim).uniform_(-bound, bound)
            self.head_weight = torch.nn.Parameter(weight)

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
            f"kdim={self.kdim}, vdim={self.vdim}, combine={self.combine!r}, dropout={self.dropout}"
        )

    def _heads(
        self,
        query: torch.Tensor,
        key: Optional[torch.Tensor],
        value: Optional[torch.Tensor],
        rows: str,
        query_name: str = "query",
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Project to ``[..., L, H, head_dim]`` queries and ``[..., S, H, head_dim]`` keys and values."""
        key = query if key is None else key
        value = key if value is None else value
        for name, x, dim in ((query_name, query, self.embed_dim), ("key", key, self.kdim), ("value", value, self.vdim)):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
            if x.dim() < 2 or (rows == "nodes" and x.dim() != 2) or x.shape[-1] != dim:
                raise ValueError(f"{name} must have shape [{rows}, {dim}], got {list(x.shape)}")
            check_dtype(x, name, self.q_proj.weight.dtype, "the module")
        if key.shape[:-1] != value.shape[:-1]:
            raise ValueError(
                f"key and value must have the same leading shape, got {list(key.shape)} and {list(value.shape)}"
            )
        split = (self.num_heads, self.head_dim)
        return (
            self.q_proj(query).unflatten(-1, split),
            self.k_proj(key).unflatten(-1, split),
            self.v_proj(value).unflatten(-1, split),
        )

    def _combine(self, heads: torch.Tensor) -> torch.Tensor:
        """``[..., L, H, head_dim]`` head outputs to ``[..., L, embed_dim]``."""
        if self.combine == "concat":
            return self.out_proj(heads.flatten(-2))
        return torch.einsum("...hj,hjl->...l", heads, self.head_weight)

    @property
    def _dropout_p(self) -> float:
        return self.dropout if self.training else 0.0


class MultiHeadAttention(_MultiHeadBase):
    r"""Multi-head scaled dot-product attention over all pairs (dense, transformer form).

    .. math::

        \mathrm{head}_h = \mathrm{softmax}\!\left(\frac{(Q W^Q_h)(K W^K_h)^\top}{\sqrt{d_h}} + \log M\right) V W^V_h

    combined by ``"concat"`` (:math:`\mathrm{Concat}(\mathrm{head}_1..\mathrm{head}_H) W^O`)
    or ``"gaan"`` (:math:`\sum_{j,h} \mathrm{head}_{h,ij}\, w_{jhl}`), see
    :mod:`e3attn.multihead`. :math:`M` is the optional boolean mask
    (:math:`\log 0 = -\infty`); a query with nothing to attend to gives the
    combination of zero heads (:math:`b^O` for ``"concat"``, 0 for ``"gaan"``).
    With ``combine="concat"`` and ``head_dim = embed_dim // num_heads`` this is
    ``torch.nn.MultiheadAttention(embed_dim, num_heads, batch_first=True)`` with
    the mask inverted (tested with copied weights).

    Args:
        embed_dim: feature size of the queries and of the output.
        num_heads: number of heads :math:`H`.
        head_dim: size :math:`d_h` of each head's queries, keys and values;
            default ``embed_dim // num_heads`` for ``"concat"`` and ``embed_dim``
            (square weights) for ``"gaan"``.
        kdim: feature size of the keys (default ``embed_dim``).
        vdim: feature size of the values (default ``embed_dim``).
        combine: ``"concat"`` or ``"gaan"``.
        dropout: dropout probability on the attention weights (training only).
        bias: whether the projections (and :math:`W^O`) have biases.

    Shapes:
        ``query`` ``[..., L, embed_dim]``, ``key`` ``[..., S, kdim]``, ``value``
        ``[..., S, vdim]``, ``mask`` broadcastable to ``[..., L, S]`` (same for all
        heads) to output ``[..., L, embed_dim]`` and, with ``return_weights``,
        weights ``[..., H, L, S]``.

    Example::

        >>> mha = MultiHeadAttention(8, 2)
        >>> x = torch.randn(5, 8)
        >>> mha(x).shape
        torch.Size([5, 8])
        >>> out, w = mha(x, mask=torch.ones(5, 5, dtype=torch.bool).tril(), return_weights=True)
        >>> w.shape
        torch.Size([2, 5, 5])
    """

    def forward(
        self,
        query: torch.Tensor,
        key: Optional[torch.Tensor] = None,
        value: Optional[torch.Tensor] = None,
        mask: Optional[torch.Tensor] = None,
        *,
        return_weights: bool = False,
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        r"""Attend from ``query`` to ``key`` (default ``query``) and ``value`` (default ``key``).

        Returns:
            ``out`` ``[..., L, embed_dim]``, or ``(out, weights)`` with weights ``[..., H, L, S]``.
        """
        q, k, v = (x.transpose(-3, -2) for x in self._heads(query, key, value, "..., L"))
        if isinstance(mask, torch.Tensor) and mask.dim() >= 2:
            mask = mask.unsqueeze(-3)
        out, weights = dense_attention(q, k, v, mask=mask, dropout_p=self._dropout_p)
        out = self._combine(out.transpose(-3, -2))
        return (out, weights) if return_weights else out


class GraphMultiHeadAttention(_MultiHeadBase):
    r"""Multi-head scaled dot-product attention along the edges of a graph (sparse form).

    .. math::

        \mathrm{head}_{h,i} = \sum_{e:\ \mathrm{dst}(e) = i} \alpha_{e h}\, W^V_h x_{\mathrm{src}(e)},
        \qquad \alpha_{e h} = \operatorname{softmax}_{e \to i}
        \frac{(W^Q_h x_i) \cdot (W^K_h x_{\mathrm{src}(e)})}{\sqrt{d_h}}

    with the heads combined as in :class:`MultiHeadAttention` (same arguments,
    same parameters: a state dict moves between the two). On the complete
    graph it equals :class:`MultiHeadAttention` (tested); on any graph it
    equals :class:`MultiHeadAttention` with the mask "edge :math:`j \to i` exists".

    Args:
        embed_dim: feature size of the nodes (queries) and of the output.
        num_heads: number of heads :math:`H`.
        head_dim: per-head size, defaults as in :class:`MultiHeadAttention`.
        kdim: feature size of ``key`` (default ``embed_dim``).
        vdim: feature size of ``value`` (default ``embed_dim``).
        combine: ``"concat"`` or ``"gaan"``.
        dropout: dropout probability on the edge weights :math:`\alpha` (training only).
        bias: whether the projections (and :math:`W^O`) have biases.

    Shapes:
        ``x`` ``[N, embed_dim]`` (the destination nodes), ``edge_index``
        ``[2, E]`` (row 0 source, row 1 destination), optional ``key``
        ``[M, kdim]`` and ``value`` ``[M, vdim]`` of the source nodes (default
        ``x``), to output ``[N, embed_dim]`` and, with ``return_weights``,
        :math:`\alpha` ``[E, H]``.

    Example::

        >>> gmha = GraphMultiHeadAttention(8, 2)
        >>> edge_index = torch.tensor([[0, 1, 2, 3], [1, 2, 3, 0]])
        >>> gmha(torch.randn(4, 8), edge_index).shape
        torch.Size([4, 8])
    """

    def forward(
        self,
        x: torch.Tensor,
        edge_index: torch.Tensor,
        key: Optional[torch.Tensor] = None,
        value: Optional[torch.Tensor] = None,
        *,
        return_weights: bool = False,
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        r"""Attend from every node of ``x`` to the sources of its incoming edges.

        Returns:
            ``out`` ``[N, embed_dim]``, or ``(out, alpha)`` with ``alpha`` ``[E, H]``.
        """
        q, k, v = self._heads(x, key, value, "nodes", "x")
        out, alpha = graph_attention(q, k, v, edge_index, dropout_p=self._dropout_p)
        out = self._combine(out)
        return (out, alpha) if return_weights else out

r"""Recording the attention weights of every attention layer of a model."""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, List, NamedTuple

import torch

__all__ = ["AttentionRecord", "record_attention"]


class AttentionRecord(NamedTuple):
    r"""Attention weights of one call of one attention layer.

    Attributes:
        name: qualified name of the layer in the model (``""`` for the model itself).
        edge_index: ``[2, E]`` edges ``(src, dst)`` the layer attended over.
        alpha: ``[E, H]`` detached attention weights, :math:`\sum_{e:\ \mathrm{dst}_e = i} \alpha_{eh} = 1`.

    Example::

        >>> record = AttentionRecord("layers.0", torch.tensor([[1], [0]]), torch.ones(1, 2))
        >>> record.name, record.alpha.shape
        ('layers.0', torch.Size([1, 2]))
    """

    name: str
    edge_index: torch.Tensor
    alpha: torch.Tensor


@contextlib.contextmanager
def record_attention(model: torch.nn.Module) -> Iterator[List[AttentionRecord]]:
    r"""Collect the attention of every :class:`~e3attn.attention.EquivariantAttention` in ``model``.

    While the context is open, each forward call of any attention layer inside
    ``model`` (found with ``model.named_modules()``) appends one
    :class:`AttentionRecord` ``(name, edge_index, alpha)`` to the yielded list, in call
    order; a layer called twice is recorded twice. The layers' hooks are removed on
    exit, also after an exception; the model's code and outputs are unchanged. The
    list feeds :func:`attention_rollout` and :func:`plot_rollout` directly:

    .. math:: R = A'_{L} \cdots A'_{1}, \quad A'_l \text{ from the } l\text{-th record.}

    Args:
        model: any module containing at least one ``EquivariantAttention``.

    Yields:
        the list of records, filled during the forward passes run inside the context.

    Example::

        >>> from e3attn.attention import EquivariantAttention
        >>> layer = EquivariantAttention("4x0e", "4x0e", "4x0e", "4x0e", max_radius=2.0, num_heads=2)
        >>> model = torch.nn.Sequential()  # any module tree holding attention layers
        >>> model.add_module("attention", layer)
        >>> with record_attention(model) as records:
        ...     out = layer(torch.randn(6, 4), torch.randn(6, 3))
        >>> [(r.name, r.alpha.shape[1]) for r in records]  # alpha: [E, num_heads]
        [('attention', 2)]
    """
    from e3attn.attention import EquivariantAttention

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    layers = [(name, module) for name, module in model.named_modules() if isinstance(module, EquivariantAttention)]
    if not layers:
        raise ValueError(f"model must contain at least one EquivariantAttention layer, found none in {type(model).__name__}")
    records: List[AttentionRecord] = []

    def hook_for(name: str) -> Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], None]:
        def hook(module: torch.nn.Module, edge_index: torch.Tensor, alpha: torch.Tensor) -> None:
            records.append(AttentionRecord(name, edge_index, alpha))

        return hook

    handles = [module.register_attention_hook(hook_for(name)) for name, module in layers]
    try:
        yield records
    finally:
        for handle in handles:
            handle.remove()

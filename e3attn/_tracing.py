"""A whole step traced into one graph: the value-free branches, as while ``torch.compile`` traces.

``make_fx`` (``torch.fx.experimental.proxy_tensor``) records every operation of a function, derivatives of any
order included (it runs autograd's engine on its proxies), into one graph that ``torch.compile`` can then compile
whole: a force-training step, loss and weight gradients, as one graph, where ``torch.compile`` of the model itself
stops at the second derivative. Code that reads tensor values (checks, a test whether the edges are sorted, the
number of graphs in a batch) cannot be traced; inside :func:`traced_step` e3attn takes the branches it takes while
``torch.compile`` traces instead (:func:`tracing`), and reads the number of graphs from the context
(:func:`traced_graphs`).
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, Optional

import torch

_GRAPHS = contextvars.ContextVar("e3attn_traced_graphs", default=None)


@contextlib.contextmanager
def traced_step(num_graphs: int) -> Iterator[None]:
    """Within this context e3attn can be traced (:func:`tracing` is true) on batches of ``num_graphs`` graphs."""
    if isinstance(num_graphs, bool) or not isinstance(num_graphs, int) or num_graphs < 1:
        raise ValueError(f"num_graphs must be a positive int, got {num_graphs!r}")
    token = _GRAPHS.set(num_graphs)
    try:
        yield
    finally:
        _GRAPHS.reset(token)


def tracing() -> bool:
    """Whether e3attn takes its value-free branches: while ``torch.compile`` traces, or inside
    :func:`traced_step`."""
    return torch.compiler.is_compiling() or _GRAPHS.get() is not None  # compiling first: dynamo cannot trace .get()


def traced_graphs() -> Optional[int]:
    """The number of graphs of the batch that :func:`traced_step` traces, or None outside it."""
    return None if torch.compiler.is_compiling() else _GRAPHS.get()

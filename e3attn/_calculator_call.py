r"""What one call of the calculator computes, eagerly or traced and compiled: energy, forces and stress in one tensor.

:func:`call_values` is the eager call of :class:`~e3attn.calculator.E3AttnCalculator`. :class:`CompiledCall` is
the same function traced with symbolic sizes into one graph (the forces' derivative included, which
``torch.compile`` of the model cannot hold while it needs autograd's engine) and compiled by ``torch.compile``:
the graph serves every call whose sizes meet the guards of its trace (:class:`~e3attn._tracing.TracedGraphs`),
so a molecular dynamics run compiles once, for its first call, and again only for the first call with the stress.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Dict, Iterator, List

import torch

from ._checks import values_checked_by_caller
from ._tracing import TracedGraphs, edges_sorted_by_caller, weights_as_inputs
from .kernels.segment_checks import arguments_checked_by_caller
from .models.energy import energy_and_forces, energy_forces_stress

__all__ = ["call_values", "CompiledCall", "frozen"]


@contextlib.contextmanager
def frozen(parameters: List[torch.nn.Parameter]) -> Iterator[None]:
    """``parameters`` without ``requires_grad`` within the context (forces need no gradients of the weights, which
    the kernels would otherwise compute), as they were after it."""
    flags = [p.requires_grad for p in parameters]
    try:
        for p in parameters:
            p.requires_grad_(False)
        yield
    finally:
        for p, flag in zip(parameters, flags):
            p.requires_grad_(flag)


def call_values(model: torch.nn.Module, pos: torch.Tensor, cell: torch.Tensor, node_attr: torch.Tensor,
                edge_index: torch.Tensor, shifts: torch.Tensor, with_stress: bool) -> torch.Tensor:
    """``[energy, forces (3 N), stress (9; zeros without)]`` of one structure in the model's units, detached.

    The edges, shifts and attributes are the caller's own (not checked again), the edges sorted by destination
    (as :func:`~e3attn.radius_graph_pbc` and the Verlet list give them: the layers do not sort them again); the
    model's weights should not require gradients (forces need none of them).
    """
    graph = dict(node_attr=node_attr, edge_index=edge_index, shifts=shifts, create_graph=False)
    with values_checked_by_caller(), edges_sorted_by_caller():
        if with_stress:
            energy, forces, stress = energy_forces_stress(model, pos, cell=cell, **graph)
        else:
            energy, forces = energy_and_forces(model, pos, cell=cell, **graph)
            stress = forces.new_zeros(1, 3, 3)
    return torch.cat([energy.detach()[:1], forces.detach().reshape(-1), stress.detach()[0].reshape(-1)])


class CompiledCall:
    """:func:`call_values` of ``model`` traced into graphs that take its weights as inputs (the values they have
    at each call), compiled by ``torch.compile(backend=backend, dynamic=True)``: one graph with the stress and one
    without, each reused across numbers of atoms and edges wherever the guards of its trace hold.

    Example::

        >>> from e3attn.models import EquivariantTransformer
        >>> model = EquivariantTransformer("1x0e", "4x0e + 2x1o", "0e", 2.0, irreps_node_attr="1x0e", reduce="sum")
        >>> call = CompiledCall(model, backend="eager")
        >>> pos, cell = torch.randn(4, 3), torch.zeros(3, 3)
        >>> edge_index = torch.tensor([[1, 0, 3, 2], [0, 1, 2, 3]])  # sorted by destination
        >>> values = call(pos, cell, torch.ones(4, 1), edge_index, torch.zeros(4, 3), with_stress=False)
        >>> torch.allclose(values, call_values(model, pos, cell, torch.ones(4, 1), edge_index, torch.zeros(4, 3),
        ...                                    with_stress=False), atol=1e-6)
        True
    """

    def __init__(self, model: torch.nn.Module, backend: str = "inductor") -> None:
        self.graphs: Dict[bool, TracedGraphs] = {}
        for with_stress in (False, True):
            weights, fn = weights_as_inputs(model, functools.partial(call_values, with_stress=with_stress))
            self.graphs[with_stress] = TracedGraphs(fn, num_graphs=lambda *args: 1, backend=backend)
        self.weights = weights  # the same for both

    def __call__(self, pos: torch.Tensor, cell: torch.Tensor, node_attr: torch.Tensor, edge_index: torch.Tensor,
                 shifts: torch.Tensor, with_stress: bool) -> torch.Tensor:
        with torch.no_grad(), arguments_checked_by_caller():  # the caller's own edges (call_values)
            return self.graphs[with_stress]([w.detach() for w in self.weights], pos, cell, node_attr, edge_index,
                                            shifts)

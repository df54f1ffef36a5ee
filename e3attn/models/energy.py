r"""Energies and forces of atomistic systems (open or periodic) from a model of the positions."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .._checks import check_batch, check_dtype, check_edge_index, check_pos

__all__ = ["edge_vectors", "energy_and_forces"]


def edge_vectors(
    pos: torch.Tensor,
    edge_index: torch.Tensor,
    shifts: Optional[torch.Tensor] = None,
    cell: Optional[torch.Tensor] = None,
    batch: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    r"""Edge vectors, differentiable in ``pos`` (and ``cell``), with the convention of :func:`~e3attn.radius_graph_pbc`.

    .. math:: \vec r_e = x_{\mathrm{src}_e} - x_{\mathrm{dst}_e} + S_e\, C_{b(\mathrm{dst}_e)}

    with integer image shifts :math:`S_e` (rows) and the lattice :math:`C` (rows = lattice
    vectors) of the graph :math:`b` of the destination node; without ``shifts`` the
    plain differences.

    Args:
        pos: ``[N, 3]`` positions.
        edge_index: ``[2, E]`` rows ``(src, dst)``.
        shifts: ``[E, 3]`` image shifts, or ``None``.
        cell: ``[3, 3]`` shared lattice or ``[B, 3, 3]`` one per graph; required with ``shifts``.
        batch: ``[N]`` graph index, required with a ``[B, 3, 3]`` cell.

    Returns:
        ``[E, 3]`` edge vectors in ``pos.dtype``.

    Example::

        >>> pos = torch.tensor([[0.0, 0.0, 0.0], [0.9, 0.0, 0.0]])
        >>> edge_vectors(pos, torch.tensor([[1], [0]]), torch.tensor([[-1.0, 0.0, 0.0]]), torch.eye(3))
        tensor([[-0.1000,  0.0000,  0.0000]])
    """
    check_pos(pos)
    check_edge_index(edge_index, pos.shape[0])
    src, dst = edge_index[0].long(), edge_index[1].long()
    vec = pos[src] - pos[dst]
    if shifts is None:
        if cell is not None:
            raise ValueError("cell was given without shifts: pass the shifts of radius_graph_pbc")
        return vec
    if not isinstance(shifts, torch.Tensor) or shifts.shape != (src.shape[0], 3):
        raise ValueError(f"shifts must be a tensor of shape [{src.shape[0]}, 3] (one per edge), got {_shape(shifts)}")
    if not isinstance(cell, torch.Tensor) or cell.shape[-2:] != (3, 3) or cell.dim() not in (2, 3):
        raise ValueError(f"cell must be a tensor of shape [3, 3] or [B, 3, 3] when shifts are given, got {_shape(cell)}")
    check_dtype(cell, "cell", pos.dtype, "pos")
    shifts = shifts.to(pos.dtype)
    if cell.dim() == 2:
        return vec + shifts @ cell
    if cell.shape[0] == 1:
        return vec + shifts @ cell[0]
    if batch is None:
        raise ValueError(f"batch is required with one cell per graph (cell of shape {list(cell.shape)})")
    check_batch(batch, pos.shape[0])
    return vec + torch.einsum("ei,eij->ej", shifts, cell[batch.long()[dst]])


def _shape(value) -> str:
    return str(list(value.shape)) if isinstance(value, torch.Tensor) else type(value).__name__


def energy_and_forces(
    model: torch.nn.Module,
    pos: torch.Tensor,
    x: Optional[torch.Tensor] = None,
    batch: Optional[torch.Tensor] = None,
    *,
    node_attr: Optional[torch.Tensor] = None,
    edge_index: Optional[torch.Tensor] = None,
    shifts: Optional[torch.Tensor] = None,
    cell: Optional[torch.Tensor] = None,
    create_graph: Optional[bool] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""Energy of every graph and the forces on every atom, :math:`F = -\partial E / \partial x`.

    .. math::

        E_b = \mathrm{model}(x)_b, \qquad F_i = -\frac{\partial}{\partial x_i} \sum_b E_b

    ``model`` (e.g. an :class:`~e3attn.models.EquivariantTransformer` with
    ``irreps_out="0e"`` and ``reduce="sum"``; a ``DistributedDataParallel`` wrapper works
    too) is called as ``model(pos, x, batch, edge_index, edge_vec, node_attr=node_attr)``
    and must return one scalar per graph. For periodic systems pass the ``edge_index``
    and ``shifts`` of :func:`~e3attn.radius_graph_pbc` and the ``cell``: the edge vectors
    are rebuilt from ``pos`` (:func:`edge_vectors`) so that the forces include every
    image. An invariant energy gives rotation-equivariant forces. Works under
    ``torch.no_grad()`` and ``torch.inference_mode()``: the gradient is taken inside,
    with autograd switched back on locally (inference tensors among the inputs are
    copied first, since autograd cannot record them); the returned tensors are
    ordinary tensors.

    Args:
        model: the energy model.
        pos: ``[N, 3]`` positions.
        x, batch, node_attr, edge_index: as for the model.
        shifts, cell: periodic images, see :func:`edge_vectors`.
        create_graph: keep the graph of the forces, to train on them; default ``model.training``.

    Returns:
        ``(energy [B], forces [N, 3])``.

    Example::

        >>> from e3attn.models import EquivariantTransformer
        >>> model = EquivariantTransformer("1x0e", "8x0e + 2x1o", "0e", 1.5, reduce="sum")
        >>> energy, forces = energy_and_forces(model, torch.randn(6, 3))
        >>> energy.shape, forces.shape
        (torch.Size([1]), torch.Size([6, 3]))
    """
    check_pos(pos)
    create_graph = model.training if create_graph is None else bool(create_graph)
    with torch.inference_mode(False), torch.enable_grad():
        pos, x, batch, node_attr, edge_index, shifts, cell = (
            t.clone() if isinstance(t, torch.Tensor) and t.is_inference() else t
            for t in (pos, x, batch, node_attr, edge_index, shifts, cell)
        )
        if not pos.requires_grad:
            pos = pos.detach().requires_grad_(True)
        edge_vec = None
        if shifts is not None:
            if edge_index is None:
                raise ValueError("shifts were given without edge_index: pass both from radius_graph_pbc")
            edge_vec = edge_vectors(pos, edge_index, shifts, cell, batch)
        elif cell is not None:
            raise ValueError("cell was given without shifts: pass the edge_index and shifts of radius_graph_pbc")
        out = model(pos, x, batch, edge_index, edge_vec, node_attr=node_attr)
        if out.dim() == 2 and out.shape[1] == 1:
            out = out[:, 0]
        num_graphs = 0 if pos.shape[0] == 0 else 1 if batch is None else int(batch.max()) + 1
        if out.shape != (num_graphs,):
            raise ValueError(
                f"model must return one scalar per graph ([{num_graphs}] or [{num_graphs}, 1]), got shape {list(out.shape)}"
            )
        (grad,) = torch.autograd.grad(out.sum(), pos, create_graph=create_graph, allow_unused=True)
        forces = torch.zeros_like(pos) if grad is None else -grad
    return out, forces

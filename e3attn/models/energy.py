r"""Energies, forces and stress of atomistic systems (open or periodic) from a model of the positions."""
from __future__ import annotations

import contextlib
from typing import Optional, Tuple

import torch

from .._checks import _skip_values, check_batch, check_dtype, check_edge_index, check_pos
from .._jet import first_derivatives_only
from .._tracing import traced_graphs
from ..scatter import gather_rows

__all__ = ["edge_vectors", "energy_and_forces", "energy_forces_stress"]


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
    vec = gather_rows(pos, src) - gather_rows(pos, dst)  # (not pos[src]: slower on the CPU, also backward)
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
    cells = gather_rows(cell.reshape(-1, 9), batch.long().index_select(0, dst)).view(-1, 3, 3)
    return vec + torch.einsum("ei,eij->ej", shifts, cells)


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
    energy, forces, _ = _energy_and_gradients(
        model, pos, x, batch, node_attr, edge_index, shifts, cell, create_graph, with_stress=False
    )
    return energy, forces


def energy_forces_stress(
    model: torch.nn.Module,
    pos: torch.Tensor,
    x: Optional[torch.Tensor] = None,
    batch: Optional[torch.Tensor] = None,
    *,
    cell: torch.Tensor,
    node_attr: Optional[torch.Tensor] = None,
    edge_index: Optional[torch.Tensor] = None,
    shifts: Optional[torch.Tensor] = None,
    create_graph: Optional[bool] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""Energy and forces as :func:`energy_and_forces`, and the stress of every graph.

    The stress is the derivative of the energy with respect to a homogeneous symmetric strain
    :math:`\varepsilon_b` of graph :math:`b`, which moves its atoms and its lattice together,
    divided by its volume:

    .. math::

        x_i \mapsto x_i (1 + \varepsilon_b), \quad C_b \mapsto C_b (1 + \varepsilon_b), \qquad
        \sigma_b = \frac{1}{|\det C_b|} \frac{\partial E_b}{\partial \varepsilon_b}\Big|_{\varepsilon = 0}

    (positions and lattice vectors as rows). This is ASE's convention (``atoms.get_stress()``,
    in energy per volume; negative under compression). One backward pass gives the forces and
    the stress together. Atoms, lattice vectors and periodic images all follow the strain, so
    the graph may be periodic along some directions only (pass the ``shifts`` of
    :func:`~e3attn.radius_graph_pbc`), or open (no ``shifts``: the cell then only gives the
    volume). In float16 and bfloat16 the volume and the division by it are computed in
    float32; the stress is returned in the dtype of ``pos``.

    Args:
        model, pos, x, batch, node_attr, edge_index, shifts, create_graph: as for :func:`energy_and_forces`.
        cell: ``[3, 3]`` shared lattice or ``[B, 3, 3]`` one per graph, of non-zero volume.

    Returns:
        ``(energy [B], forces [N, 3], stress [B, 3, 3])``, the stress symmetric.

    Raises:
        ValueError: when a cell has zero volume, or on malformed input.

    Example::

        >>> from e3attn.models import EquivariantTransformer
        >>> model = EquivariantTransformer("1x0e", "8x0e + 2x1o", "0e", 1.5, reduce="sum")
        >>> from e3attn.graph import radius_graph_pbc
        >>> pos, cell = 2 * torch.rand(5, 3), 2.0 * torch.eye(3)
        >>> edge_index, shifts = radius_graph_pbc(pos, cell, True, 1.5)
        >>> energy, forces, stress = energy_forces_stress(
        ...     model, pos, cell=cell, edge_index=edge_index, shifts=shifts
        ... )
        >>> stress.shape, bool(torch.allclose(stress, stress.transpose(1, 2)))
        (torch.Size([1, 3, 3]), True)
    """
    return _energy_and_gradients(model, pos, x, batch, node_attr, edge_index, shifts, cell, create_graph, with_stress=True)


def _num_graphs(pos: torch.Tensor, batch: Optional[torch.Tensor]) -> int:
    if pos.shape[0] == 0:
        return 0
    return 1 if batch is None else traced_graphs() or int(batch.max()) + 1  # traced: given, not read


def _strain_cells(cell, num_graphs: int, pos: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``cell`` as ``[B, 3, 3]`` in the dtype of ``pos``, and the volumes ``[B]`` (float32 at least), all non-zero."""
    if not isinstance(cell, torch.Tensor) or cell.shape[-2:] != (3, 3) or cell.dim() not in (2, 3):
        raise ValueError(f"cell must be a tensor of shape [3, 3] or [B, 3, 3] for the stress, got {_shape(cell)}")
    cell = cell.to(pos.dtype).reshape(-1, 3, 3)
    if cell.shape[0] == 1:
        cell = cell.expand(num_graphs, 3, 3)
    elif cell.shape[0] != num_graphs:
        raise ValueError(f"cell holds {cell.shape[0]} lattices but batch describes {num_graphs} graphs")
    # in float32 at least (a volume of over 65504 overflows float16); the triple product, elementwise operations only
    # (no factorisation: a CUDA graph can record it)
    wide = cell.to(torch.promote_types(cell.dtype, torch.float32))
    volume = (wide[:, 0] * torch.linalg.cross(wide[:, 1], wide[:, 2])).sum(-1).abs()
    if not _skip_values() and not bool((volume.detach() > 0).all()):  # (the calculator knows its cell's volume)
        raise ValueError("cell must have three linearly independent lattice vectors (a volume) for the stress")
    return cell, volume


def _energy_and_gradients(model, pos, x, batch, node_attr, edge_index, shifts, cell, create_graph, with_stress: bool):
    """``(energy [B], forces [N, 3], stress [B, 3, 3] or None)`` from one backward pass."""
    check_pos(pos)
    create_graph = model.training if create_graph is None else bool(create_graph)
    if shifts is not None and edge_index is None:
        raise ValueError("shifts were given without edge_index: pass both from radius_graph_pbc")
    if shifts is None and cell is not None and not with_stress:
        raise ValueError("cell was given without shifts: pass the edge_index and shifts of radius_graph_pbc")
    if batch is not None:
        check_batch(batch, pos.shape[0])
    num_graphs = _num_graphs(pos, batch)
    # autograd back on locally, also under torch.inference_mode(); inference tensors cannot be recorded: copies
    with torch.inference_mode(False), torch.enable_grad():
        pos, x, batch, node_attr, edge_index, shifts, cell = (
            t.clone() if isinstance(t, torch.Tensor) and t.is_inference() else t
            for t in (pos, x, batch, node_attr, edge_index, shifts, cell)
        )
        if not pos.requires_grad:
            pos = pos.detach().requires_grad_(True)
        inputs, strained = [pos], pos
        if with_stress:
            cell, volume = _strain_cells(cell, num_graphs, pos)
            if num_graphs == 0:
                return pos.new_zeros(0), torch.zeros_like(pos), cell.new_zeros(0, 3, 3)
            strain = pos.new_zeros(num_graphs, 3, 3, requires_grad=True)
            symmetric = 0.5 * (strain + strain.transpose(1, 2))
            graph = torch.zeros_like(pos[:, 0], dtype=torch.long) if batch is None else batch.long()
            strained = pos + torch.einsum("ni,nij->nj", pos, symmetric[graph])
            cell = cell + cell @ symmetric
            inputs.append(strain)
        edge_vec = None if shifts is None else edge_vectors(strained, edge_index, shifts, cell, batch)
        one = not create_graph and not torch.compiler.is_compiling()  # one derivative (forces): f'' not prepared
        with first_derivatives_only() if one else contextlib.nullcontext():
            out = model(strained, x, batch, edge_index, edge_vec, node_attr=node_attr)
        if out.dim() == 2 and out.shape[1] == 1:
            out = out[:, 0]
        if out.shape != (num_graphs,):
            raise ValueError(
                f"model must return one scalar per graph ([{num_graphs}] or [{num_graphs}, 1]), got shape {list(out.shape)}"
            )
        grads = torch.autograd.grad(out.sum(), inputs, create_graph=create_graph, allow_unused=True)
        forces = torch.zeros_like(pos) if grads[0] is None else -grads[0]
        if not with_stress:
            return out, forces, None
        stress = torch.zeros_like(cell) if grads[1] is None else (grads[1] / volume[:, None, None]).to(cell.dtype)
    return out, forces, stress

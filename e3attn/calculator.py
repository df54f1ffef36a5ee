r"""An ASE calculator: an e3attn energy model drives ASE's optimizers, molecular dynamics and tools.

:class:`E3AttnCalculator` wraps a model of one energy per structure (an
:class:`~e3attn.models.EquivariantTransformer` with ``irreps_out="0e"``, ``reduce="sum"`` and one-hot
elements as node attributes) in the units of ASE: energies in eV, forces in eV/Å, stress in eV/Å³.

.. rubric:: Checkpoint format

:meth:`E3AttnCalculator.from_checkpoint` reads a file written by
:func:`~e3attn.models.save_checkpoint` (the model's class, configuration, dtype and weights) whose extras hold

=====================  ======================================================================================
``species``            list of element symbols, in the order of the one-hot node attributes (required)
``energy_references``  list of floats, the reference energy of each element in eV (default: zeros)
``energy_scale``       float, the energy in eV of one unit of the model's output (default 1); the model
                       learns forces in units of ``energy_scale`` eV/Å, the same number, since forces are
                       the exact gradient of the energy
=====================  ======================================================================================

and anything else (metrics, say), which is ignored. ``examples/molecules.py --save`` writes it::

    save_checkpoint(model, "model.pt", species=["Cu", "Ni", "Au"], energy_references=[-0.02, -0.01, 0.03],
                    energy_scale=0.41)

This module needs ASE (``pip install ase``); importing it without ASE raises an :class:`ImportError` that says so.
"""
from __future__ import annotations

import functools
import math
import os
from numbers import Integral, Real
from typing import Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch

try:
    from ase.calculators.calculator import Calculator, PropertyNotImplementedError, all_changes
    from ase.data import atomic_numbers, chemical_symbols
except ImportError as error:  # pragma: no cover - exercised only without ASE
    raise ImportError("e3attn.calculator needs ASE: pip install ase (or pip install 'e3attn[examples]')") from error

from ._atoms_changes import changed_properties
from ._calculator_call import CompiledCall, call_values, frozen
from ._checks import check_device, check_real, spans_volume
from ._cuda_graph import ReplayedCall
from ._memory import keep_freed_memory
from ._verlet import VerletList
from .models.checkpoint import load_checkpoint

__all__ = ["E3AttnCalculator"]

PathLike = Union[str, "os.PathLike[str]"]

#: The default skin of the neighbour list, in Angstrom. Copper at 300 K moves about 0.003 Angstrom per femtosecond
#: and vibrates about 0.1 Angstrom about its sites, so in a solid or a liquid the list lasts tens to hundreds of 1 fs
#: steps; the search, at the cutoff plus the skin, finds ``((r_max + 0.5) / r_max)**3`` = 1.42 times the edges at
#: r_max = 4 Angstrom, but these are only candidates, filtered once per call: the model sees the edges within r_max.
DEFAULT_SKIN = 0.5

#: The calls of ``E3AttnCalculator(keep_memory=None)`` (the default) with at least this many edges make the process
#: keep freed memory (``e3attn._memory.keep_freed_memory``): about 2,800 atoms with 18 neighbours each, where the
#: per-edge tensors reach several MiB and their page faults start to count.
KEEP_MEMORY_EDGES = 50_000
STRESS = ("when_asked", "always")


def _atomic_numbers(species: Sequence[Union[str, int]]) -> np.ndarray:
    """The atomic numbers of ``species`` (element symbols or atomic numbers), all distinct and known."""
    if isinstance(species, (str, bytes)) or not isinstance(species, Sequence) or len(species) == 0:
        raise ValueError(f"species must be a non-empty sequence of element symbols, got {species!r}")
    numbers = []
    for s in species:
        if isinstance(s, str) and s in atomic_numbers and s != "X":
            numbers.append(atomic_numbers[s])
        elif isinstance(s, Integral) and not isinstance(s, bool) and 1 <= s < len(chemical_symbols):
            numbers.append(int(s))
        else:
            raise ValueError(f"species must hold element symbols such as 'Cu' (or atomic numbers), got {s!r}")
    if len(set(numbers)) != len(numbers):
        raise ValueError(f"species must not repeat an element, got {list(species)}")
    return np.array(numbers)


def _references(energy_references, symbols: Sequence[str]) -> np.ndarray:
    """Reference energies as a float64 array in the order of ``symbols``."""
    if energy_references is None:
        return np.zeros(len(symbols))
    if isinstance(energy_references, Mapping):
        if set(energy_references) != set(symbols):
            raise ValueError(
                f"energy_references must give one energy for each of the species {list(symbols)}, "
                f"got keys {sorted(energy_references)}"
            )
        energy_references = [energy_references[s] for s in symbols]
    refs = np.asarray(torch.as_tensor(energy_references, dtype=torch.float64).cpu())
    if refs.shape != (len(symbols),) or not np.isfinite(refs).all():
        raise ValueError(
            f"energy_references must be {len(symbols)} finite numbers (one per species), got {energy_references!r}"
        )
    return refs


class E3AttnCalculator(Calculator):
    r"""An ASE calculator of the energy, forces and stress of an e3attn model.

    With elements :math:`z_i` (their index in ``species`` as one-hot node attributes), the model's output
    :math:`\hat E` (one number per structure), the energy scale :math:`s` and the per-element reference
    energies :math:`e_z`:

    .. math::

        E = s\,\hat E(x, C) + \sum_i e_{z_i}, \qquad
        F_i = -\frac{\partial E}{\partial x_i}, \qquad
        \sigma = \frac{1}{|\det C|} \frac{\partial E}{\partial \varepsilon}\Big|_{\varepsilon = 0}

    where the symmetric strain :math:`\varepsilon` maps positions and lattice vectors (rows)
    :math:`x \mapsto x (1 + \varepsilon)`, :math:`C \mapsto C (1 + \varepsilon)`. ``free_energy`` equals
    ``energy``; ``stress`` is the 6-vector :math:`(\sigma_{xx}, \sigma_{yy}, \sigma_{zz}, \sigma_{yz},
    \sigma_{xz}, \sigma_{xy})` of ASE (eV/Å³), defined whenever the cell has three lattice vectors, like
    ASE's own EMT. Forces and stress come from one backward pass (:func:`~e3attn.models.energy_forces_stress`)
    over the graph of :func:`~e3attn.radius_graph_pbc` (periodic along the directions of ``atoms.pbc``:
    open, periodic and mixed boundaries). The properties are computed at once and cached by ASE: asking again
    for unchanged atoms computes nothing. With ``stress="when_asked"`` (the default) the stress is computed from
    the first call that asks for it on (its strain derivative costs about a fifth of a small system's call, and
    molecular dynamics at constant volume never asks for it): asking for the stress of atoms whose energy and
    forces were computed without it computes all three again, once, and every later call computes them together.
    Until then the stress is not in ``results``, so trajectory and extended XYZ files written from the cache do
    not hold it; ``stress="always"`` computes it with every call, as before this option existed.

    The graph comes from a Verlet neighbour list (``neighbour_list``): the search runs at
    :math:`r_\mathrm{max} + \delta` with the ``skin`` :math:`\delta`, and until some atom has moved more than
    :math:`\delta / 2` since (periodic wrapping taken into account), or the cell, the periodic directions or
    the number of atoms change, each call only keeps the candidates closer than :math:`r_\mathrm{max}`
    (``skin=0``: a new search for every configuration; with ``cuda_graphs``, the default on CUDA, the recorded
    calls take every candidate). Results equal those of a new search to rounding:
    the model gets the same edges in the same order, except pairs within rounding of :math:`r_\mathrm{max}`,
    where the cutoff and the radial basis vanish so that such edges add exactly nothing. The edge vectors
    are computed from the current positions on every call.

    The model is called as ``model(pos, None, None, edge_index, edge_vec, node_attr=one_hot)`` and must
    have a ``max_radius`` attribute (the cutoff); it is moved to ``device`` and cast to ``dtype`` in place
    (like ``model.to``) and put in evaluation mode. During a call its parameters do not require gradients
    (forces need none of the weights), and afterwards they do as before; the values of the inputs that the
    calculator makes itself (edges, attributes) are not checked again on every call.

    Args:
        model: the energy model, e.g. an :class:`~e3attn.models.EquivariantTransformer` with
            ``irreps_out="0e"``, ``reduce="sum"`` and ``irreps_node_attr=f"{len(species)}x0e"``.
        species: the elements the model knows, as symbols (``["Cu", "Ni"]``) or atomic numbers, in
            the order of the one-hot node attributes.
        energy_references: the reference energy of each element in eV, a sequence in the order of
            ``species`` or a mapping from symbol to energy; default zeros.
        energy_scale: eV per unit of the model's output, a positive number.
        device: where to run the model (default: where its parameters are).
        dtype: the dtype to run the model in, ``torch.float16``, ``bfloat16``, ``float32`` or ``float64``
            (default: that of its parameters); results are float64.
        skin: the skin :math:`\delta` of the neighbour list in Å, a non-negative number (default
            0.5, ``DEFAULT_SKIN``: a 300 K metal's atoms need tens of 1 fs steps or more to move
            :math:`\delta / 2`); 0 searches anew for every configuration.
        cuda_graphs: on a CUDA device, record the call as a CUDA graph after each search of the neighbour list
            and replay it until the next (``e3attn._cuda_graph.ReplayedCall``): one launch per MD step instead
            of hundreds, on the layer's Triton kernels (:func:`e3attn.kernels.recording_graph`). The model then
            sees every candidate edge of the list, up to ``r_max + skin`` (the edges beyond ``r_max`` contribute
            exactly zero: the cutoff vanishes there), so that the edges keep their number between searches.
            Results equal the eager call's to rounding. ``None`` (the default): on for a CUDA device with
            ``skin > 0`` and without ``compile``, and once a recording goes unused (a cell that changes at every
            step, as under a barostat) only the second call after a search is recorded, so that such steps cost
            no recordings; ``True``: each search records; ``False``: eager calls. Ignored on other devices and
            with ``skin=0``. A call that cannot be recorded warns once and stays eager. A search records anew (as
            does the first call that asks for the stress).
        stress: ``"when_asked"`` (the default: the stress from the first call that asks for it on, see above) or
            ``"always"`` (with every call that has a cell of three lattice vectors).
        keep_memory: on the CPU, make the process keep the memory that a call frees for the next call
            (``e3attn._memory.keep_freed_memory``: glibc's ``malloc`` never maps a block on its own nor trims its
            heap) instead of giving it back to the system and faulting it in again, page by page, at the next
            call. ``None`` (the default): from the first call with at least ``KEEP_MEMORY_EDGES`` edges on (large
            systems, where the faults cost up to half a call; smaller ones gain nothing measurable); ``True``: from
            the first call on; ``False``: never. The setting is process-wide and lasts until the process ends (forked
            children inherit it; a later calculator with ``False`` does not undo it), and it keeps the memory of
            the allocations of the process's main thread only. The process then holds its largest memory use
            until it ends, as PyTorch's caching allocator does on GPUs (``ctypes.CDLL(None).malloc_trim(0)``
            gives the free memory back). Nothing changes on other devices or where the C library is not glibc
            (macOS, Windows).
        compile: ``True`` to trace the call (the energy and the forces' derivative, the stress's where computed)
            into one graph with symbolic sizes and compile it with ``torch.compile``'s inductor
            (``e3attn._calculator_call.CompiledCall``), or a ``torch.compile`` backend's name; default False.
            The first call compiles (a minute or more on a CPU), as does the first with the stress; later calls
            reuse the graph across numbers of atoms and edges (a new compile only where a size breaks an
            assumption of the trace, e.g. a structure without edges). The graph takes the model's weights as
            inputs, so it stays right when they change. Not with ``cuda_graphs``.

    Attributes:
        neighbour_list: the Verlet list (``e3attn._verlet.VerletList``); its ``builds`` counts the searches.

    Raises:
        ValueError: on malformed arguments (``device`` not a device present on this machine, too), and when
            computing atoms with elements not in ``species`` or atomic numbers that are no elements.

    Example::

        >>> from ase.build import bulk
        >>> from e3attn.models import EquivariantTransformer
        >>> model = EquivariantTransformer("1x0e", "8x0e + 4x1o", "0e", 3.0, irreps_node_attr="2x0e", reduce="sum")
        >>> atoms = bulk("Cu", "fcc", a=3.6, cubic=True)
        >>> atoms.calc = E3AttnCalculator(model, ["Cu", "Ni"], energy_references={"Cu": -3.5, "Ni": -4.4})
        >>> atoms.get_forces().shape, atoms.get_stress().shape
        ((4, 3), (6,))
    """

    implemented_properties = ["energy", "free_energy", "forces", "stress"]

    def __init__(
        self,
        model: torch.nn.Module,
        species: Sequence[Union[str, int]],
        *,
        energy_references: Optional[Union[Sequence[float], Mapping[str, float]]] = None,
        energy_scale: float = 1.0,
        device: Optional[Union[str, torch.device]] = None,
        dtype: Optional[torch.dtype] = None,
        skin: float = DEFAULT_SKIN,
        cuda_graphs: Optional[bool] = None,
        stress: str = "when_asked",
        keep_memory: Optional[bool] = None,
        compile: Union[bool, str] = False,
    ) -> None:
        super().__init__()
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        max_radius = getattr(model, "max_radius", None)
        if isinstance(max_radius, bool) or not isinstance(max_radius, Real) or not 0 < max_radius < math.inf:
            raise ValueError(f"model must have a positive max_radius attribute (its cutoff), got {max_radius!r}")
        numbers = _atomic_numbers(species)
        attributes = getattr(model, "irreps_node_attr", None)
        if attributes is not None and attributes.dim != len(numbers):
            raise ValueError(
                f"the model takes {attributes.dim} node attributes but species names {len(numbers)} elements"
            )
        if isinstance(energy_scale, bool) or not isinstance(energy_scale, Real) or not 0 < energy_scale < math.inf:
            raise ValueError(f"energy_scale must be a positive finite number, got {energy_scale!r}")
        supported = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # not float8: no arithmetic
        if dtype is not None and dtype not in supported:
            raise ValueError(f"dtype must be one of {', '.join(map(str, supported))}, got {dtype!r}")
        parameter = next(model.parameters(), None)
        self.device = check_device(device, "device") or (
            parameter.device if parameter is not None else torch.device("cpu"))
        self.dtype = dtype or (parameter.dtype if parameter is not None else torch.get_default_dtype())
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        self._parameters_list = list(self.model.parameters())
        self.max_radius = float(max_radius)
        self.species = [chemical_symbols[z] for z in numbers]
        self.energy_references = _references(energy_references, self.species)
        self.energy_scale = float(energy_scale)
        self._index = np.full(len(chemical_symbols), -1)
        self._index[numbers] = np.arange(len(numbers))
        skin = check_real(skin, "skin", "a non-negative finite number (in Angstrom)", lambda x: 0 <= x < math.inf)
        if cuda_graphs is not None and not isinstance(cuda_graphs, bool):
            raise ValueError(f"cuda_graphs must be None or a bool, got {cuda_graphs!r}")
        if stress not in STRESS:
            raise ValueError(f"stress must be one of {', '.join(map(repr, STRESS))}, got {stress!r}")
        if keep_memory is not None and not isinstance(keep_memory, bool):
            raise ValueError(f"keep_memory must be None, True or False, got {keep_memory!r}")
        if not isinstance(compile, (bool, str)) or (compile and cuda_graphs):
            raise ValueError(f"compile must be a bool or a torch.compile backend's name, and not with cuda_graphs, "
                             f"got compile={compile!r}, cuda_graphs={cuda_graphs!r}")
        backend = "inductor" if compile is True else compile
        try:
            self._compiled = CompiledCall(self.model, backend) if backend else None
        except ValueError as error:  # an unknown backend
            raise ValueError(f"compile: {error}") from None
        # whether a call makes the allocator keep freed memory: of how many edges at least (None: none does)
        self._keep_from: Optional[int] = None if keep_memory is False or self.device.type != "cpu" else (
            0 if keep_memory else KEEP_MEMORY_EDGES)
        replay = (not backend if cuda_graphs is None else cuda_graphs) and self.device.type == "cuda" and skin > 0
        self._replayed = ReplayedCall(adaptive=cuda_graphs is None) if replay else None
        self.neighbour_list = VerletList(self.max_radius, skin, prune=not replay)
        self._elements: tuple = (None, None)  # the atomic numbers of the last call, and their one-hot tensor
        self._stress = stress == "always"  # whether calls compute the stress (when_asked: from the first that asks)

    @classmethod
    def from_checkpoint(
        cls,
        path: PathLike,
        *,
        device: Optional[Union[str, torch.device]] = None,
        dtype: Optional[torch.dtype] = None,
        skin: float = DEFAULT_SKIN,
        cuda_graphs: Optional[bool] = None,
        stress: str = "when_asked",
        keep_memory: Optional[bool] = None,
        compile: Union[bool, str] = False,
    ) -> "E3AttnCalculator":
        r"""The calculator of a checkpoint in the format above (model, ``species``, ``energy_references``,
        ``energy_scale``), its model on ``device`` (default CPU) in ``dtype`` (default: as saved), with the
        options ``skin``, ``cuda_graphs``, ``stress``, ``keep_memory`` and ``compile`` (see the class).

        .. math:: \text{calculator} = \mathrm{E3AttnCalculator}(\text{model}, \text{extra}[\texttt{species}], \dots)

        Raises:
            ValueError: when the checkpoint has no ``species``, its extras do not fit its model, or an option is
                malformed (naming the file), or it is not a checkpoint (:func:`~e3attn.models.load_checkpoint`).

        Example::

            >>> import os, tempfile
            >>> from e3attn.models import EquivariantTransformer, save_checkpoint
            >>> model = EquivariantTransformer("1x0e", "8x0e + 4x1o", "0e", 3.0, irreps_node_attr="1x0e", reduce="sum")
            >>> path = os.path.join(tempfile.mkdtemp(), "model.pt")
            >>> save_checkpoint(model, path, species=["Cu"], energy_references=[-3.5], energy_scale=0.4)
            >>> calc = E3AttnCalculator.from_checkpoint(path, dtype=torch.float64)
            >>> calc.species, calc.energy_scale, calc.dtype
            (['Cu'], 0.4, torch.float64)
        """
        device = check_device(device, "device")
        model, extra = load_checkpoint(path, map_location=device or "cpu")
        where = f"checkpoint {os.fspath(path)!r}" if isinstance(path, (str, os.PathLike)) else "the checkpoint"
        if "species" not in extra:
            raise ValueError(
                f"{where} holds no 'species': save it with save_checkpoint(model, path, "
                f"species=[...], energy_references=[...], energy_scale=...) (see e3attn.calculator)"
            )
        scale = extra.get("energy_scale", 1.0)
        if isinstance(scale, torch.Tensor) and scale.numel() == 1 and not scale.dtype.is_complex:
            scale = scale.item()  # save_checkpoint stores a 0-d tensor as given
        try:
            return cls(
                model, extra["species"], energy_references=extra.get("energy_references"), energy_scale=scale,
                device=device, dtype=dtype, skin=skin, cuda_graphs=cuda_graphs, stress=stress, keep_memory=keep_memory,
                compile=compile,
            )
        except ValueError as error:  # the extras do not fit the model (or an option is wrong): say which file
            raise ValueError(f"{where}: {error}") from None

    def check_state(self, atoms, tol: float = 1e-15) -> list:
        """The properties of ``atoms`` changed since the last calculation (ASE's), compared exactly
        (``e3attn._atoms_changes``): never a stale result, and cheaper than ASE's comparison within ``tol``, which
        every ``get_forces`` of an MD step pays."""
        if self.atoms is None or tol != 1e-15:
            return super().check_state(atoms, tol)
        return changed_properties(self.atoms, atoms, [p for p in all_changes if p not in self.ignored_changes])

    def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes) -> None:
        """Compute the properties of ``atoms`` into ``self.results`` (ASE calls this as needed): energy and forces,
        and the stress where the cell has a volume and the ``stress`` option asks for it."""
        super().calculate(atoms, properties, system_changes)
        atoms = self.atoms
        node_attr, energy = self._elements_of(atoms.numbers)
        has_volume = spans_volume(atoms.cell.array)
        if "stress" in properties and not has_volume:
            raise PropertyNotImplementedError("stress needs a cell of three linearly independent lattice vectors "
                                              "(a volume)")
        self._stress = self._stress or "stress" in properties
        with_stress = has_volume and self._stress
        as_tensor = dict(dtype=self.dtype, device=self.device)
        positions, lattice = atoms.positions, atoms.cell.array
        pos, cell = torch.as_tensor(positions, **as_tensor), torch.as_tensor(lattice, **as_tensor)
        forces, stress = np.zeros((len(atoms), 3)), np.zeros((3, 3))
        if len(atoms) > 0:
            edge_index, shifts = self.neighbour_list(positions, lattice, atoms.pbc, pos, cell)
            if self._keep_from is not None and edge_index.shape[1] >= self._keep_from:
                keep_freed_memory()
                self._keep_from = None
            values = self._values(pos, cell, node_attr, edge_index, shifts, with_stress)
            values = self.energy_scale * values.double().cpu().numpy()
            energy += float(values[0])
            forces, stress = values[1:-9].reshape(-1, 3), values[-9:].reshape(3, 3)
        self.results = {"energy": energy, "free_energy": energy, "forces": forces}
        if with_stress:
            self.results["stress"] = stress.flat[[0, 4, 8, 5, 2, 1]]

    def _values(self, pos: torch.Tensor, cell: torch.Tensor, node_attr: torch.Tensor, edge_index: torch.Tensor,
                shifts: torch.Tensor, with_stress: bool) -> torch.Tensor:
        """``[energy, forces..., stress (9)]`` in the model's units, as one tensor (one copy from the device),
        replayed from a CUDA graph while the edges stay the same (``cuda_graphs``) or from a compiled graph
        (``compile``)."""

        if self._compiled is not None:
            return self._compiled(pos, cell, node_attr, edge_index, shifts, with_stress)
        with frozen(self._parameters_list):  # no gradients of the weights
            if self._replayed is None:
                return call_values(self.model, pos, cell, node_attr, edge_index, shifts, with_stress)
            within = functools.partial(self.neighbour_list.within_cutoff, edge_index, shifts, pos, cell)
            return self._replayed(functools.partial(call_values, self.model, node_attr=node_attr,
                                                    edge_index=edge_index, shifts=shifts, with_stress=with_stress),
                                  (pos, cell), key=(edge_index, shifts, node_attr, with_stress),
                                  eager=lambda: call_values(self.model, pos, cell, node_attr, *within(), with_stress))

    def _elements_of(self, numbers: np.ndarray) -> Tuple[torch.Tensor, float]:
        """The one-hot node attributes of atoms with atomic ``numbers`` and the sum of their reference energies,
        kept while the atoms' elements stay the same."""
        cached, result = self._elements
        if cached is None or not np.array_equal(cached, numbers):
            if len(numbers) and (numbers.min() < 0 or numbers.max() >= len(chemical_symbols)):
                bad = sorted({int(z) for z in numbers if not 0 <= z < len(chemical_symbols)})
                raise ValueError(f"atoms hold atomic numbers {bad} that are no elements (0 to "
                                 f"{len(chemical_symbols) - 1}); the model knows {self.species}")
            index = self._index[numbers]
            if (index < 0).any():
                unknown = sorted({chemical_symbols[z] for z in numbers[index < 0]})
                raise ValueError(f"atoms hold elements {unknown} that the model does not know; it knows {self.species}")
            one_hot = torch.nn.functional.one_hot(torch.as_tensor(index, device=self.device), len(self.species))
            result = (one_hot.to(self.dtype), float(self.energy_references[index].sum()))
            self._elements = (numbers.copy(), result)
        return result

r"""A Verlet neighbour list: the periodic radius graph of a moving system, searched with a skin and reused.

Used by :class:`~e3attn.calculator.E3AttnCalculator`; NumPy and PyTorch only (no ASE).
"""
from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
import torch

from .graph import radius_graph_pbc

__all__ = ["VerletList"]


class VerletList:
    r"""The edges closer than ``r_max`` of a moving (periodic) system, from candidates searched once per rebuild.

    At a build, :func:`~e3attn.radius_graph_pbc` lists every pair :math:`(s, d, S)` with
    :math:`\|x_s - x_d + S C\| < r_\mathrm{max} + \delta` (:math:`\delta` = ``skin``) and the
    positions :math:`x^0` are kept. While every atom stays within :math:`\delta / 2` of its
    position at the build,

    .. math:: \max_i \|x_i - x^0_i\| \le \delta / 2,

    a pair closer than :math:`r_\mathrm{max}` now was closer than :math:`r_\mathrm{max} + \delta`
    then, so it is a candidate: each call keeps the candidates closer than :math:`r_\mathrm{max}`
    (one vectorised test, in the order of the build: sorted by destination, then source, then
    shift) instead of searching again. The list is rebuilt when an atom has moved further, and when
    the number of atoms, the cell, the periodic directions, the dtype or the device change.

    Displacements are measured across periodic wrapping: an atom moved back into the cell by a
    lattice vector (:math:`x_i \mapsto x_i - n_i C`, integer :math:`n_i` along periodic directions,
    as ``atoms.wrap()`` does) has moved by the rest of its displacement only, and the shifts of its
    candidates become :math:`S - n_s + n_d`, which keeps every edge vector
    :math:`x_s - x_d + S C` unchanged. The jump :math:`n_i` is the rounded fractional displacement,
    exact while atoms move less than half a cell between calls.

    With ``skin=0`` every call with moved atoms searches anew (no candidates to filter). With ``prune=False``
    the calls return the candidates themselves, edges up to :math:`r_\mathrm{max} + \delta` long, the same
    tensors until the next search (wrapped atoms update the shifts in place): for a model whose edges beyond
    :math:`r_\mathrm{max}` contribute zero, a graph of fixed size between searches, with no filter (and no
    read of its size on the host) per call.

    Args:
        r_max: the cutoff, a positive number.
        skin: the skin :math:`\delta \ge 0`, in the units of the positions.
        prune: whether each call keeps only the candidates closer than ``r_max`` (the default).

    Example::

        >>> verlet = VerletList(1.5, skin=0.5)
        >>> cell, pbc = 4.0 * np.eye(3), np.array([True, True, True])
        >>> def edges(positions):
        ...     edge_index, shifts = verlet(positions, cell, pbc, torch.as_tensor(positions), torch.as_tensor(cell))
        ...     return edge_index.tolist(), verlet.builds
        >>> edges(np.array([[0.0, 0, 0], [1.0, 0, 0]]))
        ([[1, 0], [0, 1]], 1)
        >>> edges(np.array([[0.0, 0, 0], [1.6, 0, 0]]))  # moved by 0.6 > skin / 2: searched again
        ([[], []], 2)
        >>> edges(np.array([[0.0, 0, 0], [1.4, 0, 0]]))  # moved by 0.2: the candidates of the last search
        ([[1, 0], [0, 1]], 2)
    """

    def __init__(self, r_max: float, skin: float, prune: bool = True) -> None:
        self.r_max, self.skin, self.prune = float(r_max), float(skin), bool(prune)
        self.builds = 0  #: the number of searches so far
        self._key: Optional[tuple] = None
        self._reference = np.zeros((0, 3))  # positions at the build, moved along with wrapped atoms
        self._recip = np.zeros((3, 3))  # columns: the reciprocal vectors of the periodic directions, else 0
        self._candidates: Tuple[torch.Tensor, torch.Tensor] = (torch.zeros(2, 0, dtype=torch.long), torch.zeros(0, 3))

    def __call__(
        self, positions: np.ndarray, cell: np.ndarray, pbc: np.ndarray, pos: torch.Tensor, lattice: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(edge_index [2, E], shifts [E, 3])`` as :func:`~e3attn.radius_graph_pbc` gives them for ``r_max``
        (up to pairs at :math:`r_\\mathrm{max}` within rounding), in the dtype and on the device of ``pos``; with
        ``prune=False`` every candidate, up to :math:`r_\\mathrm{max} + \\delta`.

        Args:
            positions: ``[N, 3]`` float64 positions, ``cell`` ``[3, 3]`` (rows: lattice vectors) and ``pbc``
                ``[3]`` booleans (NumPy arrays, as ASE holds them).
            pos, lattice: ``positions`` and ``cell`` as the tensors that the model takes.
        """
        key = (positions.shape[0], cell.tobytes(), pbc.tobytes(), pos.dtype, pos.device)
        if key != self._key or not self._follow(positions, cell, pbc):
            self._build(positions, cell, pbc, pos, lattice)
            self._key = key
        edge_index, shifts = self._candidates
        if self.skin == 0 or not self.prune:
            return edge_index, shifts
        return self.within_cutoff(edge_index, shifts, pos, lattice)

    def within_cutoff(self, edge_index: torch.Tensor, shifts: torch.Tensor, pos: torch.Tensor,
                      lattice: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The edges of ``(edge_index, shifts)`` shorter than ``r_max`` (what a call with ``prune`` returns)."""
        # index_select, not advanced indexing (several times slower on the CPU for ~10^5 candidates)
        vec = pos.index_select(0, edge_index[0]) - pos.index_select(0, edge_index[1]) + shifts @ lattice
        keep = ((vec * vec).sum(1) < self.r_max**2).nonzero()[:, 0]
        return edge_index.index_select(1, keep), shifts.index_select(0, keep)

    def _follow(self, positions: np.ndarray, cell: np.ndarray, pbc: np.ndarray) -> bool:
        """Whether the candidates still hold every edge: takes wrapped atoms' jumps into the candidates' shifts."""
        moved = positions - self._reference
        if pbc.any():
            jumps = np.rint(moved @ self._recip)
            if not np.isfinite(jumps).all():
                return False  # the search names the bad positions
            if jumps.any():
                moved -= jumps @ cell
                self._reference = self._reference + jumps @ cell
                edge_index, shifts = self._candidates
                jumps = torch.as_tensor(jumps, dtype=shifts.dtype, device=shifts.device)
                change = jumps[edge_index[0]] - jumps[edge_index[1]]
                if self.prune:  # a new tensor: with skin=0 the last call returned the candidates themselves
                    self._candidates = (edge_index, shifts - change)
                else:  # in place: the same tensor until the next search (a recorded CUDA graph reads it)
                    shifts.sub_(change)
        largest = float(np.einsum("ij,ij->i", moved, moved).max(initial=0.0))
        return largest <= (0.5 * self.skin) ** 2  # False for NaN too

    def _build(self, positions: np.ndarray, cell: np.ndarray, pbc: np.ndarray, pos: torch.Tensor,
               lattice: torch.Tensor) -> None:
        try:
            self._candidates = radius_graph_pbc(pos, lattice, torch.as_tensor(pbc), self.r_max + self.skin)
        except ValueError as error:
            if self.skin == 0 or "r_max=" not in str(error):
                raise
            raise ValueError(f"{error} (r_max here is the cutoff {self.r_max:g} plus the Verlet list's skin "
                             f"{self.skin:g}; skin=0 searches to the cutoff alone)") from None
        self._reference = np.array(positions, dtype=np.float64)
        lattice = cell * pbc[:, None]
        self._recip = np.linalg.pinv(lattice) * pbc[None, :]
        self.builds += 1

r"""Structures from files ASE reads, as tensors with their graphs; batches; per-element reference energies.

Labels are looked up by key: first in ``atoms.info`` (energy, stress) or ``atoms.arrays`` (forces), as extended
XYZ files store ``REF_energy`` and ``REF_forces``, then among the results of the structure's calculator (ASE
reads the keys ``energy``, ``forces`` and ``stress`` of an extended XYZ file into one). Energies are in eV,
forces in eV/Å, stress in eV/Å³ (ASE's units); stress may be stored as 6 Voigt components or as 3 x 3.
"""
from __future__ import annotations

import os
from typing import List, NamedTuple, Optional, Sequence

import numpy as np
import torch

from .._checks import spans_volume
from ..graph import radius_graph_pbc

__all__ = ["DataError", "LabelKeys", "read_structures", "to_sample", "collate", "fit_references"]


class DataError(ValueError):
    """Input data that cannot be trained on; the message says which file, structure and key."""


class LabelKeys(NamedTuple):
    """Where the labels are: the keys of the energy, the forces and the stress (``None``: no stress)."""

    energy: str = "energy"
    forces: str = "forces"
    stress: Optional[str] = None


def _result(atoms, key: str):
    results = getattr(atoms.calc, "results", None) or {}
    return results.get(key)


def _stress(value) -> np.ndarray:
    from ase.stress import voigt_6_to_full_3x3_stress

    value = np.asarray(value, dtype=np.float64)
    if value.shape == (6,):
        return voigt_6_to_full_3x3_stress(value)
    if value.size == 9:
        return value.reshape(3, 3)
    raise ValueError(f"a stress of shape {list(value.shape)} (expected 6 Voigt components or 3 x 3)")


def _no_atoms(atoms, where: str) -> None:
    if len(atoms) == 0:
        raise DataError(f"{where} has no atoms: remove it from the file")


def read_structures(path: str, what: str = "--train-file"):
    """The structures of ``path`` (any format ASE reads), or a :class:`DataError` naming ``what``.

    Example::

        >>> import os, tempfile
        >>> from ase.build import molecule
        >>> from ase.io import write
        >>> path = os.path.join(tempfile.mkdtemp(), "water.xyz")
        >>> write(path, [molecule("H2O")] * 2)
        >>> len(read_structures(path))
        2
    """
    from ase.io import read

    if not os.path.isfile(path):
        raise DataError(f"{what}: {path!r} is a folder" if os.path.isdir(path) else f"{what}: no such file {path!r}")
    if os.path.getsize(path) == 0:
        raise DataError(f"{what}: {path!r} holds no structures")
    try:
        structures = read(path, index=":")
    except Exception as err:  # ASE raises many types for a file it cannot parse
        raise DataError(f"{what}: ASE cannot read {path!r}: {type(err).__name__}: {err}".replace("\n", " ")) from None
    if len(structures) == 0:
        raise DataError(f"{what}: {path!r} holds no structures")
    return structures


def _labels(atoms, keys: LabelKeys, where: str) -> dict:
    """Energy, forces (and stress) of ``atoms`` under ``keys``, or a DataError saying which key is missing."""
    energy = atoms.info.get(keys.energy, _result(atoms, keys.energy))
    if energy is None:
        found = sorted(atoms.info) + sorted((getattr(atoms.calc, "results", None) or {}))
        raise DataError(f"{where} has no energy under the key {keys.energy!r} (--energy-key); it has {found}")
    forces = atoms.arrays.get(keys.forces, _result(atoms, keys.forces))
    if forces is None:
        found = sorted(k for k in atoms.arrays if k not in ("numbers", "positions"))
        found += sorted(getattr(atoms.calc, "results", None) or {})
        raise DataError(f"{where} has no forces under the key {keys.forces!r} (--forces-key): training needs "
                        f"forces; it has {found}")
    try:
        energy = float(np.asarray(energy, dtype=np.float64).reshape(()))
    except (TypeError, ValueError):
        raise DataError(f"{where}: the energy {keys.energy!r} is {energy!r}, not one number") from None
    try:
        forces = np.asarray(forces, dtype=np.float64)
    except (TypeError, ValueError):
        raise DataError(f"{where}: the forces {keys.forces!r} are not numbers") from None
    if forces.shape != (len(atoms), 3):
        raise DataError(f"{where}: the forces {keys.forces!r} have shape {list(forces.shape)}, expected "
                        f"[{len(atoms)}, 3]")
    labels = {"energy": energy, "forces": forces}
    if keys.stress is not None:
        stress = atoms.info.get(keys.stress, _result(atoms, keys.stress))
        if stress is None:
            raise DataError(f"{where} has no stress under the key {keys.stress!r} (--stress-key)")
        try:
            labels["stress"] = _stress(stress)
        except (TypeError, ValueError) as err:
            raise DataError(f"{where}: the stress {keys.stress!r} is {err}") from None
        if not spans_volume(atoms.cell.array):
            raise DataError(f"{where} has a stress but no cell of three linearly independent lattice vectors (no "
                            "volume)")
    for name, value in labels.items():
        if not np.isfinite(value).all():
            key = getattr(keys, name)
            raise DataError(f"{where}: the {name} {key!r} holds NaN or infinite values")
    return labels


def to_sample(atoms, species: Sequence[str], max_radius: float, keys: Optional[LabelKeys] = LabelKeys(),
              where: str = "structure") -> dict:
    """Tensors of one structure (default dtype) with its graph; with ``keys``, its labels too.

    ``species`` orders the elements (``sample["species"]`` holds indices into it). The graph is that of
    :func:`~e3attn.graph.radius_graph_pbc` along the periodic directions of ``atoms.pbc``.

    Raises:
        DataError: when an element is not in ``species`` or a label is missing (``where`` names the structure).

    Example::

        >>> from ase.build import molecule
        >>> sample = to_sample(molecule("H2O"), ["H", "O"], 2.0, keys=None)
        >>> sample["species"].tolist(), sample["edge_index"].shape
        ([1, 0, 0], torch.Size([2, 6]))
    """
    if keys is not None:  # a structure to train on or to evaluate (predictions take empty ones)
        _no_atoms(atoms, where)
    symbols = atoms.get_chemical_symbols()
    unknown = sorted(set(symbols) - set(species))
    if unknown:
        raise DataError(f"{where} holds the elements {unknown}, which the training set (and so the model) does "
                        f"not have; it knows {list(species)}")
    dtype = torch.get_default_dtype()
    pos = torch.tensor(atoms.positions, dtype=dtype)
    cell = torch.tensor(atoms.cell.array, dtype=dtype)
    edge_index, shifts = radius_graph_pbc(pos, cell, torch.tensor(atoms.pbc), max_radius)
    index = {s: i for i, s in enumerate(species)}
    sample = {"pos": pos, "species": torch.tensor([index[s] for s in symbols]), "cell": cell,
              "edge_index": edge_index, "shifts": shifts}
    if keys is not None:
        labels = _labels(atoms, keys, where)
        sample["energy"] = torch.tensor(labels["energy"], dtype=dtype)
        sample["forces"] = torch.tensor(labels["forces"], dtype=dtype)
        if "stress" in labels:
            sample["stress"] = torch.tensor(labels["stress"], dtype=dtype)
    return sample


def collate(samples: Sequence[dict]) -> dict:
    """One batch: concatenated atoms, edges shifted by the atoms before them, one cell (and stress) per structure.

    Example::

        >>> from ase.build import molecule
        >>> batch = collate([to_sample(molecule(m), ["H", "O"], 2.0, keys=None) for m in ("H2O", "H2O2")])
        >>> batch["num_atoms"].tolist(), batch["batch"].tolist()
        ([3, 4], [0, 0, 0, 1, 1, 1, 1])
    """
    sizes = torch.tensor([s["pos"].shape[0] for s in samples])
    offsets = torch.cumsum(sizes, 0) - sizes
    batch = {
        "pos": torch.cat([s["pos"] for s in samples]),
        "species": torch.cat([s["species"] for s in samples]),
        "batch": torch.arange(len(samples)).repeat_interleave(sizes),
        "cell": torch.stack([s["cell"] for s in samples]),
        "edge_index": torch.cat([s["edge_index"] + o for s, o in zip(samples, offsets)], dim=1),
        "shifts": torch.cat([s["shifts"] for s in samples]),
        "num_atoms": sizes,
    }
    if "energy" in samples[0]:
        batch["energy"] = torch.stack([s["energy"] for s in samples])
        batch["forces"] = torch.cat([s["forces"] for s in samples])
    if "stress" in samples[0]:
        batch["stress"] = torch.stack([s["stress"] for s in samples])
    return batch


def fit_references(samples: Sequence[dict], species: Sequence[str], energy_scale: str = "force_rms") -> dict:
    r"""Least-squares energy per element and the scale of the model's output: the units the model learns in.

    With :math:`n_{sz}` atoms of element :math:`z` in structure :math:`s` of energy :math:`E_s`, the references
    minimise :math:`\sum_s (E_s - \sum_z n_{sz} e_z)^2` (the least-norm solution when the compositions do not
    determine every :math:`e_z`, e.g. one molecule). ``energy_scale``: ``"force_rms"``, the RMS force component
    (eV/Å, read as eV), or ``"energy_std"``, the standard deviation over the structures of the energy per atom
    left after the references (eV).

    Returns:
        ``{"species", "energy_references", "energy_scale"}``, the extras :mod:`e3attn.calculator` reads.

    Example::

        >>> import torch
        >>> samples = [{"species": torch.tensor(z), "energy": torch.tensor(e), "forces": torch.ones(len(z), 3)}
        ...            for z, e in [([0, 0], -2.0), ([0, 1], -5.0), ([1, 1, 1], -12.0)]]
        >>> units = fit_references(samples, ["H", "O"])
        >>> [round(e, 6) for e in units["energy_references"]], units["energy_scale"]
        ([-1.0, -4.0], 1.0)
    """
    from .options import ENERGY_SCALES

    if energy_scale not in ENERGY_SCALES:
        raise ValueError(f"energy_scale: expected one of {ENERGY_SCALES}, got {energy_scale!r}")
    counts = torch.stack([torch.bincount(s["species"], minlength=len(species)) for s in samples]).double()
    energies = torch.stack([s["energy"] for s in samples]).double()
    refs = torch.linalg.lstsq(counts, energies[:, None], driver="gelsd").solution[:, 0]
    if energy_scale == "force_rms":
        scale = torch.cat([s["forces"] for s in samples]).double().pow(2).mean().sqrt()
    else:
        scale = ((energies - counts @ refs) / counts.sum(1)).std(unbiased=False)
    if not 0 < float(scale) < float("inf"):
        why = ("the training forces are all zero" if energy_scale == "force_rms" else
               "the training energies per atom are all explained by the reference energies (one structure?)")
        other = "energy_std" if energy_scale == "force_rms" else "force_rms"
        raise DataError(f"--energy-scale {energy_scale}: the scale is {float(scale):g}: {why}; try --energy-scale "
                        f"{other}")
    return {"species": list(species), "energy_references": refs.tolist(), "energy_scale": float(scale)}


def mean_neighbors(samples: Sequence[dict]) -> float:
    """The mean number of neighbours within the cutoff per atom (edges over atoms) of ``samples``."""
    edges = sum(s["edge_index"].shape[1] for s in samples)
    return max(edges / max(sum(s["pos"].shape[0] for s in samples), 1), 1.0)


def split(structures: List, fraction: float, seed: int) -> tuple:
    """``(train, valid)``: ``round(fraction * len)`` structures (at least one when ``fraction > 0``) drawn from
    ``structures`` with the seed for validation, the rest, in their order, for training."""
    count = max(round(fraction * len(structures)), 1) if fraction > 0 else 0
    chosen = set(np.random.default_rng(seed).permutation(len(structures))[:count].tolist())
    return ([a for i, a in enumerate(structures) if i not in chosen], [a for i, a in enumerate(structures) if i in chosen])

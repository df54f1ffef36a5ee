"""What changed in an ASE ``Atoms`` since a calculation: ASE's ``compare_atoms``, compared exactly."""
from __future__ import annotations

from typing import Collection, List

import numpy as np

__all__ = ["changed_properties"]

_ATTRIBUTES = ("cell", "pbc")  # ASE compares these attributes; the other properties live in ``atoms.arrays``


def changed_properties(before, after, properties: Collection[str]) -> List[str]:
    """Those of ``properties`` (names of ASE's ``all_changes``) in which ``after`` differs from ``before``: the
    attributes ``cell`` and ``pbc``, and the arrays (``positions``, ``numbers``, ...), an array held by one of the two
    only counting as changed; as ASE's ``compare_atoms``, but equal only where equal (``np.array_equal``), where ASE
    takes values within 1e-15 of each other as equal (``np.allclose``, several times as costly per array).

    Example::

        >>> from ase import Atoms
        >>> before = Atoms("H2", positions=[[0, 0, 0], [0, 0, 0.74]])
        >>> after = before.copy()
        >>> after.positions[1, 2] += 1e-16
        >>> changed_properties(before, after, ["positions", "numbers", "cell", "pbc"])
        ['positions']
    """
    changes = [name for name in _ATTRIBUTES if name in properties
               and not np.array_equal(getattr(before, name), getattr(after, name))]
    arrays_before, arrays_after = before.arrays, after.arrays
    for name in properties:
        if name in _ATTRIBUTES or (name not in arrays_before and name not in arrays_after):
            continue
        if name not in arrays_before or name not in arrays_after:
            changes.append(name)
        elif not np.array_equal(arrays_before[name], arrays_after[name]):
            changes.append(name)
    return changes

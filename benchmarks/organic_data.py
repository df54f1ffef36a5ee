r"""rMD17-style data sets of small organic molecules: GFN2-xTB molecular dynamics from SMILES.

For every molecule: a 3-D conformer from its SMILES (RDKit: ETKDG embedding, MMFF relaxation), Langevin
molecular dynamics at 500 K with 0.5 fs steps (friction 0.01/fs) on the GFN2-xTB potential (tblite's ASE
calculator), first ``--equilibrate`` fs discarded, then one frame every 10 fs. Energies (eV) and forces (eV/A) are
single-point GFN2-xTB results at the frames (tighter SCF than the dynamics), written as extended XYZ with the keys ``REF_energy`` and ``REF_forces`` (and the time
``time_fs``). The training and the test frames come from two separate trajectories: the conformer embedding and
the thermostat of the training one use ``--seed``, those of the test one ``--seed + 1``. The same seed gives the
same files (on one machine: GFN2-xTB's sums are in floating point).

Needs the ``data`` extra: ``pip install 'e3attn[data]'`` (tblite, rdkit).

Usage::

    python benchmarks/organic_data.py --molecules aspirin ethanol --train-frames 1000 --test-frames 1000
    e3attn-train --train-file benchmarks/data/organic/ethanol_train.xyz --valid-fraction 0.05 \
        --test-file benchmarks/data/organic/ethanol_test.xyz --energy-key REF_energy --forces-key REF_forces
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import List, Optional, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

# the ten molecules of rMD17 (Christensen and von Lilienfeld 2020); malonaldehyde in its enol form
SMILES = {
    "aspirin": "CC(=O)OC1=CC=CC=C1C(=O)O",
    "azobenzene": "C1=CC=C(C=C1)N=NC2=CC=CC=C2",
    "benzene": "C1=CC=CC=C1",
    "ethanol": "CCO",
    "malonaldehyde": "OC=CC=O",
    "naphthalene": "C1=CC=C2C=CC=CC2=C1",
    "paracetamol": "CC(=O)NC1=CC=C(C=C1)O",
    "salicylic_acid": "C1=CC=C(C(=C1)C(=O)O)O",
    "toluene": "CC1=CC=CC=C1",
    "uracil": "C1=CNC(=O)NC1=O",
}
TEMPERATURE_K = 500.0
TIMESTEP_FS = 0.5
FRAME_EVERY_FS = 10.0
FRICTION_PER_FS = 0.01
LABEL_ACCURACY = 0.1  # tblite's SCF accuracy of the labels (1 is its default, smaller is tighter)


def conformer(smiles: str, seed: int):
    """An ``ase.Atoms`` of the molecule ``smiles`` with hydrogens: RDKit's ETKDG embedding with ``seed``, then MMFF."""
    from ase import Atoms
    from rdkit import Chem
    from rdkit.Chem import AllChem

    molecule = Chem.AddHs(Chem.MolFromSmiles(smiles))
    if AllChem.EmbedMolecule(molecule, randomSeed=seed) != 0:
        raise RuntimeError(f"RDKit could not embed {smiles!r} in 3-D (seed {seed})")
    AllChem.MMFFOptimizeMolecule(molecule)
    symbols = [atom.GetSymbol() for atom in molecule.GetAtoms()]
    return Atoms(symbols, positions=molecule.GetConformer().GetPositions())


def trajectory(smiles: str, frames: int, seed: int, equilibrate_fs: float = 500.0,
               frame_every_fs: float = FRAME_EVERY_FS) -> List:
    """``frames`` structures of a GFN2-xTB Langevin trajectory at 500 K (0.5 fs steps), one every
    ``frame_every_fs`` after ``equilibrate_fs``, with ``info["REF_energy"]`` (eV), ``arrays["REF_forces"]`` (eV/A)
    and ``info["time_fs"]``; reproducible from ``seed`` (conformer and thermostat)."""
    from ase import units
    from ase.constraints import FixCom
    from ase.md.langevin import Langevin
    from ase.md import velocitydistribution as velocities
    from tblite.ase import TBLite

    rng = np.random.default_rng(seed)
    atoms = conformer(smiles, seed)
    atoms.calc = TBLite(method="GFN2-xTB", verbosity=0)
    # Maxwell-Boltzmann momenta (thermalize_momenta from ASE 3.29, which deprecates the older name)
    thermalize = getattr(velocities, "thermalize_momenta", velocities.MaxwellBoltzmannDistribution)
    thermalize(atoms, temperature_K=TEMPERATURE_K, rng=rng)
    velocities.Stationary(atoms)
    velocities.ZeroRotation(atoms)
    atoms.set_constraint(FixCom())  # the centre of mass stays put (Langevin's own fixcm is deprecated)
    dynamics = Langevin(atoms, TIMESTEP_FS * units.fs, temperature_K=TEMPERATURE_K,
                        friction=FRICTION_PER_FS / units.fs, fixcm=False, rng=rng)
    stride = round(frame_every_fs / TIMESTEP_FS)
    dynamics.run(round(equilibrate_fs / TIMESTEP_FS))
    out = []
    for _ in range(frames):
        dynamics.run(stride)
        frame = atoms.copy()
        frame.set_constraint()
        # labelled afresh (SCF from the atomic guess, not the last step's wavefunction): a label is the
        # single-point GFN2-xTB result at these positions, whatever the trajectory before it
        frame.calc = TBLite(method="GFN2-xTB", accuracy=LABEL_ACCURACY, verbosity=0)
        frame.info["REF_energy"] = float(frame.get_potential_energy())
        frame.arrays["REF_forces"] = frame.get_forces().copy()
        frame.calc = None  # the labels live under their own keys
        frame.info["time_fs"] = round(dynamics.nsteps * TIMESTEP_FS, 6)
        out.append(frame)
    return out


def write_set(name: str, out: Path, train_frames: int, test_frames: int, seed: int, equilibrate_fs: float) -> dict:
    """``<out>/<name>_train.xyz`` and ``<out>/<name>_test.xyz``, from the trajectories of ``seed`` and ``seed + 1``."""
    from ase.io import write

    paths = {}
    for split, frames, split_seed in (("train", train_frames, seed), ("test", test_frames, seed + 1)):
        start = time.perf_counter()
        structures = trajectory(SMILES[name], frames, split_seed, equilibrate_fs)
        paths[split] = out / f"{name}_{split}.xyz"
        temporary = paths[split].with_suffix(f".tmp{os.getpid()}.xyz")
        write(temporary, structures, format="extxyz")
        os.replace(temporary, paths[split])
        print(f"{name} {split}: {frames} frames (seed {split_seed}) in {time.perf_counter() - start:.0f} s "
              f"-> {paths[split]}", flush=True)
    return paths


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    sys.path.insert(0, str(ROOT))
    from e3attn.train.options import ArgumentParser, non_negative_float, non_negative_int, positive_int

    p = ArgumentParser(__doc__.replace("``", ""))
    p.add_argument("--molecules", nargs="+", choices=sorted(SMILES),
                   default=["aspirin", "ethanol", "malonaldehyde", "paracetamol"], help="which molecules")
    p.add_argument("--train-frames", type=positive_int, default=1000, help="frames of the training trajectory")
    p.add_argument("--test-frames", type=positive_int, default=1000, help="frames of the test trajectory")
    p.add_argument("--seed", type=non_negative_int, default=0, help="seed of the training trajectory (test: +1)")
    p.add_argument("--equilibrate", type=non_negative_float, default=500.0, metavar="FS",
                   help="femtoseconds of dynamics discarded before the first frame")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "data" / "organic", help="output folder")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    return {name: write_set(name, args.out, args.train_frames, args.test_frames, args.seed, args.equilibrate)
            for name in args.molecules}


if __name__ == "__main__":
    main()

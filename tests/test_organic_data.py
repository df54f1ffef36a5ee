"""benchmarks/organic_data.py on a tiny case (ethanol, a few frames); needs the data extra (tblite, rdkit).

CI does not install the data extra, so there this file is skipped.
"""
import importlib
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("rdkit")
pytest.importorskip("tblite.ase")

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def organic(monkeypatch):
    """benchmarks/organic_data.py, imported as its own folder's script."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("organic_data")


@pytest.mark.slow
def test_ethanol_frames_are_gfn2_labelled_separate_and_reproducible(organic, tmp_path):
    from ase.io import read
    from tblite.ase import TBLite

    from e3attn.train import LabelKeys, read_structures, to_sample

    paths = organic.main(["--molecules", "ethanol", "--train-frames", "2", "--test-frames", "2", "--equilibrate", "0",
                          "--out", str(tmp_path)])["ethanol"]
    train, test = read(paths["train"], index=":"), read(paths["test"], index=":")
    assert len(train) == len(test) == 2 and sorted(p.name for p in tmp_path.iterdir()) == [
        "ethanol_test.xyz", "ethanol_train.xyz"]
    for frames in (train, test):
        assert [f.info["time_fs"] for f in frames] == [10.0, 20.0]  # a frame every 10 fs of 0.5 fs steps
        assert all(f.get_chemical_formula() == "C2H6O" and f.calc is None for f in frames)
    assert np.abs(train[0].positions - test[0].positions).max() > 0.1  # two trajectories (seeds 0 and 1)

    fresh = train[1].copy()
    fresh.calc = TBLite(method="GFN2-xTB", accuracy=organic.LABEL_ACCURACY, verbosity=0)
    assert fresh.get_potential_energy() == pytest.approx(train[1].info["REF_energy"], abs=1e-6)  # eV
    np.testing.assert_allclose(fresh.get_forces(), train[1].arrays["REF_forces"], atol=1e-6)  # eV/A

    again = organic.trajectory(organic.SMILES["ethanol"], 1, seed=0, equilibrate_fs=0)[0]  # the same seed
    np.testing.assert_allclose(again.positions, train[0].positions, atol=1e-8)
    assert again.info["REF_energy"] == pytest.approx(train[0].info["REF_energy"], abs=1e-8)

    keys = LabelKeys("REF_energy", "REF_forces")  # what e3attn-train reads with --energy-key/--forces-key
    sample = to_sample(read_structures(str(paths["train"]))[0], ["H", "C", "O"], 4.0, keys)
    assert sample["forces"].shape == (9, 3)


def test_every_molecule_has_a_smiles_rdkit_reads(organic):
    from rdkit import Chem

    formulas = {"aspirin": "C9H8O4", "ethanol": "C2H6O", "malonaldehyde": "C3H4O2", "paracetamol": "C8H9NO2",
                "benzene": "C6H6", "toluene": "C7H8", "naphthalene": "C10H8", "uracil": "C4H4N2O2",
                "salicylic_acid": "C7H6O3", "azobenzene": "C12H10N2"}
    from rdkit.Chem.rdMolDescriptors import CalcMolFormula

    assert {name: CalcMolFormula(Chem.MolFromSmiles(s)) for name, s in organic.SMILES.items()} == formulas

"""The calculator's answers to a careful user's inputs: cells without a volume, atomic numbers that are no
elements, devices, checkpoints whose extras do not fit, cells far smaller than the search radius."""
import numpy as np
import pytest
import torch

pytest.importorskip("ase")
from ase import Atoms  # noqa: E402
from ase.calculators.calculator import PropertyNotImplementedError  # noqa: E402

from e3attn.calculator import E3AttnCalculator  # noqa: E402
from e3attn.models import EquivariantTransformer, save_checkpoint  # noqa: E402

SPECIES = ["Cu", "Ni"]


def make_model() -> EquivariantTransformer:
    torch.manual_seed(0)
    return EquivariantTransformer("1x0e", "8x0e + 2x1o", "0e", 3.0, num_layers=1,
                                  irreps_node_attr=f"{len(SPECIES)}x0e", reduce="sum").double()


@pytest.fixture(scope="module")
def calc():
    return E3AttnCalculator(make_model(), SPECIES, stress="always")


@pytest.mark.parametrize("cell, pbc", [
    ([[4.0, 0, 0], [0, 4.0, 0], [4.0, 4.0, 0]], [True, True, False]),  # three non-zero rows in one plane
    ([[3.0, 0, 0], [3.0, 0, 0], [0, 0, 3.0]], False),  # two equal rows
])
def test_coplanar_lattice_vectors_have_no_stress(calc, cell, pbc):
    """ASE's ``cell.rank`` counts non-zero rows: these cells have rank 3 and no volume. The stress is refused (as
    for any cell without a volume) instead of coming back infinite; energy and forces stay finite."""
    atoms = Atoms("Cu2", positions=[[0, 0, 0], [2.0, 0.3, 0.5]], cell=cell, pbc=pbc)
    assert atoms.cell.rank == 3
    atoms.calc = calc
    assert np.isfinite(atoms.get_potential_energy()) and np.isfinite(atoms.get_forces()).all()
    assert "stress" not in calc.results
    with pytest.raises(PropertyNotImplementedError, match="volume"):
        atoms.get_stress()


def test_a_skewed_cell_with_a_volume_has_its_stress(calc):
    atoms = Atoms("Cu2", positions=[[0, 0, 0], [2.0, 0.3, 0.5]], cell=[[4.0, 0, 0], [3.9, 0.2, 0], [0, 0, 4.0]],
                  pbc=True)
    atoms.calc = calc
    assert np.isfinite(atoms.get_stress()).all()


@pytest.mark.parametrize("numbers, match", [
    ([29, -1], r"atomic numbers \[-1\] that are no elements \(0 to 118\)"),
    ([29, 119, 200], r"atomic numbers \[119, 200\] that are no elements"),
])
def test_atomic_numbers_that_are_no_elements_are_refused(numbers, match):
    """NumPy would read -1 as the last element (Og) and 119 as an index error: both get one clear error, also for
    a model that knows Og."""
    for species in (SPECIES, ["Cu", "Og"]):
        calc = E3AttnCalculator(make_model(), species)
        atoms = Atoms(numbers=numbers, positions=np.arange(3.0 * len(numbers)).reshape(-1, 3))
        with pytest.raises(ValueError, match=match):
            calc.get_potential_energy(atoms)


@pytest.mark.parametrize("device, match", [
    ("gpu0", r"device must be a torch device such as 'cpu' or 'cuda:0', got 'gpu0'"),
    (3, r"device must be a torch device such as 'cpu' or 'cuda:0', got 3"),
    ("cpu:1", r"device 'cpu:1' is not available on this machine"),
    pytest.param("cuda", r"device 'cuda' is not available on this machine",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")),
])
def test_bad_devices_are_named(tmp_path, device, match):
    with pytest.raises(ValueError, match=match):
        E3AttnCalculator(make_model(), SPECIES, device=device)
    path = tmp_path / "model.pt"
    save_checkpoint(make_model(), path, species=SPECIES)
    with pytest.raises(ValueError, match=match):
        E3AttnCalculator.from_checkpoint(path, device=device)


def test_checkpoint_errors_name_the_file(tmp_path):
    path = tmp_path / "model.pt"
    save_checkpoint(make_model(), path, species=["Cu"])  # the model takes two elements
    with pytest.raises(ValueError, match=r"checkpoint '.*model\.pt': the model takes 2 node attributes but "
                                         r"species names 1 elements"):
        E3AttnCalculator.from_checkpoint(path)
    with pytest.raises(TypeError, match="path must be a file path or a binary file object, got NoneType"):
        E3AttnCalculator.from_checkpoint(None)


def test_energy_scale_saved_as_a_tensor_loads(calc, tmp_path):
    """save_checkpoint stores a 0-d tensor as given; the calculator takes its value."""
    path = tmp_path / "model.pt"
    save_checkpoint(make_model(), path, species=SPECIES, energy_scale=torch.tensor(0.3, dtype=torch.float64))
    loaded = E3AttnCalculator.from_checkpoint(path)
    assert loaded.energy_scale == 0.3
    atoms = Atoms("CuNi", positions=[[0, 0, 0], [2.2, 0.1, 0]])
    assert loaded.get_potential_energy(atoms) == pytest.approx(0.3 * calc.get_potential_energy(atoms), rel=1e-12)


def test_too_many_images_names_the_cutoff_and_the_skin():
    atoms = Atoms("Cu", cell=0.01 * np.eye(3), pbc=True)
    atoms.calc = E3AttnCalculator(make_model(), SPECIES)
    with pytest.raises(ValueError, match=r"r_max=3\.5 reaches .* \(r_max here is the cutoff 3 plus the Verlet "
                                         r"list's skin 0\.5; skin=0 searches to the cutoff alone\)"):
        atoms.get_potential_energy()
    atoms.calc = E3AttnCalculator(make_model(), SPECIES, skin=0.0)
    with pytest.raises(ValueError, match=r"r_max=3 reaches") as info:
        atoms.get_potential_energy()
    assert "skin" not in str(info.value)

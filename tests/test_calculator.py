"""The ASE calculator: exact gradients (forces, stress), symmetry, ASE's optimizers, dynamics and caching."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from e3nn import o3

pytest.importorskip("ase")
from ase import Atoms  # noqa: E402
from ase.build import bulk, fcc111  # noqa: E402
from ase.calculators.calculator import PropertyNotImplementedError  # noqa: E402
from ase.cluster import Icosahedron  # noqa: E402
from ase.md.verlet import VelocityVerlet  # noqa: E402
from ase.stress import voigt_6_to_full_3x3_stress  # noqa: E402
from ase.units import fs, kB  # noqa: E402

from e3attn.calculator import E3AttnCalculator  # noqa: E402
from e3attn.models import EquivariantTransformer, save_checkpoint  # noqa: E402
from e3attn.testing._common import _default_dtype  # noqa: E402

SPECIES = ["Cu", "Ni"]
REFERENCES = {"Cu": -3.5, "Ni": -4.4}
SCALE = 0.3


def make_model(seed=0) -> EquivariantTransformer:
    """A small untrained potential in float64 (e3nn's constants built in float64 too)."""
    torch.manual_seed(seed)
    with _default_dtype(torch.float64):
        return EquivariantTransformer(
            "1x0e", "8x0e + 4x1o", "0e", 3.0, num_layers=2, num_heads=2, lmax=2,
            irreps_node_attr=f"{len(SPECIES)}x0e", reduce="sum",
        )


@pytest.fixture(scope="module")
def calc():
    return E3AttnCalculator(make_model(), SPECIES, energy_references=REFERENCES, energy_scale=SCALE)


def alloy(atoms, seed):
    """``atoms`` with a third of them Ni, rattled by 0.1 Angstrom."""
    rng = np.random.default_rng(seed)
    atoms = atoms.copy()
    symbols = np.array(atoms.get_chemical_symbols())
    symbols[rng.random(len(atoms)) < 0.33] = "Ni"
    atoms.set_chemical_symbols(symbols)
    atoms.positions += rng.normal(0.0, 0.1, atoms.positions.shape)
    return atoms


def triclinic():
    atoms = bulk("Cu", "fcc", a=3.6).repeat((2, 2, 1))  # the primitive cell is already skewed
    strain = np.eye(3) + 0.08 * np.random.default_rng(3).normal(size=(3, 3))
    atoms.set_cell(atoms.cell.array @ strain, scale_atoms=True)
    return atoms


def wire():
    """Periodic along x only, with a cell of one lattice vector (no volume)."""
    atoms = Atoms("Cu4", positions=[[0, 0, 0], [1.3, 1.3, 0], [2.6, 0, 1.3], [3.9, 1.3, 1.3]],
                  cell=[5.2, 0, 0], pbc=[True, False, False])
    return atoms


STRUCTURES = {
    "cluster": lambda: alloy(Icosahedron("Cu", 2), 0),  # open boundaries, no cell
    "cubic": lambda: alloy(bulk("Cu", "fcc", a=3.6, cubic=True).repeat((2, 1, 1)), 1),
    "triclinic": lambda: alloy(triclinic(), 2),
    "slab": lambda: alloy(fcc111("Cu", (2, 2, 2), a=3.6, vacuum=4.0), 3),  # mixed: periodic in x, y
    "wire": lambda: alloy(wire(), 4),  # mixed, no volume
}
WITH_VOLUME = ["cubic", "triclinic", "slab"]


def derivative(function, h):
    """d function(t) / dt at t = 0, by the fourth-order central difference."""
    return (-function(2 * h) + 8 * function(h) - 8 * function(-h) + function(-2 * h)) / (12 * h)


# ---------------------------------------------------------------- exact gradients


@pytest.mark.parametrize("name", list(STRUCTURES))
def test_forces_are_minus_the_gradient_of_the_energy(calc, name):
    atoms = STRUCTURES[name]()
    forces = calc.get_forces(atoms)
    assert forces.shape == (len(atoms), 3) and np.abs(forces).max() > 0.1
    rng = np.random.default_rng(0)
    for _ in range(3):  # along random directions of all the atoms at once
        direction = rng.normal(size=forces.shape)

        def energy(t):
            moved = atoms.copy()
            moved.positions += t * direction
            return calc.get_potential_energy(moved)

        assert derivative(energy, 5e-5) == pytest.approx(-(forces * direction).sum(), abs=1e-8 * np.abs(forces).max())


@pytest.mark.parametrize("name", WITH_VOLUME)
def test_stress_is_the_strain_derivative_of_the_energy_over_the_volume(calc, name):
    atoms = STRUCTURES[name]()
    stress = calc.get_stress(atoms)
    assert stress.shape == (6,) and np.abs(stress).max() > 1e-3
    for k, (i, j) in enumerate([(0, 0), (1, 1), (2, 2), (1, 2), (0, 2), (0, 1)]):  # ASE's Voigt order
        unit = np.zeros((3, 3))
        unit[i, j] = unit[j, i] = 1.0  # a symmetric strain

        def energy(t):
            strained = atoms.copy()
            strained.set_cell(atoms.cell.array @ (np.eye(3) + t * unit), scale_atoms=True)
            return calc.get_potential_energy(strained)

        expected = derivative(energy, 1e-5) / atoms.get_volume() / (1 if i == j else 2)
        assert stress[k] == pytest.approx(expected, abs=1e-7 * np.abs(stress).max())


def test_stress_follows_ases_convention(calc):
    """Sign, units and Voigt order as ASE's own finite-difference stress."""
    from ase.calculators.fd import calculate_numerical_stress

    atoms = STRUCTURES["triclinic"]()
    atoms.calc = calc
    stress = atoms.get_stress()
    np.testing.assert_allclose(stress, calculate_numerical_stress(atoms, eps=1e-5),
                               rtol=0, atol=1e-6 * np.abs(stress).max())


@pytest.mark.parametrize("name", ["cluster", "triclinic", "slab"])
@pytest.mark.parametrize("improper", [False, True])
def test_energy_invariant_forces_and_stress_rotate_with_the_system(calc, name, improper):
    atoms = STRUCTURES[name]()
    torch.manual_seed(5)
    rotation = o3.rand_matrix(dtype=torch.float64).numpy() * (-1 if improper else 1)
    rotated = atoms.copy()
    rotated.positions = atoms.positions @ rotation.T
    rotated.set_cell(atoms.cell.array @ rotation.T)
    energy, forces = calc.get_potential_energy(atoms), calc.get_forces(atoms)
    stress = voigt_6_to_full_3x3_stress(calc.get_stress(atoms)) if atoms.cell.rank == 3 else None
    assert calc.get_potential_energy(rotated) == pytest.approx(energy, abs=1e-10 * abs(energy))
    np.testing.assert_allclose(calc.get_forces(rotated), forces @ rotation.T, rtol=0, atol=1e-10)
    if stress is not None:
        rotated_stress = voigt_6_to_full_3x3_stress(calc.get_stress(rotated))
        np.testing.assert_allclose(rotated_stress, rotation @ stress @ rotation.T, rtol=0, atol=1e-10)


def test_periodic_results_do_not_depend_on_wrapping_or_translation(calc):
    atoms = STRUCTURES["triclinic"]()
    moved = atoms.copy()
    moved.positions += [7.0, -3.0, 11.0]
    moved.positions[0] += atoms.cell[1] - 2 * atoms.cell[2]  # one atom in another image
    energy, forces, stress = calc.get_potential_energy(atoms), calc.get_forces(atoms), calc.get_stress(atoms)
    assert calc.get_potential_energy(moved) == pytest.approx(energy, abs=1e-10 * abs(energy))
    np.testing.assert_allclose(calc.get_forces(moved), forces, rtol=0, atol=1e-10)
    np.testing.assert_allclose(calc.get_stress(moved), stress, rtol=0, atol=1e-10)


def test_energy_is_the_scaled_model_plus_the_references():
    model = make_model()
    atoms = STRUCTURES["cubic"]()
    plain = E3AttnCalculator(model, SPECIES)
    scaled = E3AttnCalculator(model, SPECIES, energy_references=[-3.5, -4.4], energy_scale=SCALE)
    reference = sum(REFERENCES[s] for s in atoms.get_chemical_symbols())
    energy = scaled.get_potential_energy(atoms)
    assert energy == pytest.approx(SCALE * plain.get_potential_energy(atoms) + reference, abs=1e-12)
    assert scaled.get_property("free_energy", atoms) == energy
    np.testing.assert_allclose(scaled.get_forces(atoms), SCALE * plain.get_forces(atoms), rtol=1e-14, atol=1e-14)
    np.testing.assert_allclose(scaled.get_stress(atoms), SCALE * plain.get_stress(atoms), rtol=1e-14, atol=1e-14)


# ---------------------------------------------------------------- ASE's tools


@pytest.mark.parametrize("optimizer", ["BFGS", "FIRE"])
def test_relaxation_lowers_the_energy_below_a_force_threshold(calc, optimizer):
    import ase.optimize

    atoms = STRUCTURES["cubic"]()
    atoms.calc = calc
    start = atoms.get_potential_energy()
    converged = getattr(ase.optimize, optimizer)(atoms, logfile=None).run(fmax=1e-3, steps=300)
    assert converged
    assert atoms.get_potential_energy() < start - 1e-3
    assert np.linalg.norm(atoms.get_forces(), axis=1).max() < 1e-3


def run_nve(calc, atoms, dt, duration):
    """Total energies along a velocity-Verlet run of ``duration`` fs with step ``dt`` fs."""
    atoms = atoms.copy()
    atoms.calc = calc
    dynamics = VelocityVerlet(atoms, timestep=dt * fs)
    energies = [atoms.get_total_energy()]
    dynamics.attach(lambda: energies.append(atoms.get_total_energy()))
    dynamics.run(round(duration / dt))
    return np.array(energies)


def test_velocity_verlet_energy_error_shrinks_as_dt_squared(calc):
    """Exact forces of a smooth potential: halving the step quarters the energy error (no cutoff jumps)."""
    atoms = STRUCTURES["cubic"]()
    masses = atoms.get_masses()[:, None]
    momenta = np.sqrt(masses * kB * 600) * np.random.default_rng(0).normal(size=(len(atoms), 3))  # 600 K
    atoms.set_momenta(momenta - masses * momenta.sum(0) / masses.sum())  # at rest as a whole
    errors = []
    for dt in [1.0, 0.5, 0.25]:
        energies = run_nve(calc, atoms, dt, duration=20.0)
        errors.append(np.abs(energies - energies[0]).max())
    assert errors[0] > 1e-4  # a measurable error at 1 fs
    ratios = [errors[0] / errors[1], errors[1] / errors[2]]
    assert all(3.8 < r < 4.2 for r in ratios), (errors, ratios)


def test_dynamics_compute_each_configuration_once():
    """ASE's caching: energy and forces of one configuration come from one model call; the stress from the first
    call that asks for it on (one more call for that configuration, then with every call)."""
    from ase.md.langevin import Langevin

    model = make_model()
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    calc = E3AttnCalculator(model, SPECIES)
    atoms = STRUCTURES["slab"]()
    atoms.calc = calc
    atoms.get_potential_energy(), atoms.get_forces(), atoms.get_potential_energy()
    assert len(calls) == 1 and "stress" not in calc.results
    atoms.get_stress(), atoms.get_forces()
    assert len(calls) == 2
    calc.get_forces(atoms.copy())  # equal atoms: nothing new
    assert len(calls) == 2
    atoms.positions[0, 0] += 1e-3
    atoms.get_forces(), atoms.get_stress()
    assert len(calls) == 3

    dynamics = Langevin(atoms, 1.0 * fs, temperature_K=300, friction=0.01, fixcm=False,
                         rng=np.random.default_rng(0))
    dynamics.attach(lambda: atoms.get_total_energy())
    dynamics.run(5)
    assert len(calls) == 3 + 5


def test_the_state_check_names_the_changes_ases_names_and_smaller_ones():
    """``check_state`` (exact comparisons) names what ASE's ``compare_atoms`` names for every kind of change, honours
    ``ignored_changes``, and also names a change below ASE's tolerance of 1e-15 (computed anew, never stale)."""
    from ase.calculators.calculator import all_changes, compare_atoms

    calc = E3AttnCalculator(make_model(), SPECIES)
    before = alloy(triclinic(), 0)
    calc.atoms = before.copy()
    edits = {
        "nothing": lambda a: None,
        "positions": lambda a: a.positions.__setitem__((0, 1), a.positions[0, 1] + 1e-9),
        "numbers": lambda a: a.numbers.__setitem__(0, 29 if a.numbers[0] != 29 else 28),
        "cell": lambda a: a.set_cell(a.cell.array * 1.01),
        "pbc": lambda a: a.set_pbc([True, False, True]),
        "charges": lambda a: a.set_initial_charges(np.linspace(0.0, 1.0, len(a))),
        "magmoms": lambda a: a.set_initial_magnetic_moments(np.ones(len(a))),
        "momenta": lambda a: a.set_momenta(np.ones((len(a), 3))),  # not a property ASE compares
    }
    for name, edit in edits.items():
        atoms = before.copy()
        edit(atoms)
        expected = compare_atoms(calc.atoms, atoms, tol=1e-15)
        assert sorted(calc.check_state(atoms)) == sorted(expected), name
        assert (name in ("nothing", "momenta")) == (not expected), name
    tiny = before.copy()
    tiny.positions[0, 0] = np.nextafter(before.positions[0, 0], np.inf)  # the next float: < 1e-15 away
    assert 0 < tiny.positions[0, 0] - before.positions[0, 0] < 1e-15
    assert compare_atoms(calc.atoms, tiny, tol=1e-15) == [] and calc.check_state(tiny) == ["positions"]
    moved = before.copy()
    moved.positions += 0.1
    calc.ignored_changes = {"positions"}
    assert calc.check_state(moved) == [] == compare_atoms(calc.atoms, moved, excluded_properties={"positions"})
    calc.ignored_changes = set()
    assert calc.check_state(moved, tol=0.5) == []  # another tolerance: ASE's own comparison
    calc.atoms = None
    assert calc.check_state(moved) == list(all_changes)


def test_energy_and_forces_without_the_stress_equal_those_with_it():
    """A calculator never asked for the stress computes energy and forces without it (no strain derivative), equal
    to those of one that computes the stress too, to rounding (float64)."""
    atoms = STRUCTURES["slab"]()
    plain, with_stress = (E3AttnCalculator(make_model(), SPECIES, energy_references=REFERENCES, energy_scale=SCALE)
                          for _ in range(2))
    with_stress.get_stress(atoms)
    for step in range(3):
        atoms.positions[step] += 0.01
        np.testing.assert_allclose(plain.get_forces(atoms), with_stress.get_forces(atoms), rtol=0, atol=1e-12)
        assert plain.get_potential_energy(atoms) == pytest.approx(with_stress.get_potential_energy(atoms), abs=1e-12)
        assert "stress" not in plain.results and "stress" in with_stress.results


def test_the_model_stays_trainable_and_its_gradients_untouched():
    """The calculator computes without gradients of the weights, and gives the weights back as they were."""
    model = make_model()
    frozen = next(iter(model.parameters()))
    frozen.requires_grad_(False)
    calc = E3AttnCalculator(model, SPECIES)
    calc.get_forces(STRUCTURES["cubic"]())
    assert [p.requires_grad for p in model.parameters()] == [p is not frozen for p in model.parameters()]
    assert all(p.grad is None for p in model.parameters())
    pos = torch.randn(5, 3, dtype=torch.float64)
    model(pos, node_attr=torch.ones(5, 2, dtype=torch.float64)).sum().backward()  # trains as before
    assert all((p.grad is not None) == (p is not frozen) for p in model.parameters())


# ---------------------------------------------------------------- errors and edge cases


def test_unknown_elements_are_named(calc):
    atoms = Atoms("CuFeAuNi", positions=np.arange(12.0).reshape(4, 3))
    with pytest.raises(ValueError, match=r"\['Au', 'Fe'\].*\['Cu', 'Ni'\]"):
        calc.get_potential_energy(atoms)


def test_stress_without_a_volume_is_not_implemented(calc):
    atoms = STRUCTURES["wire"]()
    assert calc.get_forces(atoms).shape == (4, 3)
    with pytest.raises(PropertyNotImplementedError, match="volume"):
        calc.get_stress(atoms)


def test_no_atoms(calc):
    atoms = Atoms(cell=np.eye(3) * 4.0, pbc=True)
    assert calc.get_potential_energy(atoms) == 0.0
    assert calc.get_forces(atoms).shape == (0, 3)
    np.testing.assert_array_equal(calc.get_stress(atoms), np.zeros(6))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(species=["Cu", "Xx"]), "element symbols"),
        (dict(species=["Cu", "Cu"]), "repeat"),
        (dict(species=["Cu", "Ni", "Au"]), "3 elements"),
        (dict(species="CuNi"), "sequence"),
        (dict(energy_references=[1.0]), "2 finite numbers"),
        (dict(energy_references={"Cu": 1.0}), "each of the species"),
        (dict(energy_scale=0.0), "energy_scale"),
        (dict(dtype=torch.int64), "dtype"),
        (dict(keep_memory=1), "keep_memory must be None, True or False"),
        (dict(stress="never"), "stress must be one of 'when_asked', 'always'"),
        (dict(dtype=torch.float8_e4m3fn), r"dtype must be one of torch.float16, torch.bfloat16, torch.float32, "
                                          r"torch.float64, got torch.float8_e4m3fn"),
    ],
)
def test_bad_arguments(kwargs, match):
    kwargs = {"species": SPECIES, **kwargs}
    with pytest.raises(ValueError, match=match):
        E3AttnCalculator(make_model(), **kwargs)


KEPT = r"""
import ctypes, os, sys
import numpy as np
import e3attn.calculator as calculator
from ase.build import bulk
from e3attn._memory import _glibc
from e3attn.models import EquivariantTransformer

mode, edges = sys.argv[1], int(sys.argv[2])
calculator.KEEP_MEMORY_EDGES = edges
model = EquivariantTransformer("1x0e", "4x0e", "0e", 3.0, irreps_node_attr="1x0e", reduce="sum")
calc = calculator.E3AttnCalculator(model, ["Cu"], keep_memory={"none": None, "true": True, "false": False}[mode])
calc.get_forces(bulk("Cu", "fcc", a=3.6, cubic=True))  # 4 atoms, 48 edges
libc, page = ctypes.CDLL(None), os.sysconf("SC_PAGE_SIZE")
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]


def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page


size = 64 << 20
before = resident()
block = libc.malloc(size)  # nothing allocated after it: freed, it is the top of the heap (or its own mapping)
ctypes.memset(block, 1, size)
libc.free(block)
print(_glibc() is not None, (resident() - before) / size)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/statm is Linux's")
@pytest.mark.parametrize("mode, edges, kept", [("true", 10**9, True), ("false", 0, False), ("none", 49, False),
                                               ("none", 48, True)])
def test_keep_memory_keeps_freed_memory_in_the_process(mode, edges, kept):
    """With ``keep_memory=True``, and by default from the first call with ``KEEP_MEMORY_EDGES`` edges on, a 64 MiB
    block written and freed stays resident (neither unmapped nor trimmed from the heap), ready for the next call;
    with ``keep_memory=False``, or by default before such a call, it goes back to the system. In fresh processes
    (the setting is process-wide), without the environment's own allocator settings."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "LD_PRELOAD", "THP_MEM_ALLOC_ENABLE")}
    out = subprocess.run([sys.executable, "-c", KEPT, mode, str(edges)], capture_output=True, text=True, timeout=300,
                         env=env)
    assert out.returncode == 0, out.stderr
    glibc, resident = out.stdout.split()
    if glibc != "True":
        pytest.skip("the C library is not glibc: keep_memory changes nothing")
    assert float(resident) > 0.9 if kept else float(resident) < 0.1, resident


def test_options_are_forwarded_by_from_checkpoint(tmp_path, monkeypatch):
    import e3attn.calculator as calculator

    calls = []
    monkeypatch.setattr(calculator, "keep_freed_memory", lambda: calls.append(1))
    path = tmp_path / "model.pt"
    save_checkpoint(make_model(), path, species=SPECIES)
    calc = E3AttnCalculator.from_checkpoint(path, stress="always", keep_memory=False)
    atoms = STRUCTURES["slab"]()
    calc.get_forces(atoms)
    assert "stress" in calc.results and not calls
    E3AttnCalculator.from_checkpoint(path, keep_memory=True).get_forces(atoms)
    assert calls == [1]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_every_accepted_dtype_computes(calc, dtype):
    """Each dtype the constructor accepts gives float64's energy, forces and stress to its precision (half
    precision: the periodic graph and the cell's volume are computed wider)."""
    narrow = E3AttnCalculator(make_model(), SPECIES, energy_references=REFERENCES, energy_scale=SCALE, dtype=dtype)
    atoms = STRUCTURES["triclinic"]()
    for name in ["energy", "forces", "stress"]:
        expected = np.asarray(calc.get_property(name, atoms))
        got = np.asarray(narrow.get_property(name, atoms))
        scale = np.abs(expected).max()
        assert got.dtype == np.float64 and scale > 1e-2
        assert np.abs(got - expected).max() < 50 * torch.finfo(dtype).eps * scale  # measured: up to 31 eps


def test_species_as_atomic_numbers(calc):
    atoms = STRUCTURES["cluster"]()
    by_number = E3AttnCalculator(calc.model, [29, 28], energy_references=REFERENCES, energy_scale=SCALE)
    assert by_number.species == SPECIES
    assert by_number.get_potential_energy(atoms) == calc.get_potential_energy(atoms)


def test_from_checkpoint_rebuilds_the_calculator(calc, tmp_path):
    path = tmp_path / "model.pt"
    model = make_model().float()
    save_checkpoint(model, path, species=SPECIES, energy_references=[-3.5, -4.4], energy_scale=SCALE, note="x")
    atoms = STRUCTURES["triclinic"]()
    loaded = E3AttnCalculator.from_checkpoint(path)
    assert loaded.dtype == torch.float32 and loaded.species == SPECIES
    as_float64 = E3AttnCalculator.from_checkpoint(path, dtype=torch.float64)
    for name in ["energy", "forces", "stress"]:
        expected = calc.get_property(name, atoms)
        np.testing.assert_allclose(as_float64.get_property(name, atoms), expected, rtol=0, atol=1e-5)
        np.testing.assert_allclose(loaded.get_property(name, atoms), expected, rtol=0, atol=1e-3)

    save_checkpoint(model, tmp_path / "bare.pt")
    with pytest.raises(ValueError, match="species"):
        E3AttnCalculator.from_checkpoint(tmp_path / "bare.pt")


def test_import_without_ase_says_what_to_install(monkeypatch):
    import importlib
    import sys

    monkeypatch.setitem(sys.modules, "ase.calculators.calculator", None)  # as if ASE were not installed
    monkeypatch.delitem(sys.modules, "e3attn.calculator")
    with pytest.raises(ImportError, match="pip install ase"):
        importlib.import_module("e3attn.calculator")

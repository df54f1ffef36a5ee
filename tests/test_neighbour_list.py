"""The calculator's Verlet neighbour list: a skin changes nothing but the number of searches."""
import numpy as np
import pytest
import torch

pytest.importorskip("ase")
from ase.build import bulk, fcc111  # noqa: E402
from ase.md.verlet import VelocityVerlet  # noqa: E402
from ase.units import fs, kB  # noqa: E402

from e3attn import kernels  # noqa: E402
from e3attn._verlet import VerletList  # noqa: E402
from e3attn.calculator import E3AttnCalculator  # noqa: E402
from e3attn.graph import radius_graph_pbc  # noqa: E402
from e3attn.models import EquivariantTransformer, energy_forces_stress  # noqa: E402
from e3attn.testing._common import _default_dtype  # noqa: E402

SPECIES = ["Cu", "Ni"]


def make_model(**kwargs) -> EquivariantTransformer:
    torch.manual_seed(0)
    with _default_dtype(torch.float64):
        return EquivariantTransformer("1x0e", "8x0e + 4x1o", "0e", 3.0, num_layers=2, num_heads=2, lmax=2,
                                      irreps_node_attr=f"{len(SPECIES)}x0e", reduce="sum", **kwargs)


@pytest.fixture(scope="module")
def model():
    return make_model()


def hot(atoms, temperature, seed=0):
    """``atoms`` with every third atom Ni, rattled, with momenta of ``temperature`` K and no drift."""
    rng = np.random.default_rng(seed)
    atoms = atoms.copy()
    symbols = np.array(atoms.get_chemical_symbols())
    symbols[::3] = "Ni"
    atoms.set_chemical_symbols(symbols)
    atoms.positions += rng.normal(0.0, 0.05, atoms.positions.shape)
    masses = atoms.get_masses()[:, None]
    momenta = np.sqrt(masses * kB * temperature) * rng.normal(size=(len(atoms), 3))
    atoms.set_momenta(momenta - masses * momenta.sum(0) / masses.sum())
    return atoms


def assert_same_results(calc, reference, atoms):
    for name in ["energy", "forces"] + (["stress"] if atoms.cell.rank == 3 else []):
        expected = reference.get_property(name, atoms.copy())
        np.testing.assert_allclose(calc.get_property(name, atoms), expected, rtol=1e-12, atol=1e-12, err_msg=name)


STRUCTURES = {
    "cubic": lambda: bulk("Cu", "fcc", a=3.6, cubic=True).repeat((2, 2, 2)),
    "triclinic": lambda: bulk("Cu", "fcc", a=3.6).repeat((3, 3, 2)),  # the primitive cell is skewed
    "slab": lambda: fcc111("Cu", (3, 3, 3), a=3.6, vacuum=3.0),  # periodic in x and y only
}


@pytest.mark.parametrize("name, prune", [(name, True) for name in STRUCTURES] + [("triclinic", False)])
def test_dynamics_with_a_skin_equal_a_new_search_every_step_also_when_atoms_are_wrapped(model, name, prune):
    """40 steps at 2,000 K across several rebuilds, the atoms put back into the cell after every step; with
    ``prune=False`` the model sees every candidate edge (as with ``cuda_graphs``)."""
    atoms = hot(STRUCTURES[name](), 2000)
    atoms.positions += 0.5 * atoms.cell.array.sum(0) * atoms.pbc  # half of them outside the cell
    calc = E3AttnCalculator(model, SPECIES, skin=0.3)
    calc.neighbour_list = VerletList(calc.max_radius, 0.3, prune=prune)
    reference = E3AttnCalculator(model, SPECIES, skin=0.0)
    atoms.calc = calc
    wrapped = []

    def check():
        before = atoms.positions.copy()
        atoms.wrap()
        wrapped.append(int((np.abs(atoms.positions - before) > 1.0).any(1).sum()))
        assert_same_results(calc, reference, atoms)

    dynamics = VelocityVerlet(atoms, timestep=2.0 * fs)
    dynamics.attach(check)
    dynamics.run(40)
    assert sum(wrapped) > 10  # atoms crossed the cell's faces, and the list followed them
    assert 2 < calc.neighbour_list.builds < 20  # rebuilt as atoms moved, not at every step
    assert reference.neighbour_list.builds == 41


def test_edges_beyond_the_cutoff_add_exactly_nothing():
    """The claim that makes a skin exact: the model on all candidates (up to r_max + skin) equals the model on
    the edges within r_max, for every radial basis, with density channels and with a node without neighbours."""
    atoms = hot(bulk("Cu", "fcc", a=3.6, cubic=True).repeat((2, 2, 2)), 300)
    atoms.positions[0] += [0.0, 0.0, 20.0]  # alone in a tall cell, only candidate edges
    atoms.set_cell(atoms.cell.array + np.diag([0.0, 0.0, 30.0]))
    pos, cell = torch.as_tensor(atoms.positions), torch.as_tensor(atoms.cell.array)
    node_attr = torch.nn.functional.one_hot(torch.as_tensor(atoms.numbers == 28).long(), 2).double()
    for basis in ["smooth_finite", "gaussian", "bessel"]:
        model = make_model(basis=basis, density_channels=4)
        results = []
        for r in [3.0, 3.0 + 1.5]:
            edge_index, shifts = radius_graph_pbc(pos, cell, True, r)
            results.append(energy_forces_stress(model, pos, cell=cell, node_attr=node_attr, edge_index=edge_index,
                                                shifts=shifts))
        assert results[1][0].shape == (1,) and bool(torch.isfinite(results[1][1]).all())
        for exact, with_candidates in zip(*results):
            torch.testing.assert_close(with_candidates, exact, rtol=1e-13, atol=1e-13)


def test_changes_of_cell_pbc_and_atoms_search_again(model):
    atoms = hot(STRUCTURES["cubic"](), 300)
    calc = E3AttnCalculator(model, SPECIES)
    reference = E3AttnCalculator(model, SPECIES, skin=0.0)
    atoms.calc = calc
    atoms.get_forces()
    atoms.positions += 0.01
    assert_same_results(calc, reference, atoms)
    assert calc.neighbour_list.builds == 1
    changes = [
        lambda a: a.set_cell(a.cell.array * 1.001, scale_atoms=False),  # no atom moves: only the cell
        lambda a: a.set_pbc([True, True, False]),
        lambda a: a.pop(),
        lambda a: a.set_chemical_symbols(["Cu"] * len(a)),  # elements only: the same search serves
    ]
    for builds, change in zip([2, 3, 4, 4], changes):
        change(atoms)
        assert_same_results(calc, reference, atoms)
        assert calc.neighbour_list.builds == builds


def test_wrapping_and_whole_lattice_translations_need_no_new_search():
    verlet = VerletList(2.0, skin=0.4)
    rng = np.random.default_rng(1)
    cell = np.array([[4.0, 0.0, 0.0], [1.0, 4.5, 0.0], [0.5, 0.3, 5.0]])
    pbc = np.array([True, True, False])
    positions = rng.uniform(0, 4, (12, 3))

    def search(positions, r):
        return radius_graph_pbc(torch.as_tensor(positions), torch.as_tensor(cell), pbc, r)

    def edge_set(edge_index, shifts, positions):
        vec = positions[edge_index[0]] - positions[edge_index[1]] + shifts.numpy() @ cell
        return sorted(map(tuple, np.round(np.c_[edge_index.T.numpy(), vec], 9)))

    for step in range(6):
        moved = positions + rng.normal(0.0, 0.03, positions.shape)
        moved += rng.integers(-2, 3, (12, 3)) * pbc @ cell  # every atom some lattice vectors away
        edges = verlet(moved, cell, pbc, torch.as_tensor(moved), torch.as_tensor(cell))
        assert edge_set(*edges, moved) == edge_set(*search(moved, 2.0), moved)
    assert verlet.builds == 1


def test_without_pruning_the_candidates_are_the_same_tensors_until_the_next_search():
    verlet = VerletList(2.0, skin=0.4, prune=False)
    rng = np.random.default_rng(2)
    cell, pbc = 5.0 * np.eye(3), np.array([True, True, True])
    positions = rng.uniform(0, 5, (16, 3))
    first = verlet(positions, cell, pbc, torch.as_tensor(positions), torch.as_tensor(cell))
    moved = positions + 0.05
    again = verlet(moved, cell, pbc, torch.as_tensor(moved), torch.as_tensor(cell))
    assert again[0] is first[0] and again[1] is first[1] and verlet.builds == 1
    within = radius_graph_pbc(torch.as_tensor(moved), torch.as_tensor(cell), pbc, 2.0)[0]
    assert within.shape[1] < again[0].shape[1]  # candidates beyond r_max too
    assert set(map(tuple, within.T.tolist())) <= set(map(tuple, again[0].T.tolist()))


@pytest.mark.parametrize("skin, prune", [(0.0, True), (0.4, True), (0.4, False)])
def test_a_wrapped_atom_changes_returned_shifts_only_without_pruning(skin, prune):
    """An atom moved back by a lattice vector: the shifts already returned stay as they were, except the
    candidates of ``prune=False``, which are updated in place (a recorded CUDA graph reads them)."""
    verlet = VerletList(2.0, skin=skin, prune=prune)
    cell, pbc = 5.0 * np.eye(3), np.array([True, True, True])
    positions = np.array([[0.5, 0.5, 0.5], [1.5, 0.5, 0.5], [4.6, 0.5, 0.5]])
    first = verlet(positions, cell, pbc, torch.as_tensor(positions), torch.as_tensor(cell))
    kept = first[1].clone()
    moved = positions.copy()
    moved[2] -= cell[0]
    again = verlet(moved, cell, pbc, torch.as_tensor(moved), torch.as_tensor(cell))
    assert verlet.builds == 1
    assert torch.equal(first[1], kept) == prune
    vectors = [moved[e[0]] - moved[e[1]] + s @ cell for e, s in zip(again[0].T.numpy(), again[1].numpy())]
    expected = [positions[e[0]] - positions[e[1]] + s @ cell for e, s in zip(first[0].T.numpy(), kept.numpy())]
    np.testing.assert_allclose(np.sort(np.linalg.norm(vectors, axis=1)), np.sort(np.linalg.norm(expected, axis=1)))


@pytest.mark.parametrize("value", [1, "yes", "auto"])
def test_cuda_graphs_must_be_none_or_a_bool_and_stay_off_on_the_cpu(model, value):
    with pytest.raises(ValueError, match="cuda_graphs must be None or a bool"):
        E3AttnCalculator(model, SPECIES, cuda_graphs=value)
    for graphs in (None, True):  # CPU: eager, the candidates pruned
        calc = E3AttnCalculator(model, SPECIES, cuda_graphs=graphs)
        assert calc._replayed is None and calc.neighbour_list.prune


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("graphs, compile, replayed", [(None, False, True), (True, False, False),
                                                       (False, False, None), (None, "eager", None)])
def test_cuda_graphs_by_default_on_cuda_adaptive(model, graphs, compile, replayed):
    calc = E3AttnCalculator(model, SPECIES, device="cuda", cuda_graphs=graphs, compile=compile)
    assert (calc._replayed.adaptive if calc._replayed is not None else None) == replayed
    assert calc.neighbour_list.prune == (replayed is None)
    assert E3AttnCalculator(model, SPECIES, device="cuda", skin=0.0)._replayed is None  # nothing to replay


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["triclinic", "slab"])
def test_cuda_graphs_replay_the_eager_results_across_searches(model, name):
    """MD on CUDA in float64: the replayed call equals the eager one (same device) at every step, across
    searches and wrapped atoms, also once the stress is asked for, and most steps are replays."""
    import copy

    atoms = hot(STRUCTURES[name](), 600)
    calc = E3AttnCalculator(copy.deepcopy(model), SPECIES, skin=0.3, device="cuda", cuda_graphs=True)
    reference = E3AttnCalculator(copy.deepcopy(model), SPECIES, skin=0.3, device="cuda", cuda_graphs=False)
    atoms.calc = calc
    dynamics = VelocityVerlet(atoms, timestep=2.0 * fs)
    previous = kernels.set_cuda_kernels(True)  # the eager reference on the kernels that the recordings run
    try:
        dynamics.attach(lambda: (atoms.wrap(), assert_same_results(calc, reference, atoms)))
        dynamics.run(30)
    finally:
        kernels.set_cuda_kernels(previous)
    replayed = calc._replayed
    assert replayed.failed is None
    # recorded anew at each search, and once more at the first call that asks for the stress (stress="when_asked":
    # MD asks for energy and forces first)
    assert replayed.captures == calc.neighbour_list.builds + 1 >= 3
    assert replayed.replays > 2 * replayed.captures


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_by_default_replay_the_triton_kernels_and_skip_a_cell_that_changes_every_call(
        model, monkeypatch):
    """The default (cuda_graphs=None) records at the first call after a search, on the Triton kernels; its
    results equal the eager plain formulation's in float64 to 1e-10. A cell that changes at every call (a
    barostat) is recorded once, then no more while no recording is replayed."""
    import copy

    import e3attn.kernels.segments_triton as segments_triton

    atoms = hot(STRUCTURES["triclinic"](), 600)
    calc = E3AttnCalculator(copy.deepcopy(model), SPECIES, skin=0.3, device="cuda")
    reference = E3AttnCalculator(copy.deepcopy(model), SPECIES, skin=0.3, device="cuda", cuda_graphs=False)
    calls, original = [], segments_triton.node_pass
    monkeypatch.setattr(segments_triton, "node_pass", lambda *args: calls.append(1) or original(*args))
    atoms.calc = calc
    for step in range(4):
        atoms.positions += 0.01 * step
        for name in ("energy", "forces"):
            np.testing.assert_allclose(calc.get_property(name, atoms), reference.get_property(name, atoms.copy()),
                                       rtol=1e-10, atol=1e-10, err_msg=name)
    assert calls  # the recordings and their eager calls ran the Triton kernels
    assert (calc._replayed.captures, calc._replayed.replays) == (1, 3)  # step 0 recorded, 1-3 replayed
    barostat = E3AttnCalculator(copy.deepcopy(model), SPECIES, skin=0.3, device="cuda")
    atoms.calc = barostat
    for step in range(4):
        atoms.set_cell(atoms.cell * 1.001, scale_atoms=True)
        atoms.get_forces()
    assert (barostat._replayed.captures, barostat._replayed.replays) == (1, 0)
    atoms.positions += 0.01  # a key that repeats: recorded at its second call, then replayed
    atoms.get_forces()
    atoms.positions += 0.01
    atoms.get_forces()
    atoms.positions += 0.01
    atoms.get_forces()
    assert (barostat._replayed.captures, barostat._replayed.replays) == (2, 2)


@pytest.mark.parametrize("skin", [-0.1, float("nan"), float("inf"), True, "0.5"])
def test_bad_skin_is_named(model, skin):
    with pytest.raises(ValueError, match="skin"):
        E3AttnCalculator(model, SPECIES, skin=skin)


def test_non_finite_positions_are_refused_also_between_searches(model):
    atoms = STRUCTURES["cubic"]()
    atoms.calc = E3AttnCalculator(model, SPECIES)
    atoms.get_potential_energy()
    atoms.positions[3, 1] = np.nan
    with pytest.raises(ValueError, match="NaN|finite"):
        atoms.get_potential_energy()

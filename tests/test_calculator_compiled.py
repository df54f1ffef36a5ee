"""The calculator's compiled call (``compile=``): the eager call's results, one graph across numbers of edges."""
import numpy as np
import pytest
import torch

pytest.importorskip("ase")
from ase import Atoms  # noqa: E402
from ase.build import bulk, molecule  # noqa: E402
from ase.md.verlet import VelocityVerlet  # noqa: E402
from ase.neighborlist import neighbor_list  # noqa: E402
from ase.units import fs  # noqa: E402

from e3attn.calculator import E3AttnCalculator  # noqa: E402
from test_neighbour_list import SPECIES, assert_same_results, hot, make_model  # noqa: E402


def graphs(calc):
    return {stress: len(traced.graphs) for stress, traced in calc._compiled.graphs.items()}


@pytest.mark.parametrize("backend", ["eager", pytest.param(True, marks=pytest.mark.slow)])
def test_dynamics_on_the_compiled_call_equal_the_eager_call_with_one_graph(backend):
    """20 steps at 2,000 K with a skin of 0.3 A: the edges change in number at every step (pruned to the cutoff)
    and the list is searched again several times; energies and forces are the eager call's to 1e-12 with one
    graph, the stress from the first call that asks for it with a second."""
    model = make_model()
    atoms = hot(bulk("Cu", "fcc", a=3.6).repeat((3, 3, 2)), 2000)
    calc = E3AttnCalculator(model, SPECIES, skin=0.3, compile=backend)
    reference = E3AttnCalculator(model, SPECIES, skin=0.0)
    atoms.calc = calc
    edges = []

    def check():
        for name in ["energy", "forces"]:
            expected = reference.get_property(name, atoms.copy())
            np.testing.assert_allclose(calc.get_property(name, atoms), expected, rtol=1e-12, atol=1e-12)
        edges.append(len(neighbor_list("i", atoms, calc.max_radius)))

    dynamics = VelocityVerlet(atoms, timestep=2.0 * fs)
    dynamics.attach(check)
    dynamics.run(20)
    assert len(set(edges)) > 10 and calc.neighbour_list.builds > 2
    assert graphs(calc) == {False: 1, True: 0}
    assert not isinstance(calc._compiled.graphs[False].graphs[0][2], torch.fx.GraphModule)  # compiled, kept
    assert_same_results(calc, reference, atoms)  # now with the stress
    assert graphs(calc) == {False: 1, True: 1}


def test_molecules_of_other_sizes_and_a_structure_without_edges_get_the_eager_results():
    """Sizes 0 and 1 are assumptions of a trace: a structure without edges, or with one atom, gets a graph of its
    own; molecules of other sizes share the first."""
    torch.manual_seed(1)
    model = make_model()
    calc = E3AttnCalculator(model, SPECIES, compile="eager")
    reference = E3AttnCalculator(model, SPECIES)
    structures = [Atoms("Cu6", positions=molecule("C6H6").positions[:6]), Atoms("CuNiCu", positions=[
        [0, 0, 0], [2.2, 0, 0], [0, 2.3, 0.4]]), Atoms("CuNi", positions=[[0, 0, 0], [5.0, 0, 0]]),
        Atoms("Ni", positions=[[0, 0, 0]]), Atoms("Cu6", positions=molecule("C6H6").positions[:6] * 1.05)]
    for atoms in structures:
        for name in ["energy", "forces"]:
            expected = reference.get_property(name, atoms.copy())
            np.testing.assert_allclose(calc.get_property(name, atoms.copy()), expected, rtol=1e-12, atol=1e-12)
    assert graphs(calc)[False] == 3  # 6 and 3 atoms; 2 atoms without edges; 1 atom


def test_the_compiled_call_follows_the_weights_and_bad_options_are_named():
    model = make_model()
    atoms = hot(bulk("Cu", "fcc", a=3.6, cubic=True), 300)
    calc = E3AttnCalculator(model, SPECIES, compile="eager")
    before = calc.get_potential_energy(atoms.copy())
    with torch.no_grad():
        model.output.weight.mul_(2.0)  # the graph takes the weights as inputs: no stale copy
    reference = E3AttnCalculator(model, SPECIES)
    calc.reset()  # ASE's cache of the same atoms
    after = calc.get_potential_energy(atoms.copy())
    assert after != before and after == pytest.approx(reference.get_potential_energy(atoms.copy()), rel=1e-12)
    for bad in (3, None):
        with pytest.raises(ValueError, match=f"compile must be a bool or a torch.compile backend's name, and not "
                                             f"with cuda_graphs, got compile={bad!r}"):
            E3AttnCalculator(model, SPECIES, compile=bad)
    with pytest.raises(ValueError, match="compile: backend must be a torch.compile backend .*, got 'nonsense'"):
        E3AttnCalculator(model, SPECIES, compile="nonsense")
    with pytest.raises(ValueError, match="got compile=True, cuda_graphs=True"):
        E3AttnCalculator(model, SPECIES, compile=True, cuda_graphs=True)

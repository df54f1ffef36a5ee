"""The calculator's compiled call (``compile=``): the eager call's results, one graph across numbers of edges."""
import contextlib

import numpy as np
import pytest
import torch

pytest.importorskip("ase")
from ase import Atoms  # noqa: E402
from ase.build import bulk, molecule  # noqa: E402
from ase.md.verlet import VelocityVerlet  # noqa: E402
from ase.neighborlist import neighbor_list  # noqa: E402
from ase.units import fs  # noqa: E402

from e3attn import _calculator_call  # noqa: E402
from e3attn._calculator_call import CompiledCall  # noqa: E402
from e3attn._tracing import edges_sorted_by_caller, sorted_by_destination, traced_step  # noqa: E402
from e3attn.calculator import E3AttnCalculator  # noqa: E402
from e3attn.graph import radius_graph_pbc  # noqa: E402
from e3attn.models import energy_forces_stress  # noqa: E402
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


def _destination_sorts(call: CompiledCall) -> int:
    """How many times the traced graph of ``call`` (without the stress) sorts the edges by destination."""
    (_, _, graph), = call.graphs[False].graphs
    return sum(node.target is torch.ops.e3attn.destination_order.default for node in graph.graph.nodes)


def test_the_calls_take_the_searchs_edges_as_sorted_and_equal_the_model_on_shuffled_edges(monkeypatch):
    """The neighbour search sorts the edges by destination, so the calculator's call (``call_values``, traced here)
    does not sort them again, where a trace, which cannot test the order, otherwise must; its results equal the
    model's on the same edges shuffled (which the model sorts itself) to 1e-12."""
    model = make_model().requires_grad_(False)
    atoms = hot(bulk("Cu", "fcc", a=3.6).repeat((3, 3, 2)), 300)
    pos, cell = torch.as_tensor(atoms.positions), torch.as_tensor(atoms.cell.array)
    edge_index, shifts = radius_graph_pbc(pos, cell, torch.as_tensor(atoms.pbc), model.max_radius)
    dst = edge_index[1]
    assert bool((dst[1:] >= dst[:-1]).all()) and len(set(dst.tolist())) == len(atoms)
    node_attr = torch.nn.functional.one_hot(torch.as_tensor([SPECIES.index(s) for s in atoms.symbols]), 2).double()
    call = CompiledCall(model, backend=None)
    values = call(pos, cell, node_attr, edge_index, shifts, with_stress=True)
    shuffle = torch.randperm(dst.shape[0], generator=torch.Generator().manual_seed(0))
    energy, forces, stress = energy_forces_stress(model, pos, cell=cell, node_attr=node_attr,
                                                  edge_index=edge_index[:, shuffle], shifts=shifts[shuffle])
    expected = torch.cat([energy[:1], forces.reshape(-1), stress.reshape(-1)])
    torch.testing.assert_close(values, expected.detach(), rtol=1e-12, atol=1e-12)
    call(pos, cell, node_attr, edge_index, shifts, with_stress=False)
    assert _destination_sorts(call) == 0
    monkeypatch.setattr(_calculator_call, "edges_sorted_by_caller", contextlib.nullcontext)
    unpromised = CompiledCall(model, backend=None)
    unpromised(pos, cell, node_attr, edge_index, shifts, with_stress=False)
    assert _destination_sorts(unpromised) == len(model.layers)  # each layer sorts: what the promise saves


def test_sorted_by_destination_tests_the_cpus_edges_unless_promised():
    unsorted, ascending = torch.tensor([1, 0, 2]), torch.tensor([0, 0, 2])
    assert sorted_by_destination(ascending) and not sorted_by_destination(unsorted)
    with edges_sorted_by_caller():
        assert sorted_by_destination(unsorted)  # taken as promised, not tested
    assert not sorted_by_destination(unsorted)
    with traced_step(1):
        assert not sorted_by_destination(ascending)  # a trace cannot read the values

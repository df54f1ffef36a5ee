"""A force-training step traced into one graph (make_fx) and compiled: the eager step's loss and gradients."""
import warnings

import pytest
import torch
from ase.build import molecule
from ase.calculators.singlepoint import SinglePointCalculator

from e3attn._tracing import traced_graphs, traced_step, tracing
from e3attn.kernels import segment_ops
from e3attn.models import EquivariantTransformer
from e3attn.train import collate, fit_references, loss_fn, predict, to_sample
from e3attn.train.compiled import CompiledStep

SPECIES = ["H", "C", "O"]
WEIGHTS = {"force_weight": 10.0, "loss": "huber", "huber_delta": 0.01}


def samples(count: int, seed: int, dtype) -> list:
    """Displaced ethanol molecules with random labels, their graphs within 2.5 A (their edges differ)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        atoms = molecule("CH3CH2OH")
        atoms.positions += 0.15 * torch.randn(len(atoms), 3, generator=gen, dtype=torch.float64).numpy()
        atoms.calc = SinglePointCalculator(atoms, energy=float(torch.randn(1, generator=gen)),
                                           forces=torch.randn(len(atoms), 3, generator=gen, dtype=torch.float64).numpy())
        sample = to_sample(atoms, SPECIES, 2.5)
        out.append({k: v.to(dtype) if v.is_floating_point() else v for k, v in sample.items()})
    return out


def model_and_units(data, dtype, hidden="8x0e + 4x1o"):
    torch.manual_seed(0)
    model = EquivariantTransformer("1x0e", hidden, "0e", 2.5, num_layers=2, num_heads=2, reduce="sum",
                                   irreps_node_attr="3x0e", density_channels=8, density_lmax=2, layer_norm="post",
                                   avg_num_neighbors=4.0).to(dtype)
    return model, fit_references(data, SPECIES)


def eager_loss_and_gradients(model, batch, units):
    model.zero_grad()
    loss = loss_fn(predict(model, batch, units, create_graph=True), batch, units, **WEIGHTS)
    loss.backward()
    return loss.detach(), [None if p.grad is None else p.grad.clone() for p in model.parameters()]


@pytest.mark.slow
@pytest.mark.parametrize("hidden", ["8x0e + 4x1o", "8x0e + 4x1o + 2x2e"])  # features of degree 2: the command's
def test_traced_step_gives_the_eager_loss_and_weight_gradients(hidden):
    data = samples(4, seed=0, dtype=torch.float64)
    model, units = model_and_units(data, torch.float64, hidden)
    step = CompiledStep(model, units, WEIGHTS, backend=None)  # the traced graph as it is
    batches = [collate(data[:2]), collate(data[2:]), collate(data[1:])]
    assert batches[0]["edge_index"].shape != batches[1]["edge_index"].shape
    for batch in batches + batches[:1]:  # other edges: the same graph; three structures: a graph of their own
        loss = step(batch)
        grads = [p.grad.clone() for p in model.parameters()]
        expected_loss, expected = eager_loss_and_gradients(model, batch, units)
        assert torch.allclose(loss, expected_loss, rtol=1e-12, atol=0)
        for name, g, e in zip([n for n, _ in model.named_parameters()], grads, expected):
            assert e.abs().max() > 0, name  # every weight has a gradient to compare
            assert torch.allclose(g, e, rtol=1e-10, atol=1e-12 * e.abs().max()), name
    assert [key[1] for key, _, _ in step.graphs.graphs] == [2, 3]


def _destination_sorts(graph) -> int:
    return sum(node.target is torch.ops.e3attn.destination_order.default for node in graph.graph.nodes)


def test_sorted_batches_run_a_graph_without_the_layers_sort_and_shuffled_ones_a_graph_with_it():
    """``collate``'s edges are sorted by destination: their graph does not sort them again (what a trace otherwise
    must, unable to test the order); a batch of the same edges shuffled gets a graph of its own that sorts them,
    and both give the eager step's loss and weight gradients."""
    data = samples(2, seed=1, dtype=torch.float64)
    model, units = model_and_units(data, torch.float64)
    step = CompiledStep(model, units, WEIGHTS, backend=None)
    batch = collate(data)
    dst = batch["edge_index"][1]
    assert bool((dst[1:] >= dst[:-1]).all())
    shuffle = torch.randperm(dst.shape[0], generator=torch.Generator().manual_seed(0))
    shuffled = {**batch, "edge_index": batch["edge_index"][:, shuffle], "shifts": batch["shifts"][shuffle]}
    for b in (batch, shuffled, batch):
        loss = step(b)
        grads = [p.grad.clone() for p in model.parameters()]
        expected_loss, expected = eager_loss_and_gradients(model, batch, units)
        assert torch.allclose(loss, expected_loss, rtol=1e-12, atol=0)
        for g, e in zip(grads, expected):
            assert torch.allclose(g, e, rtol=1e-10, atol=1e-12 * e.abs().max())
    assert [key[-1] for key, _, _ in step.graphs.graphs] == [True, False]  # sorted: the promise; shuffled: none
    assert [_destination_sorts(graph) for _, _, graph in step.graphs.graphs] == [0, len(model.layers)]


@pytest.mark.slow
def test_traced_step_on_isolated_atoms_and_a_batch_without_edges():
    """Sizes 0 and 1 are specialised by the trace: graphs of their own, each the eager step."""
    data = samples(2, seed=3, dtype=torch.float64)
    model, units = model_and_units(data, torch.float64)
    atoms = molecule("H2")
    atoms.positions[1, 2] = 4.0  # beyond the cutoff: no edges
    atoms.calc = SinglePointCalculator(atoms, energy=-1.0, forces=torch.ones(2, 3, dtype=torch.float64).numpy())
    lone = {k: v.to(torch.float64) if v.is_floating_point() else v for k, v in to_sample(atoms, SPECIES, 2.5).items()}
    assert lone["edge_index"].shape == (2, 0)
    step = CompiledStep(model, units, WEIGHTS, backend=None)
    for batch in [collate(data), collate([lone, lone]), collate(data)]:
        loss = step(batch)
        grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        expected_loss, expected = eager_loss_and_gradients(model, batch, units)
        assert torch.allclose(loss, expected_loss, rtol=1e-12, atol=0)
        assert [g is None for g in grads] == [e is None for e in expected]
        for g, e in zip(grads, expected):
            if e is not None:
                assert torch.allclose(g, e, rtol=1e-10, atol=1e-12 * e.abs().max().clamp_min(1e-300))
    assert len(step.graphs.graphs) == 2


def test_stress_is_refused_and_the_tracing_context_is_checked():
    data = samples(1, seed=1, dtype=torch.float64)
    model, units = model_and_units(data, torch.float64)
    batch = dict(collate(data), stress=torch.zeros(1, 3, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="batch: a compiled step trains on energies and forces, not stress"):
        CompiledStep(model, units, WEIGHTS, backend=None)(batch)
    with pytest.raises(ValueError, match="num_graphs must be a positive int, got 0"):
        with traced_step(0):
            pass
    assert not tracing() and traced_graphs() is None
    with traced_step(3):
        assert tracing() and traced_graphs() == 3
    assert not tracing() and traced_graphs() is None


def test_the_batch_is_checked_once_and_the_graphs_kernels_take_their_arguments_as_checked(monkeypatch):
    """The traced graph reads no values: the step checks the batch's, and its node kernels check nothing more
    (their checks would read ``rowptr`` and ``index`` at every call of every operator)."""
    data = samples(2, seed=2, dtype=torch.float64)
    model, units = model_and_units(data, torch.float64)
    step, batch = CompiledStep(model, units, WEIGHTS, backend=None), collate(data)
    calls = []
    real = segment_ops.node_arguments
    monkeypatch.setattr(segment_ops, "node_arguments", lambda *args: calls.append(1) or real(*args))
    expected = eager_loss_and_gradients(model, batch, units)[0]
    assert calls  # the eager step checks the kernels' arguments
    calls.clear()
    assert torch.allclose(step(batch), expected, rtol=1e-12, atol=0)
    assert not calls and not segment_ops._TRUSTED.get()  # none within the graph; trusted only while it ran
    bad = dict(batch, edge_index=batch["edge_index"].clone())
    bad["edge_index"][0, 0] = batch["pos"].shape[0]  # one row past the atoms: the kernels would read past x
    with pytest.raises(ValueError, match=r"edge_index has entries in \[0, 18\], outside the valid node range "
                                         r"\[0, 18\)"):
        step(bad)
    nan = dict(batch, pos=batch["pos"].clone())
    nan["pos"][3, 1] = float("nan")
    with pytest.raises(ValueError, match="pos"):
        step(nan)
    assert len(step.graphs.graphs) == 1 and not segment_ops._TRUSTED.get()


@pytest.mark.slow
def test_compiled_step_equals_the_eager_step_in_float32():
    """Compiled by inductor (its CPU code), float32: the eager step's loss and gradients to float32 rounding."""
    data = samples(2, seed=2, dtype=torch.float32)
    model, units = model_and_units(data, torch.float32)
    batch = collate(data)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = CompiledStep(model, units, WEIGHTS)(batch)
    assert not [w for w in caught if "failed on a traced graph" in str(w.message)]  # compiled, not run as traced
    grads = [p.grad.clone() for p in model.parameters()]
    expected_loss, expected = eager_loss_and_gradients(model, batch, units)
    assert torch.allclose(loss, expected_loss, rtol=1e-5, atol=0)
    largest = max(e.abs().max() for e in expected)  # a weight whose gradient vanishes holds rounding alone
    for g, e in zip(grads, expected):
        assert (g - e).abs().max() <= 1e-4 * e.abs().max() + 1e-6 * largest


@pytest.mark.slow
def test_the_command_trains_with_compiled_steps(tmp_path, capsys):
    """``e3attn-train --compile``: compiled steps, the last, smaller batch of an epoch left out (9 structures in
    batches of 4: 2 steps per epoch), a checkpoint and the printed errors."""
    from ase.io import write

    from e3attn.calculator import E3AttnCalculator
    from e3attn.train import cli

    structures = []
    for sample_seed in range(12):
        atoms = molecule("CH3CH2OH")
        gen = torch.Generator().manual_seed(sample_seed)
        atoms.positions += 0.1 * torch.randn(len(atoms), 3, generator=gen, dtype=torch.float64).numpy()
        atoms.calc = SinglePointCalculator(atoms, energy=float(torch.randn(1, generator=gen)),
                                           forces=torch.randn(len(atoms), 3, generator=gen, dtype=torch.float64).numpy())
        structures.append(atoms)
    write(tmp_path / "train.xyz", structures[:9])
    write(tmp_path / "test.xyz", structures[9:])
    steps = []
    original = CompiledStep.__call__
    CompiledStep.__call__ = lambda self, batch: steps.append(int(batch["num_atoms"].numel())) or original(self, batch)
    try:
        metrics = cli.main(["--train-file", str(tmp_path / "train.xyz"), "--test-file", str(tmp_path / "test.xyz"),
                            "--valid-fraction", "0", "--compile", "--hidden", "4x0e + 2x1o", "--heads", "1",
                            "--layers", "1", "--density", "4", "--epochs", "2", "--batch-size", "4", "--time-budget",
                            "0", "--device", "cpu", "--quiet", "--save", str(tmp_path / "model.pt")])
    finally:
        CompiledStep.__call__ = original
    assert steps == [4, 4, 4, 4] and metrics["epochs"] == 2
    assert "test: energy MAE" in capsys.readouterr().out
    assert E3AttnCalculator.from_checkpoint(tmp_path / "model.pt").species == ["H", "C", "O"]

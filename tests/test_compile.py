"""torch.compile of the layer on CPU: fullgraph, dynamic numbers of nodes and edges, same values and gradients.

One compilation (about a minute without inductor's cache) serves the check and the smoke test of
``benchmarks/compile.py``: the benchmark compares the compiled layer with the eager one in float64, on 2
threads, where inductor's parallel code once gave wrong position gradients and corrupted the heap (a
two-dimensional ``index_add``, see ``e3attn.attention._rows``).
"""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _benchmark(name):
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_compiled_layer_equals_eager_for_dynamic_edge_counts(tmp_path):
    args = ["--quick", "--dtype", "float64", "--threads", "2", "--out", str(tmp_path / "c.json")]
    report = _benchmark("compile").main(args)
    first, *later = report["results"]
    assert len({row["edges"] for row in report["results"]}) == 3 and later[-1]["edges"] > 32_766
    for row in later:
        assert row["recompiles"] == 0, f"{row['edges']} edges recompiled the layer"
    for row in report["results"]:
        assert row["max_abs_diff"] < 1e-12
        assert row["max_grad_rel_diff"] < 1e-12
        assert row["compiled_fwdbwd_ms"] > 0 and row["eager_fwdbwd_ms"] > 0
    assert (tmp_path / "c.json").exists()


def test_compiled_graph_runs_the_node_operators(float64_default):
    # the compiled forward and backward call the kernels' custom operators (not plain operations
    # storing the per-edge weights), with the same values and gradients as eager
    import torch
    from torch._dynamo.backends.common import aot_autograd

    from e3attn.attention import EquivariantAttention

    targets = []

    def record(gm, example_inputs):
        targets.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = EquivariantAttention("3x0e + 2x1o", "2x0e + 1x1o", "2x0e + 1x1o", "2x0e + 2x1o", 1.2, lmax=2,
                                 num_heads=1)
    compiled = torch.compile(layer, fullgraph=True, backend=aot_autograd(fw_compiler=record, bw_compiler=record))
    pos = torch.rand(10, 3, requires_grad=True)
    f = layer.irreps_input.randn(10, -1).requires_grad_()
    edge_index = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 2], [1, 0, 3, 2, 5, 4, 7, 7]])
    leaves = [f, pos, *layer.parameters()]
    outs = [model(f, pos, edge_index) for model in (layer, compiled)]
    grads = [torch.autograd.grad(out.pow(2).sum(), leaves) for out in outs]
    torch.testing.assert_close(outs[1], outs[0], atol=1e-12, rtol=0)
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, atol=1e-12, rtol=0)
    # on the CPU the layer contracts its radial weights at the nodes (e3attn.node_contraction)
    for op in ("path_features", "path_features_backward", "node_expand", "node_outer"):
        assert f"e3attn.{op}.default" in targets
    torch._dynamo.reset()


def test_destination_order_is_a_stable_argsort_opaque_to_the_compiler():
    import torch

    from e3attn.attention import _destination_order

    dst = torch.tensor([3, 1, 3, 0, 1, 1, 2])
    order = _destination_order(dst)
    assert order.tolist() == [3, 1, 4, 5, 6, 0, 2]  # ties keep their order
    torch.library.opcheck(_destination_order, (dst,))


@pytest.mark.slow
@pytest.mark.parametrize("self_connection", ["identity", "node_attr"])
def test_model_compiles_as_one_graph(float64_default, self_connection):
    """The models read no e3nn ``Irreps`` in ``forward`` (Dynamo cannot guard on them): the transformer, with its
    gates, layer norms and neighbour densities, is one graph, with eager's energy and gradients (with the
    self-connection also angular densities of a higher degree than the attention's harmonics)."""
    import torch

    from e3attn import radius_graph
    from e3attn.models import EquivariantTransformer

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = EquivariantTransformer("2x0e", "4x0e + 2x1o", "1x0e", max_radius=1.5, num_layers=1, num_heads=2, lmax=2,
                                   reduce="sum", density_channels=2, irreps_node_attr="3x0e",
                                   self_connection=self_connection, density_lmax=3 if self_connection == "node_attr" else 0)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    pos, x, attr = torch.rand(20, 3) * 2, torch.randn(20, 2), torch.eye(3)[torch.randint(0, 3, (20,))]
    edge_index = radius_graph(pos, 1.5)
    results = []
    for fn in (model, compiled):
        p = pos.clone().requires_grad_()
        energy = fn(p, x, node_attr=attr, edge_index=edge_index).sum()
        results.append((energy.detach(), torch.autograd.grad(energy, [p, *model.parameters()])))
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-12, rtol=0)
    for got, want in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def _compiled_equals_eager(fn, inputs):
    """``fn`` compiled with ``fullgraph=True`` (aot_eager: the same tracing as inductor, without its code
    generation) on inputs of changing sizes: eager's value and position gradient, one compilation."""
    import torch

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend="aot_eager")
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for pos, *rest in inputs:
        results = []
        for run in (fn, compiled):
            p = pos.clone().requires_grad_()
            energy = run(p, *rest)
            results.append((energy.detach(), torch.autograd.grad(energy, p)[0]))
        torch.testing.assert_close(results[1][0], results[0][0], atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(results[1][1], results[0][1], atol=1e-12, rtol=1e-12)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - frames == 1  # fullgraph, no recompilation
    torch._dynamo.reset()


@pytest.mark.slow
def test_function_building_its_graph_compiles_fullgraph(float64_default):
    """The radius graph and the layer in one compiled function: the number of edges is data-dependent, so no check
    may branch on it while tracing (the layer's checks, the kernels' backward, the harmonics' backward)."""
    import torch

    import e3attn

    torch.manual_seed(0)
    layer = e3attn.EquivariantAttention("4x0e + 1x1o", "4x0e", "4x0e", "4x0e", max_radius=1.5, lmax=1)

    def energy(pos, feats):
        edge_index = e3attn.radius_graph(pos, 1.5)
        return layer(feats, pos, edge_index, edge_vec=pos[edge_index[0]] - pos[edge_index[1]]).pow(2).sum()

    _compiled_equals_eager(energy, [(torch.rand(n, 3) * 2, torch.randn(n, 7)) for n in (10, 17, 31)])


@pytest.mark.slow
def test_model_building_its_graph_compiles_fullgraph(float64_default):
    """EquivariantTransformer(pos) builds its own radius graph (per molecule of ``batch``) inside the compiled
    region."""
    import torch

    from e3attn.models import EquivariantTransformer

    torch.manual_seed(0)
    model = EquivariantTransformer("2x0e", "4x0e + 2x1o", "1x0e", max_radius=1.5, num_layers=1, num_heads=2, lmax=2,
                                   reduce="sum")
    inputs = [(torch.rand(n, 3) * 2, torch.randn(n, 2), torch.arange(n) * 2 // n) for n in (10, 17, 31)]
    _compiled_equals_eager(lambda pos, x, batch: model(pos, x, batch=batch).sum(), inputs)


@pytest.mark.slow
def test_periodic_model_building_its_graph_compiles_fullgraph(float64_default):
    """radius_graph_pbc, edge_vectors and the model in one compiled function."""
    import torch

    import e3attn
    from e3attn.models import EquivariantTransformer, edge_vectors

    torch.manual_seed(0)
    model = EquivariantTransformer("1x0e", "4x0e + 2x1o", "0e", max_radius=1.5, num_layers=1, reduce="sum")
    cell = torch.tensor([[2.5, 0.0, 0.0], [0.3, 2.4, 0.0], [0.0, -0.2, 2.6]])

    def energy(pos):
        edge_index, shifts = e3attn.radius_graph_pbc(pos, cell, [True, True, False], 1.5)
        return model(pos, None, None, edge_index, edge_vectors(pos, edge_index, shifts, cell)).sum()

    _compiled_equals_eager(energy, [(torch.rand(n, 3) * 2.5,) for n in (6, 9, 13)])

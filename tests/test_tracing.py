"""Graphs traced with symbolic sizes (e3attn._tracing.TracedGraphs): reused wherever their guards hold."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import e3attn._tracing as tracing_module
from e3attn._tracing import TracedGraphs, cpu_inductor_options, index_adds_as_calls, traced_graphs


def test_one_graph_serves_other_sizes_and_sizes_equal_by_chance_stay_apart():
    calls = []

    def fn(x, y):
        calls.append(1)  # runs only while tracing
        return x.sum(0) * y.shape[0], y.sum(0)

    traced = TracedGraphs(fn, num_graphs=lambda x, y: 1)
    for n, m in [(3, 3), (4, 6), (7, 2), (3, 3)]:
        x, y = torch.randn(n, 2), torch.randn(m, 5)
        a, b = traced(x, y)
        assert torch.equal(a, x.sum(0) * m) and torch.equal(b, y.sum(0))
    assert len(traced.graphs) == 1 and len(calls) == 1  # x and y had 3 rows each when traced: not tied


def test_a_branch_on_a_size_is_a_guard_and_another_size_traces_again():
    def fn(x):
        return 2 * x if x.shape[0] > 3 else -x

    traced = TracedGraphs(fn, num_graphs=lambda x: 1)
    x = torch.arange(5.0)
    assert torch.equal(traced(x), 2 * x)
    assert torch.equal(traced(x[:2]), -x[:2])  # the first graph's guard (more than 3) fails
    assert torch.equal(traced(torch.arange(9.0)), 2 * torch.arange(9.0))
    assert len(traced.graphs) == 2


def test_dtype_and_number_of_graphs_are_part_of_the_key_and_arguments_are_tensors():
    traced = TracedGraphs(lambda x, batch: x * traced_graphs(), num_graphs=lambda x, batch: int(batch.max()) + 1)
    x = torch.ones(4, dtype=torch.float64)
    assert torch.equal(traced(x, torch.tensor([0, 0, 1, 1])), 2 * x)
    assert torch.equal(traced(x, torch.tensor([0, 1, 2, 2])), 3 * x)
    assert traced(x.float(), torch.tensor([0, 0, 0, 1])).dtype == torch.float32
    assert len(traced.graphs) == 3
    with pytest.raises(TypeError, match=r"every argument must be a tensor .*; leaf 1 \(from 0\) is a int"):
        traced(x, 2)


def test_a_graph_that_does_not_compile_runs_traced_with_a_warning():
    def failing(gm, example_inputs):
        raise RuntimeError("no compiler here\nsecond line")

    before = torch.are_deterministic_algorithms_enabled()
    traced = TracedGraphs(lambda x: x + 1, num_graphs=lambda x: 1, backend=failing)
    with pytest.warns(UserWarning, match="failed on a traced graph, which runs uncompiled: .*no compiler here$"):
        assert torch.equal(traced(torch.zeros(3)), torch.ones(3))
    assert torch.equal(traced(torch.zeros(4)), torch.ones(4))  # the traced graph, kept
    assert torch.are_deterministic_algorithms_enabled() == before  # as it was before the compile
    with pytest.raises(ValueError, match=r"backend must be a torch.compile backend \(torch._dynamo.list_backends\(\)\),"
                                         r" got 'nonsense'"):
        TracedGraphs(lambda x: x, num_graphs=lambda x: 1, backend="nonsense")


@pytest.mark.parametrize("backend, options, first", [
    ("inductor", "the options that inductor has", "e3attn.index_add.default"),
    ("eager", None, "aten.index_add.default")])
def test_inductor_compiles_cpu_graphs_with_its_cpp_wrapper_and_index_adds_as_calls(monkeypatch, backend, options,
                                                                                    first):
    asked, targets = [], []

    def fake_compile(graph, **kwargs):
        asked.append(kwargs)
        targets.extend(str(node.target) for node in graph.graph.nodes if "index_add" in str(node.target))
        return graph  # runs as traced: this test is about what is asked of torch.compile

    monkeypatch.setattr(torch, "compile", fake_compile)
    index = torch.tensor([0, 2, 0])
    traced = TracedGraphs(lambda x, y: (x + 1).index_add(0, index, y).index_add(0, index, 2 * y, alpha=3.0),
                          num_graphs=lambda x, y: 1, backend=backend)
    x, y = torch.randn(3, 2, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64)
    expected = (x + 1).index_add(0, index, y).index_add(0, index, 2 * y, alpha=3.0)
    assert torch.allclose(traced(x, y), expected, rtol=0, atol=1e-14)
    if options is not None:  # on torch 2.13: {"cpp_wrapper": True, "cpp_wrapper_build_separate": True}
        options = cpu_inductor_options()
        assert options["cpp_wrapper"] is True
    assert asked == [dict(backend=backend, dynamic=True, options=options)]
    assert targets == [first, "aten.index_add.default"]  # with alpha, an index_add stays as it is


def test_index_adds_as_calls_keeps_the_values_and_their_sizes_symbolic():
    graph = make_fx(lambda x, i, y: x.index_add(1, i, y).sum(0), tracing_mode="symbolic")(
        torch.zeros(2, 4), torch.tensor([3, 0, 3]), torch.ones(2, 3))
    assert index_adds_as_calls(graph) == 1 and index_adds_as_calls(graph) == 0
    for rows, cols, edges in [(2, 4, 3), (5, 7, 11)]:
        x, y = torch.randn(rows, cols), torch.randn(rows, edges)
        i = torch.randint(0, cols, (edges,))
        assert torch.equal(graph(x, i, y), x.index_add(1, i, y).sum(0))


def test_only_the_options_that_inductor_has_are_asked_for(monkeypatch):
    monkeypatch.setattr(tracing_module, "CPU_INDUCTOR_OPTIONS", {"cpp_wrapper": True, "no_such_option": 1})
    assert cpu_inductor_options() == {"cpp_wrapper": True}


def test_the_graphs_run_in_inference_mode_and_return_normal_tensors():
    modes = []

    def backend(graph, example_inputs):
        def run(*args):
            modes.append(torch.is_inference_mode_enabled())
            return graph(*args)

        return run

    for traced in (TracedGraphs(lambda x: {"y": 2 * x}, num_graphs=lambda x: 1, backend=backend),
                   TracedGraphs(lambda x: {"y": 2 * x}, num_graphs=lambda x: 1)):  # the traced graph as it is
        for _ in range(2):  # the first call (tracing, compiling) and a later one
            out = traced(torch.ones(3))["y"]
            assert not out.is_inference() and not torch.is_inference_mode_enabled()
            out.add_(1)  # a normal tensor: updated in place outside inference mode
            assert torch.equal(out, torch.full((3,), 3.0))
    assert modes == [True, True]

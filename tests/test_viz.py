"""Tests of e3attn.viz against plain loops, numpy and networkx."""
import configparser
import importlib.util
import pathlib
import re
import sys

import numpy as np
import pytest
import torch

from e3attn.viz.graph import attention_centrality, attention_graph
from e3attn.viz.matrix import attention_matrix, attention_rollout
from e3attn.viz.plots import plot_attention_graph, plot_attention_heatmap, plot_rollout
from e3attn.viz.record import AttentionRecord, record_attention
from e3attn.viz.sparsify import sparsify

nx = pytest.importorskip("networkx")
matplotlib = pytest.importorskip("matplotlib")

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "attention_graph.py"


def random_attention(num_nodes, num_edges, num_heads, seed, dtype=torch.float64):
    """Random edges (self-loops and duplicates allowed) with positive weights."""
    generator = torch.Generator().manual_seed(seed)
    edge_index = torch.randint(0, num_nodes, (2, num_edges), generator=generator)
    alpha = torch.rand(num_edges, num_heads, generator=generator, dtype=dtype)
    return edge_index, alpha


def dense_by_loop(edge_index, alpha, num_nodes):
    """[H, N, N] with A[h, dst, src] += alpha[e, h], written as plain loops."""
    alpha = alpha.reshape(alpha.shape[0], -1).tolist()
    num_heads = len(alpha[0]) if alpha else 1
    out = np.zeros((num_heads, num_nodes, num_nodes))
    for (src, dst), weights in zip(edge_index.t().tolist(), alpha):
        for h, w in enumerate(weights):
            out[h, dst, src] += w
    return out


# ----------------------------------------------------------------------------- attention_matrix


def test_attention_matrix_matches_loop_and_row_sums():
    edge_index, alpha = random_attention(7, 40, 3, seed=0)
    matrix = attention_matrix(edge_index, alpha, 7)
    assert matrix.shape == (3, 7, 7) and matrix.dtype == torch.float64
    np.testing.assert_allclose(matrix.numpy(), dense_by_loop(edge_index, alpha, 7), rtol=0, atol=1e-14)
    node_sums = np.zeros((3, 7))
    for e, dst in enumerate(edge_index[1].tolist()):
        node_sums[:, dst] += alpha[e].numpy()
    np.testing.assert_allclose(matrix.sum(dim=2).numpy(), node_sums, rtol=0, atol=1e-13)


def test_attention_matrix_softmax_rows_sum_to_one():
    edge_index = torch.tensor([[1, 2, 0, 2, 1], [0, 0, 1, 1, 2]])
    scores = torch.tensor([0.3, -1.2, 2.0, 0.1, 0.7], dtype=torch.float64)
    alpha = torch.empty_like(scores)
    for node in range(3):
        mask = edge_index[1] == node
        alpha[mask] = torch.softmax(scores[mask], dim=0)
    matrix = attention_matrix(edge_index, alpha, 3)
    assert matrix.shape == (1, 3, 3)
    np.testing.assert_allclose(matrix[0].sum(dim=1).numpy(), np.ones(3), atol=1e-15)
    assert matrix[0, 0, 2] == alpha[1] and matrix[0, 2, 1] == alpha[4]


def test_attention_matrix_duplicates_empty_and_isolated():
    edge_index = torch.tensor([[1, 1], [0, 0]])
    assert attention_matrix(edge_index, torch.tensor([0.25, 0.5]), 3)[0, 0, 1] == 0.75
    empty = attention_matrix(torch.zeros(2, 0, dtype=torch.long), torch.zeros(0, 2), 4)
    assert empty.shape == (2, 4, 4) and not empty.any()
    assert attention_matrix(torch.zeros(2, 0, dtype=torch.long), torch.zeros(0), 0).shape == (1, 0, 0)


@pytest.mark.parametrize(
    "edge_index, alpha, num_nodes, match",
    [
        (torch.tensor([[0, 1], [1, 0]]), torch.rand(3), 2, "alpha must have shape"),
        (torch.tensor([[0, 1], [1, 0]]), torch.rand(2, 0), 2, "alpha must have shape"),
        (torch.tensor([[0, 1], [1, 0]]), torch.tensor([0.5, -0.1]), 2, "alpha must be non-negative"),
        (torch.tensor([[0, 1], [1, 0]]), torch.tensor([0.5, float("nan")]), 2, "alpha contains NaN"),
        (torch.tensor([[0, 1], [1, 0]]), torch.tensor([1, 2]), 2, "alpha must be a floating-point"),
        (torch.tensor([[0, 5], [1, 0]]), torch.rand(2), 2, "edge_index has entries"),
        (torch.tensor([0, 1]), torch.rand(2), 2, r"edge_index must have shape \[2, E\]"),
        (torch.tensor([[0, 1], [1, 0]]), torch.rand(2), -1, "num_nodes must be a non-negative int"),
    ],
)
def test_bad_input_raises_value_error(edge_index, alpha, num_nodes, match):
    with pytest.raises(ValueError, match=match):
        attention_matrix(edge_index, alpha, num_nodes)


# ----------------------------------------------------------------------------- attention_graph


def test_attention_graph_round_trips_to_matrix():
    edge_index, alpha = random_attention(6, 30, 2, seed=1)
    graph = attention_graph(edge_index, alpha, 9)  # nodes 6, 7, 8 have no edges
    assert isinstance(graph, nx.DiGraph) and list(graph.nodes) == list(range(9))
    assert graph.graph["num_heads"] == 2
    matrix = attention_matrix(edge_index, alpha, 9).numpy()
    for h in range(2):
        # networkx puts src in the row, e3attn puts the query dst in the row
        adjacency = nx.to_numpy_array(graph, nodelist=range(9), weight=f"weight_h{h}")
        np.testing.assert_allclose(adjacency.T, matrix[h], rtol=0, atol=1e-14)
    mean = nx.to_numpy_array(graph, nodelist=range(9), weight="weight")
    np.testing.assert_allclose(mean.T, matrix.mean(axis=0), rtol=0, atol=1e-14)
    pairs = {(s, d) for s, d in edge_index.t().tolist()}
    assert set(graph.edges) == pairs  # duplicates merged, self-loops kept


def test_attention_graph_labels_and_inferred_size():
    edge_index = torch.tensor([[1, 2], [0, 0]])
    graph = attention_graph(edge_index, torch.tensor([0.5, 0.5]))
    assert graph.number_of_nodes() == 3 and graph.edges[1, 0] == {"weight_h0": 0.5, "weight": 0.5}
    labelled = attention_graph(edge_index, torch.tensor([0.5, 0.5]), node_labels=["O", "H", "H", "X"])
    assert [labelled.nodes[n]["label"] for n in labelled] == ["O", "H", "H", "X"]
    assert attention_graph(torch.zeros(2, 0, dtype=torch.long), torch.zeros(0)).number_of_nodes() == 0
    with pytest.raises(ValueError, match="node_labels must have one label per node"):
        attention_graph(edge_index, torch.tensor([0.5, 0.5]), 3, node_labels=["O"])


def test_missing_networkx_gives_install_hint(monkeypatch):
    """The hint is a command that works: e3attn is not on PyPI, so not ``pip install e3attn[viz]``."""
    monkeypatch.setitem(sys.modules, "networkx", None)
    with pytest.raises(ImportError, match=r"attention_graph needs networkx: pip install matplotlib networkx") as info:
        attention_graph(torch.tensor([[0], [1]]), torch.ones(1))
    assert "e3attn[viz]" not in str(info.value) and "pip install -e '.[viz]'" in str(info.value)
    config = configparser.ConfigParser()
    config.read(pathlib.Path(__file__).resolve().parents[1] / "setup.cfg")
    extra = {re.split(r"[<>=]", line)[0] for line in config["options.extras_require"]["viz"].split()}
    assert extra == {"matplotlib", "networkx"}  # the packages the hint installs


# ----------------------------------------------------------------------------- rollout


def numpy_rollout(layers, num_nodes, residual):
    """Dense Abnar & Zuidema rollout: R = A'_L ... A'_1 with plain numpy."""
    rollout = np.eye(num_nodes)
    for edge_index, alpha in layers:
        a = dense_by_loop(edge_index, alpha, num_nodes).mean(axis=0)
        if residual:
            a = 0.5 * a + 0.5 * np.eye(num_nodes)
        rows = a.sum(axis=1, keepdims=True)
        a = np.divide(a, rows, out=np.zeros_like(a), where=rows > 0)
        rollout = a @ rollout
    return rollout


def test_rollout_three_layers_equals_dense_product():
    # three layers on different graphs and head counts; node 4 attends to nothing in layer 2
    layers = [
        random_attention(5, 14, 2, seed=2),
        (torch.tensor([[0, 1, 2, 3, 0, 4], [1, 0, 0, 2, 3, 3]]), torch.rand(6, 1, dtype=torch.float64)),
        random_attention(5, 9, 4, seed=3),
    ]
    for residual in (True, False):
        expected = numpy_rollout(layers, 5, residual)
        result = attention_rollout(layers, 5, residual=residual)
        assert result.shape == (5, 5) and result.dtype == torch.float64
        np.testing.assert_allclose(result.numpy(), expected, rtol=0, atol=1e-14)
    assert torch.allclose(attention_rollout(layers, 5).sum(dim=1), torch.ones(5, dtype=torch.float64), atol=1e-14)


def test_rollout_hand_computed_two_nodes():
    # each node attends fully to the other: A = [[0, 1], [1, 0]]; with the residual A' = 1/2 everywhere
    layer = (torch.tensor([[1, 0], [0, 1]]), torch.ones(2))
    assert torch.equal(attention_rollout([layer], 2), torch.full((2, 2), 0.5))
    assert torch.equal(attention_rollout([layer, layer, layer], 2, residual=False), torch.tensor([[0.0, 1], [1, 0]]))


def test_rollout_accepts_records_and_empty_list():
    edge_index, alpha = random_attention(4, 10, 2, seed=4)
    records = [AttentionRecord("a", edge_index, alpha), AttentionRecord("b", edge_index, alpha)]
    assert torch.equal(attention_rollout(records, 4), attention_rollout([(edge_index, alpha)] * 2, 4))
    assert torch.equal(attention_rollout([], 3), torch.eye(3))
    with pytest.raises(ValueError, match=r"attentions\[0\] must be an \(edge_index, alpha\) pair"):
        attention_rollout([edge_index], 4)
    with pytest.raises(ValueError, match=r"attentions\[1\] alpha must be non-negative"):
        attention_rollout([(edge_index, alpha), (edge_index, -alpha)], 4)


# ----------------------------------------------------------------------------- centrality


@pytest.mark.parametrize("seed", [5, 6])
@pytest.mark.parametrize("reverse", [False, True])
def test_centrality_equals_networkx(seed, reverse):
    edge_index, alpha = random_attention(8, 20, 3, seed=seed)  # sparse: some dangling and isolated nodes
    alpha[0] = 0.0  # an edge of weight zero
    graph = attention_graph(edge_index, alpha, 10)
    result = attention_centrality(edge_index, alpha, 10, reverse=reverse, damping=0.8, tol=1e-15)
    reference = nx.pagerank(graph.reverse() if reverse else graph, alpha=0.8, tol=1e-15, max_iter=10_000)
    np.testing.assert_allclose(result["pagerank"].numpy(), [reference[n] for n in range(10)], rtol=0, atol=1e-13)
    assert abs(float(result["pagerank"].sum()) - 1.0) < 1e-13
    in_degree = dict(graph.in_degree(weight="weight"))
    out_degree = dict(graph.out_degree(weight="weight"))
    np.testing.assert_allclose(result["in_degree"].numpy(), [in_degree[n] for n in range(10)], atol=1e-14)
    np.testing.assert_allclose(result["out_degree"].numpy(), [out_degree[n] for n in range(10)], atol=1e-14)


def test_centrality_edge_cases():
    single = attention_centrality(torch.tensor([[0], [0]]), torch.ones(1, dtype=torch.float32), 1)
    assert single["pagerank"].dtype == torch.float32 and torch.equal(single["pagerank"], torch.ones(1))
    assert torch.equal(single["in_degree"], torch.ones(1)) and torch.equal(single["out_degree"], torch.ones(1))
    empty = attention_centrality(torch.zeros(2, 0, dtype=torch.long), torch.zeros(0), 0)
    assert all(value.shape == (0,) for value in empty.values())
    no_edges = attention_centrality(torch.zeros(2, 0, dtype=torch.long), torch.zeros(0), 4)
    assert torch.allclose(no_edges["pagerank"], torch.full((4,), 0.25))
    with pytest.raises(ValueError, match="damping must be in"):
        attention_centrality(torch.tensor([[0], [0]]), torch.ones(1), 1, damping=1.0)
    with pytest.raises(ValueError, match="max_iter must be a positive int"):
        attention_centrality(torch.tensor([[0], [0]]), torch.ones(1), 1, max_iter=0)


# ----------------------------------------------------------------------------- sparsify


def kept_by_brute_force(edge_index, score, threshold, top_k):
    """Edge ids kept: score >= threshold and among the top_k of their dst (ties: lower edge id first)."""
    kept = []
    for e, (_, dst) in enumerate(edge_index.t().tolist()):
        if threshold is not None and score[e] < threshold:
            continue
        if top_k is not None:
            rivals = [f for f, d in enumerate(edge_index[1].tolist()) if d == dst]
            rivals.sort(key=lambda f: (-score[f], f))
            if e not in rivals[:top_k]:
                continue
        kept.append(e)
    return kept


@pytest.mark.parametrize("threshold, top_k", [(0.5, None), (None, 2), (0.3, 2), (None, 0), (2.0, None)])
def test_sparsify_keeps_the_right_edges(threshold, top_k):
    edge_index, alpha = random_attention(6, 40, 2, seed=7)
    alpha[3] = alpha[5]  # ties
    score = alpha.mean(dim=1).tolist()
    kept = kept_by_brute_force(edge_index, score, threshold, top_k)
    new_index, new_alpha = sparsify(edge_index, alpha, threshold=threshold, top_k=top_k, renormalize=False)
    assert torch.equal(new_index, edge_index[:, kept]) and torch.equal(new_alpha, alpha[kept])


def test_sparsify_renormalises_to_the_original_node_sums():
    edge_index, alpha = random_attention(6, 40, 3, seed=8)
    new_index, new_alpha = sparsify(edge_index, alpha, top_k=2)
    kept = kept_by_brute_force(edge_index, alpha.mean(dim=1).tolist(), None, 2)
    for node in range(6):
        before = alpha[edge_index[1] == node].sum(dim=0)
        after = new_alpha[new_index[1] == node].sum(dim=0)
        np.testing.assert_allclose(after.numpy(), before.numpy(), rtol=1e-14)
        ratio = new_alpha[new_index[1] == node] / alpha[kept][new_index[1] == node]
        assert torch.allclose(ratio, ratio[:1].expand_as(ratio), rtol=1e-13)  # one factor per node and head


def test_sparsify_one_head_shape_and_errors():
    edge_index = torch.tensor([[1, 2, 3, 0], [0, 0, 0, 1]])
    new_index, new_alpha = sparsify(edge_index, torch.tensor([0.5, 0.3, 0.2, 1.0]), threshold=0.25)
    assert torch.equal(new_index, torch.tensor([[1, 2, 0], [0, 0, 1]]))
    assert torch.allclose(new_alpha, torch.tensor([0.625, 0.375, 1.0]))
    with pytest.raises(ValueError, match="needs threshold or top_k"):
        sparsify(edge_index, torch.rand(4))
    with pytest.raises(ValueError, match="top_k must be a non-negative int"):
        sparsify(edge_index, torch.rand(4), top_k=-1)
    with pytest.raises(ValueError, match="threshold must be a number"):
        sparsify(edge_index, torch.rand(4), threshold="0.1")


# ----------------------------------------------------------------------------- plots


def images(fig):
    return [image for ax in fig.axes for image in ax.images]


def test_plot_heatmap_one_image_per_head(tmp_path):
    edge_index, alpha = random_attention(5, 12, 3, seed=9)
    matrix = attention_matrix(edge_index, alpha, 5)
    fig = plot_attention_heatmap(matrix, labels=list("CCOHH"))
    assert len(images(fig)) == 3
    for h, image in enumerate(images(fig)):
        np.testing.assert_array_equal(image.get_array(), matrix[h].numpy())
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == list("CCOHH")
    fig.savefig(tmp_path / "heatmap.png", dpi=50)
    assert (tmp_path / "heatmap.png").stat().st_size > 0
    assert len(images(plot_attention_heatmap(matrix[0].numpy()))) == 1
    with pytest.raises(ValueError, match="matrix must have shape"):
        plot_attention_heatmap(torch.rand(3, 4))
    with pytest.raises(ValueError, match="matrix must be non-negative"):
        plot_attention_heatmap(-torch.rand(3, 3))
    with pytest.raises(ValueError, match="labels must have one label per node"):
        plot_attention_heatmap(matrix, labels=["C"])


def test_plot_rollout_one_panel_per_layer(tmp_path):
    layers = [random_attention(4, 10, 2, seed=s) for s in (10, 11, 12)]
    fig = plot_rollout(layers, 4, labels=list("abcd"))
    assert len(images(fig)) == 3
    np.testing.assert_allclose(images(fig)[-1].get_array(), attention_rollout(layers, 4).numpy(), atol=1e-14)
    np.testing.assert_allclose(images(fig)[0].get_array(), attention_rollout(layers[:1], 4).numpy(), atol=1e-14)
    titles = [ax.get_title() for ax in fig.axes if ax.images]
    assert titles == ["rollout to layer 1", "rollout to layer 2", "rollout to layer 3"]
    records = [AttentionRecord(f"block{i}", *layer) for i, layer in enumerate(layers)]
    assert [ax.get_title() for ax in plot_rollout(records, 4).axes if ax.images][0] == "rollout to block0"
    fig.savefig(tmp_path / "rollout.png", dpi=50)
    assert (tmp_path / "rollout.png").stat().st_size > 0
    with pytest.raises(ValueError, match="attentions must hold at least one layer"):
        plot_rollout([], 4)


def test_plot_graph_2d_draws_every_edge(tmp_path):
    from matplotlib.collections import PathCollection
    from matplotlib.patches import FancyArrowPatch

    edge_index, alpha = random_attention(5, 12, 2, seed=13)
    graph = attention_graph(edge_index, alpha, 6, node_labels=list("CCOHHH"))
    fig = plot_attention_graph(graph)
    ax = fig.axes[0]
    arrows = [a for a in ax.patches if isinstance(a, FancyArrowPatch)]
    assert len(arrows) == graph.number_of_edges()
    nodes = [c for c in ax.collections if isinstance(c, PathCollection)]
    assert len(nodes) == 1 and len(nodes[0].get_offsets()) == 6
    assert sorted(t.get_text() for t in ax.texts) == sorted("CCOHHH")
    widths = [a.get_linewidth() for a in arrows]
    weights = [w for _, _, w in graph.edges(data="weight")]
    assert int(np.argmax(widths)) == int(np.argmax(weights))
    fig.savefig(tmp_path / "graph2d.png", dpi=50)
    assert (tmp_path / "graph2d.png").stat().st_size > 0
    # the same from edge_index + alpha, for one head, with fixed 2-D positions
    fixed = plot_attention_graph(edge_index, alpha, torch.rand(6, 2), head=1)
    assert len([a for a in fixed.axes[0].patches if isinstance(a, FancyArrowPatch)]) == graph.number_of_edges()


def test_plot_graph_3d_segments_and_points(tmp_path):
    from mpl_toolkits.mplot3d.art3d import Line3DCollection, Path3DCollection

    edge_index = torch.tensor([[1, 2, 0, 2, 1, 3], [0, 0, 1, 1, 1, 3]])  # (1, 1) and (3, 3) are self-loops
    alpha = torch.tensor([0.2, 0.8, 0.3, 0.6, 0.1, 1.0])
    pos = torch.tensor([[0.0, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 2]])
    fig = plot_attention_graph(edge_index, alpha, pos, node_labels=["O", "H", "H", "X"])
    drawn = [(u, v) for u, v in attention_graph(edge_index, alpha).edges if u != v]
    strongest = drawn.index((2, 0))
    ax = fig.axes[0]
    lines = [c for c in ax.collections if isinstance(c, Line3DCollection)]
    points = [c for c in ax.collections if isinstance(c, Path3DCollection)]
    assert len(lines) == 1 and len(points) == 1
    assert len(lines[0].get_linewidths()) == 4  # one per segment: self-loops are not drawn
    assert len(points[0].get_offsets()) == 4
    # edge 2 -> 0 runs from the midpoint of the pair to the query, node 0 (no public getter for 3-D segments)
    np.testing.assert_allclose(np.asarray(lines[0]._segments3d[strongest]), [[0, 0.5, 0], [0, 0, 0]])
    widths = lines[0].get_linewidths()
    assert widths[strongest] == max(widths) and widths[drawn.index((2, 1))] < widths[strongest]
    fig.savefig(tmp_path / "graph3d.png", dpi=50)
    assert (tmp_path / "graph3d.png").stat().st_size > 0
    with pytest.raises(ValueError, match="pos must have shape"):
        plot_attention_graph(edge_index, alpha, torch.rand(4, 4))
    with pytest.raises(ValueError, match="alpha is required"):
        plot_attention_graph(edge_index)
    with pytest.raises(ValueError, match="only accepted with an edge_index"):
        plot_attention_graph(attention_graph(edge_index, alpha), alpha)


def test_plot_graph_edge_cases():
    from mpl_toolkits.mplot3d.art3d import Line3DCollection

    no_edges = torch.zeros(2, 0, dtype=torch.long)
    lonely = plot_attention_graph(no_edges, torch.zeros(0), torch.zeros(1, 3))  # one point, nothing to draw
    assert not [c for c in lonely.axes[0].collections if isinstance(c, Line3DCollection)]
    assert len(plot_attention_graph(torch.tensor([[0], [0]]), torch.ones(1)).axes[0].patches) == 1  # self-loop in 2-D
    assert len(plot_attention_graph(no_edges, torch.zeros(0), num_nodes=0).axes[0].patches) == 0
    with pytest.raises(ValueError, match="matrix must have shape"):
        plot_attention_heatmap(torch.zeros(0, 0))
    with pytest.raises(ValueError, match="num_nodes must be at least 1"):
        plot_rollout([(no_edges, torch.zeros(0))], 0)


def test_missing_matplotlib_gives_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"plot_attention_heatmap needs matplotlib: pip install matplotlib networkx"):
        plot_attention_heatmap(torch.rand(2, 2))


def test_plots_do_not_touch_pyplot():
    import matplotlib.pyplot as plt

    before = plt.get_fignums()
    plot_attention_heatmap(torch.rand(3, 3))
    plot_attention_graph(torch.tensor([[0], [1]]), torch.ones(1))
    assert plt.get_fignums() == before


# ----------------------------------------------------------------------------- record_attention


class TwoLayers(torch.nn.Module):
    """Two attention layers, nested one level down, plus a non-attention module."""

    def __init__(self):
        super().__init__()
        from e3attn.attention import EquivariantAttention

        self.embed = torch.nn.Identity()
        self.layers = torch.nn.ModuleList(
            [
                EquivariantAttention("3x0e", "4x0e + 2x1o", "4x0e + 2x1o", "4x0e + 2x1o", 1.6, lmax=1, num_heads=2),
                EquivariantAttention("4x0e + 2x1o", "2x0e", "2x0e", "2x0e", 1.2, lmax=1, num_heads=1),
            ]
        )

    def forward(self, f, pos):
        for layer in self.layers:
            f = layer(self.embed(f), pos)
        return f


@pytest.fixture
def model_and_inputs():
    torch.manual_seed(0)
    model = TwoLayers()
    pos = torch.randn(7, 3)
    f = torch.randn(7, 3)
    return model, f, pos


def test_record_attention_finds_every_layer_and_matches_return_attention(model_and_inputs):
    model, f, pos = model_and_inputs
    with record_attention(model) as records:
        out = model(f, pos)
    assert [record.name for record in records] == ["layers.0", "layers.1"]
    first, second = model.layers
    hidden, alpha_first = first(f, pos, return_attention=True)
    output, alpha_second = second(hidden, pos, return_attention=True)
    assert torch.equal(out, output)  # recording does not change the output
    for record, layer, alpha, inputs in [(records[0], first, alpha_first, f), (records[1], second, alpha_second, hidden)]:
        assert isinstance(record, AttentionRecord) and not record.alpha.requires_grad
        assert record.alpha.shape == (record.edge_index.shape[1], layer.num_heads)
        assert torch.equal(record.alpha, alpha)
        # and the edges are the layer's radius graph, by brute force
        expected = {(s, d) for s in range(7) for d in range(7) if s != d and (pos[s] - pos[d]).norm() < layer.max_radius}
        assert set(map(tuple, record.edge_index.t().tolist())) == expected


def test_record_attention_removes_hooks_and_records_repeated_calls(model_and_inputs):
    model, f, pos = model_and_inputs
    with record_attention(model) as records:
        model(f, pos)
        model(f, pos)
    assert [record.name for record in records] == ["layers.0", "layers.1", "layers.0", "layers.1"]
    model(f, pos)
    assert len(records) == 4  # nothing recorded after the context closed
    with pytest.raises(RuntimeError, match="boom"):
        with record_attention(model) as failed:
            model(f, pos)
            raise RuntimeError("boom")
    model(f, pos)
    assert len(failed) == 2  # hooks were removed on the way out of the exception
    with record_attention(model.layers[1]) as single:  # a layer on its own is named ""
        model.layers[1](torch.randn(7, model.layers[1].irreps_input.dim), pos)
    assert [record.name for record in single] == [""]


def test_record_attention_rejects_models_without_attention():
    with pytest.raises(ValueError, match="model must contain at least one EquivariantAttention"):
        with record_attention(torch.nn.Linear(2, 2)):
            pass


# ----------------------------------------------------------------------------- example


def test_example_writes_the_three_figures(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE.parent))  # as when the script runs: it imports examples/_common.py
    spec = importlib.util.spec_from_file_location("attention_graph_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    paths = example.main(["--out", str(tmp_path), "--smoke"])
    assert sorted(paths) == ["attention_3d", "heatmap", "rollout"]
    for path in paths.values():
        assert path.parent == tmp_path and path.stat().st_size > 1000
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

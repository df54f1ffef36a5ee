"""Plain attention: dense and sparse forms, checked against plain loop/numpy references."""
import math

import numpy as np
import pytest
import torch

from e3attn.graph import complete_graph
from e3attn.multihead import GraphMultiHeadAttention, MultiHeadAttention
from e3attn.plain import dense_attention, graph_attention

INF = float("inf")


@pytest.fixture(autouse=True)
def float64_default():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


# ----------------------------------------------------------------------------- independent references


def reference_attention(q, k, v, pairs, temperature=1.0):
    """Weighted mean written with loops. ``pairs``: list of (src j, dst i), repeats allowed.

    Returns ``out [N, dv]`` and a dict ``{(j, i): weight of one copy of the pair}``.
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    d = q.shape[1]
    out = np.zeros((q.shape[0], v.shape[1]))
    weights = {}
    for i in range(q.shape[0]):
        srcs = [j for (j, dst) in pairs if dst == i]
        if not srcs:
            continue
        s = [sum(q[i, c] * k[j, c] for c in range(d)) for j in srcs]
        if temperature == 0:
            top = max(s)
            w = [1.0 if x == top else 0.0 for x in s]
        elif temperature == INF:
            w = [1.0] * len(s)
        else:
            top = max(s)
            w = [math.exp((x - top) / (math.sqrt(d) * temperature)) for x in s]
        total = sum(w)
        for j, wj in zip(srcs, w):
            weights[(j, i)] = wj / total
            out[i] += wj / total * v[j]
    return out, weights


def all_pairs(n, m=None):
    """Every (src, dst) pair, written out with loops."""
    return [(j, i) for i in range(n) for j in range(n if m is None else m)]


def edges_of(pairs):
    return torch.tensor(pairs, dtype=torch.long).reshape(-1, 2).T.contiguous()


def dense_from_edges(weights, n, m):
    w = np.zeros((n, m))
    for (j, i), value in weights.items():
        w[i, j] = value
    return w


# ----------------------------------------------------------------------------- seed 001: the sleepy child

# the chapter's embeddings (index: word) and values
WORDS = ["The", "Sleepy", "Child", "Reads", "A", "Book"]
KEYS = [[0, 0, 0], [2, 0, 1], [1, -1, -2], [2, 3, 1], [-2, 0, 0], [0, 2, 1]]
VALUES = [0, -0.2, 0.3, 0.4, 0, 0.1]


def test_sleepy_child_example():
    keys, values, query = np.array(KEYS, float), np.array(VALUES), np.array(KEYS[5], float)
    logits = np.array([sum(query[c] * keys[i, c] for c in range(3)) for i in range(6)])
    assert logits.tolist() == [0, 1, -4, 7, 0, 5]  # as printed in the chapter
    b = np.exp(logits) / np.exp(logits).sum()  # the chapter's unscaled softmax
    exact = float(b @ values)

    # the chapter does not divide by sqrt(d): T = 1 / sqrt(3) undoes the scaling
    out, w = dense_attention(
        torch.tensor(query)[None], torch.tensor(keys), torch.tensor(values)[:, None], temperature=1 / math.sqrt(3)
    )
    np.testing.assert_allclose(w[0].numpy(), b, rtol=0, atol=1e-6)
    assert abs(out.item() - exact) < 1e-6
    # printed numbers, to their printed precision
    np.testing.assert_allclose(w[0].numpy(), [0, 0, 0, 0.88, 0, 0.12], atol=0.005)
    assert round(out.item(), 2) == 0.36

    # the same as a graph: every word sends an edge to "Book"
    edge_index = torch.tensor([list(range(6)), [5] * 6])
    nodes_q = torch.tensor(keys)  # self-attention: queries are the embeddings
    out_g, alpha = graph_attention(
        nodes_q, torch.tensor(keys), torch.tensor(values)[:, None], edge_index, temperature=1 / math.sqrt(3)
    )
    np.testing.assert_allclose(alpha.numpy(), b, rtol=0, atol=1e-6)
    assert abs(out_g[5].item() - exact) < 1e-6
    assert out_g[:5].abs().max() == 0  # no incoming edges


# ----------------------------------------------------------------------------- seed 000: 4 nodes, 5 features

SEED000_OUTPUT = [
    [0.0539, -0.2314, -0.7193, 0.2311, 0.5558],
    [0.0022, 0.2890, -0.1338, -0.1758, 0.5741],
    [-0.1504, 0.6230, 0.3954, -0.5747, 0.5293],
    [0.0375, -0.2709, -0.7365, 0.2375, 0.5486],
]


def test_seed000_four_nodes_five_features():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        lin = [torch.nn.Linear(5, 5, dtype=torch.float32) for _ in range(4)]  # q, k, v, out as in the notebook
        h = torch.randn(4, 5, dtype=torch.float32)
    q, k, v = (layer(h) for layer in lin[:3])
    dense, _ = dense_attention(q, k, v)
    sparse, _ = graph_attention(q, k, v, complete_graph(4))
    assert (dense - sparse).abs().max() < 1e-6
    np.testing.assert_allclose(dense.detach().numpy(), SEED000_OUTPUT, rtol=0, atol=5e-5)  # printed to 4 decimals
    ref, _ = reference_attention(q.detach(), k.detach(), v.detach(), all_pairs(4))
    np.testing.assert_allclose(sparse.detach().numpy(), ref, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- dense == sparse


@pytest.mark.parametrize("temperature", [1.0, 0.3, 0.0, INF])
def test_matches_loop_reference(temperature):
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(5, 4, generator=g), torch.randn(7, 4, generator=g), torch.randn(7, 3, generator=g)
    pairs = all_pairs(5, 7)
    ref, ref_w = reference_attention(q, k, v, pairs, temperature)
    out, w = dense_attention(q, k, v, temperature=temperature)
    np.testing.assert_allclose(out.numpy(), ref, rtol=0, atol=1e-12)
    np.testing.assert_allclose(w.numpy(), dense_from_edges(ref_w, 5, 7), rtol=0, atol=1e-12)
    out_g, alpha = graph_attention(q, k, v, edges_of(pairs), temperature=temperature)
    np.testing.assert_allclose(out_g.numpy(), ref, rtol=0, atol=1e-12)
    np.testing.assert_allclose(alpha.numpy(), [ref_w[p] for p in pairs], rtol=0, atol=1e-12)


@pytest.mark.parametrize("loop", [True, False])
def test_complete_graph_equals_dense_single_head(loop):
    q, k, v = torch.randn(6, 8), torch.randn(6, 8), torch.randn(6, 3)
    edge_index = complete_graph(6, loop=loop)
    mask = None if loop else ~torch.eye(6, dtype=torch.bool)
    out, w = dense_attention(q, k, v, mask=mask)
    out_g, alpha = graph_attention(q, k, v, edge_index)
    assert (out - out_g).abs().max() < 1e-12
    src, dst = edge_index
    assert (w[dst, src] - alpha).abs().max() < 1e-12
    assert edge_index.shape[1] == (36 if loop else 30)


def test_complete_graph_equals_dense_multi_head():
    heads, n = 3, 5
    q, k, v = torch.randn(n, heads, 4), torch.randn(n, heads, 4), torch.randn(n, heads, 2)
    out_g, alpha = graph_attention(q, k, v, complete_graph(n))
    out, w = dense_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))  # [H, N, .]
    assert alpha.shape == (n * n, heads)
    assert (out.transpose(0, 1) - out_g).abs().max() < 1e-12
    src, dst = complete_graph(n)
    assert (w[:, dst, src].T - alpha).abs().max() < 1e-12
    for h in range(heads):  # each head on its own
        ref, _ = reference_attention(q[:, h], k[:, h], v[:, h], all_pairs(n))
        np.testing.assert_allclose(out_g[:, h].numpy(), ref, rtol=0, atol=1e-12)


def test_batched_complete_graph_equals_dense_per_graph_and_block_mask():
    batch = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    heads = 2
    q, k, v = torch.randn(9, heads, 4), torch.randn(9, heads, 4), torch.randn(9, heads, 3)
    out_g, _ = graph_attention(q, k, v, complete_graph(9, batch))
    # one dense attention per graph
    for b in range(3):
        idx = (batch == b).nonzero().flatten()
        out, _ = dense_attention(q[idx].transpose(0, 1), k[idx].transpose(0, 1), v[idx].transpose(0, 1))
        assert (out.transpose(0, 1) - out_g[idx]).abs().max() < 1e-12
    # all nodes at once with the block-diagonal mask
    mask = batch[:, None] == batch[None, :]
    out, _ = dense_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), mask=mask)
    assert (out.transpose(0, 1) - out_g).abs().max() < 1e-12


def test_padded_batch_dense_equals_graph():
    # the usual transformer layout: [B, N_max, d] with key padding
    sizes = [3, 5]
    q, k, v = torch.randn(2, 5, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 2)
    valid = torch.tensor([[j < s for j in range(5)] for s in sizes])
    out, _ = dense_attention(q, k, v, mask=valid[:, None, :])
    q_f, k_f, v_f = (torch.cat([x[b, : sizes[b]] for b in range(2)]) for x in (q, k, v))
    batch = torch.tensor([0] * 3 + [1] * 5)
    out_g, _ = graph_attention(q_f, k_f, v_f, complete_graph(8, batch))
    assert (torch.cat([out[0, :3], out[1, :5]]) - out_g).abs().max() < 1e-12


@pytest.mark.parametrize("temperature", [1.0, 0.0, INF])
def test_mask_equals_missing_edges(temperature):
    g = torch.Generator().manual_seed(3)
    n, m = 7, 5  # bipartite: 7 queries, 5 keys
    mask = torch.rand(n, m, generator=g) < 0.4
    mask[2] = False  # a query with nothing to attend to
    q, k, v = torch.randn(n, 2, 3, generator=g), torch.randn(m, 2, 3, generator=g), torch.randn(m, 2, 4, generator=g)
    pairs = [(j, i) for i in range(n) for j in range(m) if mask[i, j]]
    edge_index = edges_of(pairs)
    q_h, k_h, v_h = (x.transpose(0, 1) for x in (q, k, v))  # [H, nodes, d]
    out, w = dense_attention(q_h, k_h, v_h, mask=mask, temperature=temperature)
    out_g, alpha = graph_attention(q, k, v, edge_index, temperature=temperature)
    assert (out.transpose(0, 1) - out_g).abs().max() < 1e-12
    assert (w[:, edge_index[1], edge_index[0]].T - alpha).abs().max() < 1e-12
    assert (w[:, ~mask] == 0).all()
    assert (out_g[2] == 0).all() and (out[:, 2] == 0).all()
    for h in range(2):
        ref, _ = reference_attention(q[:, h], k[:, h], v[:, h], pairs, temperature)
        np.testing.assert_allclose(out_g[:, h].numpy(), ref, rtol=0, atol=1e-12)


def test_edge_order_and_node_permutation():
    g = torch.Generator().manual_seed(4)
    n = 6
    q, k, v = torch.randn(n, 3, generator=g), torch.randn(n, 3, generator=g), torch.randn(n, 2, generator=g)
    edge_index = torch.randint(0, n, (2, 15), generator=g)
    out, alpha = graph_attention(q, k, v, edge_index)
    shuffle = torch.randperm(15, generator=g)
    out_s, alpha_s = graph_attention(q, k, v, edge_index[:, shuffle])
    assert (out - out_s).abs().max() < 1e-12 and (alpha[shuffle] - alpha_s).abs().max() < 1e-12
    perm = torch.randperm(n, generator=g)  # node i of the new graph is node perm[i] of the old one
    inverse = torch.argsort(perm)
    out_p, _ = graph_attention(q[perm], k[perm], v[perm], inverse[edge_index])
    assert (out_p - out[perm]).abs().max() < 1e-12


def test_duplicate_edges_count_with_multiplicity():
    q, k, v = torch.randn(3, 2), torch.randn(3, 2), torch.randn(3, 2)
    pairs = [(0, 1), (0, 1), (2, 1), (1, 0)]
    out, alpha = graph_attention(q, k, v, edges_of(pairs))
    ref, ref_w = reference_attention(q, k, v, pairs)
    np.testing.assert_allclose(out.numpy(), ref, rtol=0, atol=1e-12)
    np.testing.assert_allclose(alpha.numpy(), [ref_w[p] for p in pairs], rtol=0, atol=1e-12)
    assert abs(alpha[0] + alpha[1] + alpha[2] - 1) < 1e-12


# ----------------------------------------------------------------------------- temperature limits


def test_hard_attention_is_one_hot_at_argmax():
    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(4, 3, generator=g), torch.randn(6, 3, generator=g), torch.randn(6, 2, generator=g)
    _, w = dense_attention(q, k, v, temperature=0.0)
    for i in range(4):
        scores = [float(q[i] @ k[j]) for j in range(6)]
        best = scores.index(max(scores))
        assert w[i].tolist() == [1.0 if j == best else 0.0 for j in range(6)]
    # small temperatures approach the limit
    _, w_small = dense_attention(q, k, v, temperature=1e-3)
    assert (w_small - w).abs().max() < 1e-6


def test_hard_attention_ties_split_evenly_and_respect_mask():
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    k = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 5.0], [1.0, 0.0], [0.0, 9.0]])
    v = torch.arange(5.0)[:, None]
    mask = torch.tensor([[True] * 5, [True, True, True, True, False]])
    out, w = dense_attention(q, k, v, mask=mask, temperature=0.0)
    # query 0 scores (1, 0, 1, 1, 0): three-way tie; query 1 scores (0, 0, 5, 0, [9 masked]) -> key 2
    assert w.tolist() == [[1 / 3, 0, 1 / 3, 1 / 3, 0], [0, 0, 1, 0, 0]]
    assert out.flatten().tolist() == pytest.approx([(0 + 2 + 3) / 3, 2.0], abs=1e-12)
    edge_index = edges_of([(j, i) for i in range(2) for j in range(5) if mask[i, j]])
    out_g, alpha = graph_attention(q, k, v, edge_index, temperature=0.0)
    assert alpha.tolist() == [1 / 3, 0, 1 / 3, 1 / 3, 0, 0, 0, 1, 0]
    assert (out_g - out).abs().max() < 1e-12


def test_infinite_temperature_is_uniform_over_allowed():
    g = torch.Generator().manual_seed(6)
    q, k, v = 50 * torch.randn(3, 4, generator=g), torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 0, 1, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    out, w = dense_attention(q, k, v, mask=mask, temperature=INF)
    assert w.tolist() == [[0.2] * 5, [0.5, 0, 0.5, 0, 0], [0.0] * 5]
    assert (out[1] - (v[0] + v[2]) / 2).abs().max() < 1e-12
    # large temperatures approach the limit
    _, w_large = dense_attention(q, k, v, mask=mask, temperature=1e9)
    assert (w_large - w).abs().max() < 1e-6
    # the graph form: 1 / in-degree
    edge_index = torch.tensor([[0, 1, 2, 3, 4, 0], [0, 0, 0, 1, 1, 2]])
    _, alpha = graph_attention(q, k, v, edge_index, temperature=INF)
    assert alpha.tolist() == [1 / 3, 1 / 3, 1 / 3, 0.5, 0.5, 1.0]


@pytest.mark.parametrize("temperature", [0.0, INF])
def test_limit_gradients_flow_only_through_values(temperature):
    q, k, v = (torch.randn(4, 3, requires_grad=True) for _ in range(3))
    out, w = dense_attention(q, k, v, temperature=temperature)
    gq, gk, gv = torch.autograd.grad(out.sum(), (q, k, v), allow_unused=True, materialize_grads=True)
    assert (gq == 0).all() and (gk == 0).all()
    assert torch.allclose(gv, w.sum(0)[:, None].expand(4, 3), atol=1e-12)


@pytest.mark.parametrize("bad", [-1.0, -1e-9, float("nan"), "1", None, True])
def test_bad_temperature(bad):
    q = torch.randn(2, 3)
    with pytest.raises(ValueError, match="temperature"):
        dense_attention(q, q, q, temperature=bad)
    with pytest.raises(ValueError, match="temperature"):
        graph_attention(q, q, q, complete_graph(2), temperature=bad)


# ----------------------------------------------------------------------------- numerics and edge cases


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_large_logits_stay_finite(dtype):
    g = torch.Generator().manual_seed(7)
    q = (100 * torch.randn(6, 2, 4, generator=g)).to(dtype).requires_grad_()
    k = (100 * torch.randn(6, 2, 4, generator=g)).to(dtype).requires_grad_()
    v = torch.randn(6, 2, 3, generator=g).to(dtype).requires_grad_()
    logits = (q.detach().transpose(0, 1) @ k.detach().transpose(0, 1).transpose(-1, -2)) / 2
    assert logits.abs().max() > 1e3  # exp would overflow without the max subtraction
    edge_index = complete_graph(6)
    out_g, alpha = graph_attention(q, k, v, edge_index)
    out, w = dense_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
    for t in (out_g, alpha, out, w):
        assert torch.isfinite(t).all()
    assert (out.transpose(0, 1) - out_g).abs().max() < (1e-5 if dtype == torch.float32 else 1e-12)
    assert (w.sum(-1) - 1).abs().max() < 1e-5
    (out_g.sum() + out.sum()).backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))


def test_gradients_match_between_forms_and_finite_with_empty_rows():
    q, k, v = (torch.randn(5, 3, requires_grad=True) for _ in range(3))
    mask = torch.rand(5, 5) < 0.5
    mask[0] = False
    pairs = [(j, i) for i in range(5) for j in range(5) if mask[i, j]]
    out, _ = dense_attention(q, k, v, mask=mask)
    grads = torch.autograd.grad((out**2).sum(), (q, k, v))
    out_g, _ = graph_attention(q, k, v, edges_of(pairs))
    grads_g = torch.autograd.grad((out_g**2).sum(), (q, k, v))
    for a, b in zip(grads, grads_g):
        assert torch.isfinite(a).all() and (a - b).abs().max() < 1e-12
    assert torch.autograd.gradcheck(lambda *x: dense_attention(*x, mask=mask)[0], (q, k, v))
    assert torch.autograd.gradcheck(lambda *x: graph_attention(*x, edges_of(pairs))[0], (q, k, v))


def test_empty_and_single_node():
    q = torch.randn(1, 3)
    out, w = dense_attention(q, q, q)  # one node attends to itself
    assert w.tolist() == [[1.0]] and (out - q).abs().max() < 1e-15
    out_g, alpha = graph_attention(q, q, q, complete_graph(1))
    assert alpha.tolist() == [1.0] and (out_g - q).abs().max() < 1e-15
    # no edges at all: zeros
    no_edges = torch.empty(2, 0, dtype=torch.long)
    out_g, alpha = graph_attention(torch.randn(3, 2), torch.randn(3, 2), torch.randn(3, 4), no_edges)
    assert out_g.shape == (3, 4) and (out_g == 0).all() and alpha.shape == (0,)
    # single node without self loop: nothing to attend to
    out_g, _ = graph_attention(q, q, q, complete_graph(1, loop=False))
    assert (out_g == 0).all()
    # zero queries, zero keys
    out, w = dense_attention(torch.randn(0, 3), torch.randn(4, 3), torch.randn(4, 2))
    assert out.shape == (0, 2) and w.shape == (0, 4)
    out, w = dense_attention(torch.randn(2, 3), torch.randn(0, 3), torch.randn(0, 2))
    assert out.shape == (2, 2) and (out == 0).all()
    out_g, _ = graph_attention(torch.randn(0, 3), torch.randn(0, 3), torch.randn(0, 2), no_edges)
    assert out_g.shape == (0, 2)


def test_broadcast_batch_dimensions():
    q, k, v = torch.randn(2, 1, 4, 3), torch.randn(3, 5, 3), torch.randn(3, 5, 2)
    mask = torch.rand(4, 5) < 0.7
    out, w = dense_attention(q, k, v, mask=mask)
    assert out.shape == (2, 3, 4, 2) and w.shape == (2, 3, 4, 5)
    for a in range(2):
        for b in range(3):
            pairs = [(j, i) for i in range(4) for j in range(5) if mask[i, j]]
            ref, _ = reference_attention(q[a, 0], k[b], v[b], pairs)
            np.testing.assert_allclose(out[a, b].numpy(), ref, rtol=0, atol=1e-12)


def test_dropout_zeroes_and_rescales_weights():
    q, k, v = torch.randn(6, 3), torch.randn(6, 3), torch.randn(6, 2)
    _, clean = dense_attention(q, k, v)
    out, w = dense_attention(q, k, v, dropout_p=0.5)
    kept = w != 0
    assert 0 < kept.sum() < 36
    assert (w[kept] - 2 * clean[kept]).abs().max() < 1e-12 and (out - w @ v).abs().max() < 1e-12
    _, alpha_clean = graph_attention(q, k, v, complete_graph(6))
    out_g, alpha = graph_attention(q, k, v, complete_graph(6), dropout_p=0.5)
    kept = alpha != 0
    assert (alpha[kept] - 2 * alpha_clean[kept]).abs().max() < 1e-12
    assert (graph_attention(q, k, v, complete_graph(6), dropout_p=1.0)[0] == 0).all()


def test_bad_inputs():
    q, e = torch.randn(4, 3), complete_graph(4)
    cases_dense = [
        (dict(q=q, k=torch.randn(4, 2), v=q), "feature dimension"),
        (dict(q=q, k=q, v=torch.randn(5, 3)), "same number of keys"),
        (dict(q=torch.randn(3), k=q, v=q), "at least 2 dimensions"),
        (dict(q=q.long(), k=q, v=q), "floating-point"),
        (dict(q=q, k=q.float(), v=q), "share a dtype"),
        (dict(q=torch.randn(2, 4, 3), k=torch.randn(3, 4, 3), v=torch.randn(3, 4, 3)), "broadcast"),
        (dict(q=q, k=q, v=q, mask=torch.ones(4, 4)), "boolean"),
        (dict(q=q, k=q, v=q, mask=torch.ones(3, 4, dtype=torch.bool)), "mask must broadcast"),
        (dict(q=q, k=q, v=q, dropout_p=1.5), "dropout_p"),
        (dict(q=torch.randn(4, 0), k=torch.randn(4, 0), v=q), "non-empty"),
    ]
    for kwargs, match in cases_dense:
        with pytest.raises(ValueError, match=match):
            dense_attention(kwargs.pop("q"), kwargs.pop("k"), kwargs.pop("v"), **kwargs)
    cases_graph = [
        ((q, q, q, torch.tensor([[0, 4], [0, 0]])), "edge_index"),
        ((q, q, q, torch.zeros(3, 2, dtype=torch.long)), r"edge_index must have shape \[2, E\]"),
        ((q, q, q, e.float()), "integer"),
        ((torch.randn(2, 3), q, q, torch.tensor([[0], [3]])), "destinations"),
        ((q, torch.randn(2, 3), torch.randn(2, 3), torch.tensor([[3], [0]])), "sources"),
        ((q, q, torch.randn(5, 3), e), "same number of source nodes"),
        ((torch.randn(4, 2, 3), torch.randn(4, 3, 3), torch.randn(4, 3, 3), e), "heads"),
        ((q, torch.randn(4, 1, 3), q, e), "all"),
        ((torch.randn(4, 1, 1, 3),) * 3 + (e,), "all"),
    ]
    for args, match in cases_graph:
        with pytest.raises(ValueError, match=match):
            graph_attention(*args)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        dense_attention([[1.0]], q, q)


# ----------------------------------------------------------------------------- multi-head modules


def copy_to_torch(mha):
    ref = torch.nn.MultiheadAttention(mha.embed_dim, mha.num_heads, batch_first=True, kdim=mha.kdim, vdim=mha.vdim)
    with torch.no_grad():
        if ref._qkv_same_embed_dim:
            ref.in_proj_weight.copy_(torch.cat([mha.q_proj.weight, mha.k_proj.weight, mha.v_proj.weight]))
        else:
            ref.q_proj_weight.copy_(mha.q_proj.weight)
            ref.k_proj_weight.copy_(mha.k_proj.weight)
            ref.v_proj_weight.copy_(mha.v_proj.weight)
        ref.in_proj_bias.copy_(torch.cat([mha.q_proj.bias, mha.k_proj.bias, mha.v_proj.bias]))
        ref.out_proj.weight.copy_(mha.out_proj.weight)
        ref.out_proj.bias.copy_(mha.out_proj.bias)
    return ref.eval()


def test_multihead_matches_torch_self_attention():
    mha = MultiHeadAttention(12, 3).eval()
    ref = copy_to_torch(mha)
    x = torch.randn(2, 5, 12)
    mask = torch.rand(5, 5) < 0.6
    mask.fill_diagonal_(True)  # torch gives NaN for fully masked rows
    out, w = mha(x, mask=mask, return_weights=True)
    out_ref, w_ref = ref(x, x, x, attn_mask=~mask, average_attn_weights=False)
    assert (out - out_ref).abs().max() < 1e-12
    assert (w - w_ref).abs().max() < 1e-12


def test_multihead_matches_torch_cross_attention_with_kdim_vdim():
    mha = MultiHeadAttention(8, 2, kdim=5, vdim=3).eval()
    ref = copy_to_torch(mha)
    query, key, value = torch.randn(4, 6, 8), torch.randn(4, 7, 5), torch.randn(4, 7, 3)
    padding = torch.rand(4, 7) < 0.3
    padding[:, 0] = False
    out = mha(query, key, value, mask=~padding[:, None, :])
    out_ref, _ = ref(query, key, value, key_padding_mask=padding)
    assert (out - out_ref).abs().max() < 1e-12


@pytest.mark.parametrize("combine", ["concat", "gaan"])
def test_graph_multihead_equals_dense_on_complete_graph(combine):
    dense = MultiHeadAttention(6, 2, combine=combine)
    graph = GraphMultiHeadAttention(6, 2, combine=combine)
    graph.load_state_dict(dense.state_dict())
    batch = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    x = torch.randn(7, 6)
    out_g, alpha = graph(x, complete_graph(7, batch), return_weights=True)
    out_d = dense(x, mask=batch[:, None] == batch[None, :])
    assert alpha.shape == (25, 2)
    assert (out_g - out_d).abs().max() < 1e-12
    out_single = dense(x[:4])  # graph 0 on its own, no mask
    assert (out_g[:4] - out_single).abs().max() < 1e-12
    # any graph = dense with the mask "edge j -> i exists"
    edge_index = torch.tensor([[0, 1, 2, 3, 6, 5], [1, 1, 0, 0, 0, 4]])
    mask = torch.zeros(7, 7, dtype=torch.bool)
    mask[edge_index[1], edge_index[0]] = True
    assert (graph(x, edge_index) - dense(x, mask=mask)).abs().max() < 1e-12


def test_gaan_combination_matches_chapter_formula():
    heads, dim = 2, 3
    mha = MultiHeadAttention(dim, heads, combine="gaan")
    assert mha.head_dim == dim and mha.head_weight.shape == (heads, dim, dim)  # square heads, w_{hjl}
    x = torch.randn(5, dim)
    out = mha(x)
    # per-head attention with numpy, then  sum_{j,h} e'_{ijh} w_{jhl}  with loops
    xn = x.numpy()
    per_head = []
    for h in range(heads):
        rows = slice(h * dim, (h + 1) * dim)
        proj = [
            xn @ lin.weight[rows].detach().numpy().T + lin.bias[rows].detach().numpy()
            for lin in (mha.q_proj, mha.k_proj, mha.v_proj)
        ]
        per_head.append(reference_attention(*proj, all_pairs(5))[0])
    w = mha.head_weight.detach().numpy()
    ref = np.zeros((5, dim))
    for i in range(5):
        for l in range(dim):
            ref[i, l] = sum(per_head[h][i, j] * w[h, j, l] for h in range(heads) for j in range(dim))
    np.testing.assert_allclose(out.detach().numpy(), ref, rtol=0, atol=1e-12)
    # the same function as "concat" with W^O = reshaped w and no output bias
    concat = MultiHeadAttention(dim, heads, head_dim=dim)
    state = {key: value for key, value in mha.state_dict().items() if key != "head_weight"}
    state["out_proj.weight"] = mha.head_weight.detach().reshape(heads * dim, dim).T
    state["out_proj.bias"] = torch.zeros(dim)
    concat.load_state_dict(state)
    assert (concat(x) - out).abs().max() < 1e-12


def test_multihead_gradients_and_dropout():
    for module in (MultiHeadAttention(8, 4, dropout=0.5), GraphMultiHeadAttention(8, 4, combine="gaan", dropout=0.5)):
        x = torch.randn(5, 8)
        args = (x,) if isinstance(module, MultiHeadAttention) else (x, complete_graph(5))
        module.train()
        module(*args).pow(2).sum().backward()
        for name, p in module.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().max() > 0, name
        module.eval()
        assert torch.equal(module(*args), module(*args))  # no dropout in eval mode


def test_multihead_bad_arguments():
    with pytest.raises(ValueError, match="divisible"):
        MultiHeadAttention(10, 3)
    assert MultiHeadAttention(10, 3, head_dim=4).q_proj.out_features == 12
    with pytest.raises(ValueError, match="combine"):
        MultiHeadAttention(8, 2, combine="mean")
    with pytest.raises(ValueError, match="num_heads"):
        GraphMultiHeadAttention(8, 0)
    with pytest.raises(ValueError, match="dropout"):
        MultiHeadAttention(8, 2, dropout=1.0)
    with pytest.raises(ValueError, match="query"):
        MultiHeadAttention(8, 2)(torch.randn(3, 7))
    with pytest.raises(ValueError, match="key"):
        MultiHeadAttention(8, 2, kdim=4)(torch.randn(3, 8), torch.randn(3, 5), torch.randn(3, 8))
    with pytest.raises(ValueError, match=r"x must have shape \[nodes, 8\]"):
        GraphMultiHeadAttention(8, 2)(torch.randn(1, 3, 8), complete_graph(3))

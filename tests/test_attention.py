import pytest
import torch
from e3nn import o3

import e3attn
from e3attn import EquivariantAttention
from e3attn.testing import assert_equivariant, assert_permutation_equivariant, assert_smooth_cutoff
from reference import brute_force_edges, e3nn_guide_attention

GUIDE = ("10x0e + 5x1o", "11x0e + 4x1o", "12x0e + 3x1o", "14x0e + 6x1o")
PARITY = ("4x0e + 2x0o + 2x1o + 2x1e + 2x2e", "4x0e + 2x0o + 2x1o + 2x2o", "6x0e + 2x1o + 2x1e + 2x2o", "4x0e + 2x0o + 4x1o + 2x1e + 2x2e")


def make_layer(irreps=GUIDE, dtype=torch.float64, seed=0, **kwargs):
    torch.manual_seed(seed)
    kwargs.setdefault("max_radius", 1.3)
    return EquivariantAttention(*irreps, **kwargs).to(dtype)


def random_graphs(num_graphs=3, num_nodes=12, irreps="10x0e + 5x1o", dtype=torch.float64, seed=1):
    gen = torch.Generator().manual_seed(seed)
    n = num_graphs * num_nodes
    pos = torch.randn(n, 3, generator=gen, dtype=dtype)
    f = torch.randn(n, o3.Irreps(irreps).dim, generator=gen, dtype=dtype)
    batch = torch.arange(n) % num_graphs
    return pos, f, batch


@pytest.mark.parametrize("aggregation", ["sqrt_alpha", "alpha"])
@pytest.mark.parametrize("num_heads", [1, 2])
def test_equals_e3nn_guide_reference(aggregation, num_heads, float64_default):
    layer = make_layer(PARITY, num_heads=num_heads, aggregation=aggregation)
    pos, f, batch = random_graphs(2, 10, PARITY[0])
    edge_index = brute_force_edges(pos, 1.3, batch)
    out, alpha = layer(f, pos, edge_index, return_attention=True)
    ref_out, ref_alpha = e3nn_guide_attention(layer, f, pos, edge_index)
    assert alpha.shape == (edge_index.shape[1], num_heads)
    torch.testing.assert_close(alpha, ref_alpha, atol=1e-12, rtol=0)
    torch.testing.assert_close(out, ref_out, atol=1e-12, rtol=0)
    assert out.abs().max() > 0.1


def test_builds_its_radius_graph():
    layer = make_layer()
    pos, f, batch = random_graphs()
    expected = layer(f, pos, brute_force_edges(pos, 1.3, batch))
    torch.testing.assert_close(layer(f, pos, batch=batch), expected, atol=1e-13, rtol=0)


@pytest.mark.parametrize("num_heads", [1, 2])
@pytest.mark.parametrize("seed", [0, 1])
def test_o3_equivariance_float64(num_heads, seed):
    layer = make_layer(PARITY, num_heads=num_heads, seed=seed, lmax=2)
    pos, f, batch = random_graphs(3, 10, PARITY[0], seed=seed)
    err = assert_equivariant(
        lambda pos, f: layer(f, pos, batch=batch),
        [pos, f],
        ["cartesian_points", layer.irreps_input],
        [layer.irreps_output],
        ntrials=2,
    )
    assert err <= 1e-10


def test_o3_equivariance_float32():
    # Rotations and parity only: e3nn's test translations (~10) alone round float32 positions by ~1e-6,
    # which is an input error no layer can undo; translation invariance is tested in float64.
    layer = make_layer(PARITY, num_heads=2, dtype=torch.float32)
    pos, f, batch = random_graphs(3, 10, PARITY[0], dtype=torch.float32)
    err = assert_equivariant(
        lambda pos, f: layer(f, pos, batch=batch),
        [pos, f],
        ["cartesian_points", layer.irreps_input],
        [layer.irreps_output],
        do_translation=False,
        ntrials=3,
    )
    assert err <= 1e-4


def test_random_irreps_equivariance():
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        heads = int(torch.randint(1, 4, (1,), generator=gen))

        def rand_irreps(max_l):
            terms = []
            for l in range(max_l + 1):
                for p in (1, -1):
                    mul = heads * int(torch.randint(0, 3, (1,), generator=gen))
                    if mul:
                        terms.append(f"{mul}x{l}{'e' if p == 1 else 'o'}")
            return " + ".join(terms or [f"{heads}x0e"])

        irreps = (rand_irreps(2), rand_irreps(2), rand_irreps(2), rand_irreps(2))
        layer = make_layer(irreps, num_heads=heads, lmax=int(torch.randint(0, 4, (1,), generator=gen)))
        pos, f, batch = random_graphs(2, 8, irreps[0])
        assert_equivariant(
            lambda pos, f: layer(f, pos, batch=batch), [pos, f], ["cartesian_points", irreps[0]], [irreps[3]]
        )


def test_float64_accuracy_does_not_depend_on_default_dtype(float32_default):
    torch.manual_seed(0)
    layer = EquivariantAttention(*PARITY, max_radius=1.3, num_heads=2)  # built in float32
    layer = layer.double()
    assert torch.get_default_dtype() == torch.float32
    pos, f, batch = random_graphs(3, 10, PARITY[0])
    err = assert_equivariant(
        lambda pos, f: layer(f, pos, batch=batch), [pos, f], ["cartesian_points", layer.irreps_input], [layer.irreps_output]
    )
    assert err <= 1e-10
    # and equal to the same weights in a layer built in float64
    torch.set_default_dtype(torch.float64)
    twin = EquivariantAttention(*PARITY, max_radius=1.3, num_heads=2)
    twin.load_state_dict(layer.state_dict())
    torch.testing.assert_close(layer(f, pos, batch=batch), twin(f, pos, batch=batch), atol=1e-13, rtol=0)


def test_float_then_double_round_trip_keeps_constants():
    layer = make_layer(PARITY)
    before = layer.tp.cg.clone()
    layer.float().double()
    assert layer.tp.cg.dtype == torch.float64
    assert torch.equal(layer.tp.cg, before)


def test_permutation_equivariance():
    layer = make_layer(PARITY, num_heads=2)
    pos, f, batch = random_graphs(3, 10, PARITY[0])
    assert_permutation_equivariant(lambda pos, f, batch: layer(f, pos, batch=batch), [pos, f, batch])


def test_batch_equals_graphs_one_by_one():
    layer = make_layer(PARITY, num_heads=2)
    pos, f, batch = random_graphs(3, 10, PARITY[0])
    out = layer(f, pos, batch=batch)
    for g in range(3):
        mask = batch == g
        torch.testing.assert_close(out[mask], layer(f[mask], pos[mask]), atol=1e-13, rtol=0)


def test_translation_invariance():
    layer = make_layer()
    pos, f, batch = random_graphs()
    shifted = pos + torch.tensor([3.0, -7.0, 11.0], dtype=pos.dtype)
    torch.testing.assert_close(layer(f, shifted, batch=batch), layer(f, pos, batch=batch), atol=1e-12, rtol=0)


def test_dense_equals_sparse():
    layer = make_layer(PARITY, num_heads=2)
    pos, f, batch = random_graphs(3, 10, PARITY[0])
    torch.testing.assert_close(layer.dense(f, pos, batch), layer(f, pos, batch=batch), atol=1e-10, rtol=0)
    alpha_layer = make_layer(PARITY, aggregation="alpha")
    torch.testing.assert_close(alpha_layer.dense(f, pos), alpha_layer(f, pos), atol=1e-10, rtol=0)


def test_smooth_across_cutoff():
    layer = make_layer(PARITY, max_radius=1.0)
    gen = torch.Generator().manual_seed(3)
    pos = torch.tensor([[0.0, 0.0, 0.0], [0.4, 0.3, -0.2], [-0.3, 0.5, 0.1], [5.0, 5.0, 5.0]], dtype=torch.float64)
    f = torch.randn(4, layer.irreps_input.dim, generator=gen, dtype=torch.float64)
    measured = assert_smooth_cutoff(lambda pos, f: layer(f, pos), pos, f, max_radius=1.0, node=3, center=0)
    assert measured["jump"] < 1e-6 and measured["jump_raw"] < 1e-6


def test_smooth_cutoff_detects_a_hard_cutoff():
    """The smoothness helper must fail on a layer whose weights jump at the cutoff."""

    def hard(pos, f):
        d = (pos[:, None] - pos[None]).norm(dim=-1)
        return ((d < 1.0).to(pos.dtype) * f[:, :1].T).sum(1, keepdim=True)

    pos = torch.tensor([[0.0, 0.0, 0.0], [0.4, 0.3, -0.2], [5.0, 5.0, 5.0]], dtype=torch.float64)
    with pytest.raises(AssertionError, match="jumps"):
        assert_smooth_cutoff(hard, pos, torch.ones(3, 1, dtype=torch.float64), max_radius=1.0, node=2)


def test_large_logits_do_not_overflow():
    layer = make_layer(num_heads=1)
    pos, f, batch = random_graphs()
    edge_index = brute_force_edges(pos, 1.3, batch)
    out, alpha = layer(f * 1e3, pos, edge_index, return_attention=True)
    assert torch.isfinite(out).all() and torch.isfinite(alpha).all()
    assert alpha.min() >= 0 and alpha.max() <= 1
    per_node = torch.zeros(pos.shape[0], 1, dtype=alpha.dtype).index_add(0, edge_index[1], alpha)
    assert (per_node <= 1 + 1e-12).all()
    # the logits really are huge: the guide's raw exp would overflow
    src, dst = edge_index
    q, k, _, _ = layer._edge_terms(f * 1e3, (f * 1e3)[src], pos[src] - pos[dst])
    assert (q[dst] * k).sum(-1).abs().max() > 1e3


HEADED = ("4x0e + 2x1o", "4x0e + 2x1o", "4x0e + 2x1o", "2x0e + 4x1o")


@pytest.mark.parametrize("num_heads", [1, 2])
def test_empty_graph_gives_zeros_and_finite_gradients(num_heads):
    layer = make_layer(HEADED, num_heads=num_heads)
    pos = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    f = torch.randn(5, layer.irreps_input.dim, dtype=torch.float64, requires_grad=True)
    out, alpha = layer(f, pos, torch.zeros(2, 0, dtype=torch.long), return_attention=True)
    assert out.shape == (5, layer.irreps_output.dim) and alpha.shape == (0, num_heads)
    assert torch.equal(out, torch.zeros_like(out))
    # forces (a gradient with create_graph) and a loss on them: defined, and zero without edges
    (forces,) = torch.autograd.grad(out.pow(2).sum() + out.sum(), pos, create_graph=True, allow_unused=True)
    assert forces is None or torch.equal(forces, torch.zeros_like(forces))
    out.sum().backward()
    for t in (pos.grad, f.grad):
        assert t is None or torch.equal(t, torch.zeros_like(t))
    params = [p.grad for p in layer.parameters() if p.grad is not None]
    assert all(torch.equal(g, torch.zeros_like(g)) for g in params)


@pytest.mark.parametrize("num_heads", [1, 2])
def test_isolated_single_and_no_nodes(num_heads):
    layer = make_layer(HEADED, num_heads=num_heads)
    pos = torch.tensor([[0.0, 0.0, 0.0], [0.5, 0.0, 0.0], [10.0, 0.0, 0.0]], dtype=torch.float64)
    f = torch.randn(3, layer.irreps_input.dim, dtype=torch.float64)
    zeros = torch.zeros(1, layer.irreps_output.dim, dtype=torch.float64)
    for form in (layer, layer.dense):
        out = form(f, pos)
        assert torch.equal(out[2:], zeros)
        assert out[:2].abs().max() > 0
        assert torch.equal(form(f[:1], pos[:1]), zeros)
        assert form(f[:0], pos[:0]).shape == (0, layer.irreps_output.dim)


def test_duplicate_points_are_finite_and_differentiable():
    layer = make_layer()
    pos = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.2, 0.1]], dtype=torch.float64, requires_grad=True)
    f = torch.randn(3, layer.irreps_input.dim, dtype=torch.float64)
    out = layer(f, pos)
    out.pow(2).sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(pos.grad).all()


def test_edge_vec_overrides_positions():
    layer = make_layer()
    pos, f, batch = random_graphs()
    edge_index = brute_force_edges(pos, 1.3, batch)
    edge_vec = pos[edge_index[0]] - pos[edge_index[1]]
    moved = torch.randn_like(pos)  # positions are ignored for the geometry when edge_vec is given
    torch.testing.assert_close(layer(f, moved, edge_index, edge_vec=edge_vec), layer(f, pos, edge_index), atol=0, rtol=0)


def test_gradcheck():
    layer = make_layer(("2x0e + 1x1o", "2x0e + 1x1o", "2x0e + 1x1o", "1x0e + 1x1o"), lmax=2, max_radius=2.0)
    pos = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    f = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    edge_index = brute_force_edges(pos.detach(), 2.0)
    assert torch.autograd.gradcheck(lambda pos, f: layer(f, pos, edge_index), (pos, f))


def test_attention_hook():
    layer = make_layer()
    pos, f, batch = random_graphs()
    seen = []
    handle = layer.register_attention_hook(lambda module, ei, alpha: seen.append((module, ei, alpha)))
    out, alpha = layer(f, pos, batch=batch, return_attention=True)
    assert len(seen) == 1 and seen[0][0] is layer
    assert torch.equal(seen[0][2], alpha.detach())
    handle.remove()
    layer(f, pos, batch=batch)
    assert len(seen) == 1


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda l, f, p: l(f[:, :-1], p), "f must have shape"),
        (lambda l, f, p: l(f, p[:, :2]), r"pos must have shape \[N, 3\]"),
        (lambda l, f, p: l(f, p.clone().index_fill_(0, torch.tensor([1]), float("nan"))), "pos contains NaN"),
        (lambda l, f, p: l(f, p.clone().index_fill_(0, torch.tensor([1]), float("inf"))), "pos contains NaN or inf"),
        (lambda l, f, p: l(f, p, torch.zeros(3, 4, dtype=torch.long)), r"edge_index must have shape \[2, E\]"),
        (lambda l, f, p: l(f, p, torch.zeros(2, 4)), "edge_index must be an integer"),
        (lambda l, f, p: l(f, p, torch.tensor([[0, 1], [1, 99]])), "edge_index has entries"),
        (lambda l, f, p: l(f, p, torch.tensor([[0, -1], [1, 0]])), "edge_index has entries"),
        (lambda l, f, p: l(f, p, batch=torch.zeros(3, dtype=torch.long)), "batch must have shape"),
        (lambda l, f, p: l(f, p, torch.tensor([[0], [1]]), edge_vec=torch.zeros(2, 3)), "edge_vec must have shape"),
        (lambda l, f, p: l(f, p, edge_vec=torch.zeros(2, 3)), "edge_vec was given without edge_index"),
    ],
)
def test_bad_input(call, match):
    layer = make_layer()
    pos, f, _ = random_graphs(1, 6)
    with pytest.raises(ValueError, match=match):
        call(layer, f, pos)


def test_bad_construction():
    with pytest.raises(ValueError, match="irreps_output .* cannot be split into 2 heads"):
        EquivariantAttention("4x0e", "4x0e", "4x0e", "3x0e + 2x1o", 1.0, num_heads=2)
    with pytest.raises(ValueError, match="irreps_query"):
        EquivariantAttention("4x0e", "4x0e + 3x1o", "4x0e", "4x0e", 1.0, num_heads=2)
    with pytest.raises(ValueError, match="irreps_input must be e3nn irreps"):
        EquivariantAttention("nonsense", "4x0e", "4x0e", "4x0e", 1.0)
    with pytest.raises(ValueError, match="max_radius"):
        EquivariantAttention("4x0e", "4x0e", "4x0e", "4x0e", -1.0)
    with pytest.raises(ValueError, match="aggregation"):
        EquivariantAttention("4x0e", "4x0e", "4x0e", "4x0e", 1.0, aggregation="mean")


def test_public_attributes_and_string_irreps():
    layer = EquivariantAttention(o3.Irreps("4x0e"), "4x0e", "4x0e", "2x1o", 1.0)
    assert isinstance(layer.irreps_input, o3.Irreps) and layer.irreps_output == o3.Irreps("2x1o")
    assert e3attn.EquivariantAttention is EquivariantAttention


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")
def test_cuda_matches_cpu():
    layer = make_layer(PARITY, num_heads=2)
    pos, f, batch = random_graphs(3, 10, PARITY[0])
    cpu = layer(f, pos, batch=batch)
    gpu = layer.cuda()(f.cuda(), pos.cuda(), batch=batch.cuda())
    torch.testing.assert_close(gpu.cpu(), cpu, atol=1e-10, rtol=0)

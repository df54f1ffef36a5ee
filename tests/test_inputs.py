"""Inputs that used to give wrong answers or cryptic errors: dtypes, numbers, extreme scales, inference mode."""
import math

import numpy as np
import pytest
import torch

import e3attn
from e3attn import (
    EquivariantAttention,
    GraphMultiHeadAttention,
    IrrepsLinear,
    MultiHeadAttention,
    MultiHeadDot,
    RadialEmbedding,
    RadialMLP,
    SphericalHarmonics,
    cutoff_weight,
    dense_attention,
    graph_attention,
    soft_unit_step,
    split_heads,
)
from e3attn.models import EquivariantLayerNorm, EquivariantTransformer, edge_vectors, energy_and_forces
from e3attn.viz import attention_centrality, attention_matrix, sparsify

IRREPS = "4x0e + 2x1o"


def make_layer(**kwargs):
    torch.manual_seed(0)
    return EquivariantAttention(IRREPS, IRREPS, IRREPS, IRREPS, kwargs.pop("max_radius", 1.5), **kwargs)


def graph_inputs(n=6, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, generator=gen, dtype=dtype), torch.randn(n, 10, generator=gen, dtype=dtype)


# ----------------------------------------------------------------------------- dtypes


def test_layer_names_the_argument_with_the_wrong_dtype():
    layer = make_layer()
    pos, f = graph_inputs()
    edge_index = e3attn.radius_graph(pos, 1.5)
    vec = pos[edge_index[0]] - pos[edge_index[1]]
    layer_dtype = r"expected torch.float32 \(the dtype of the layer\)"
    cases = [
        (lambda: layer(f.double(), pos), "f has dtype torch.float64, " + layer_dtype),
        (lambda: layer(f.half(), pos.half()), "f has dtype torch.float16, " + layer_dtype),
        (lambda: layer(f, pos.double()), "pos has dtype torch.float64, " + layer_dtype),
        (lambda: layer(f, pos, edge_index, edge_vec=vec.double()), "edge_vec has dtype torch.float64, " + layer_dtype),
        (lambda: layer(f, pos, edge_index, edge_vec=vec.long()), "edge_vec must be a floating-point tensor, got "
                                                                 "dtype torch.int64"),
        (lambda: layer.dense(f.double(), pos), "f has dtype torch.float64, " + layer_dtype),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
    assert layer.double()(f.double(), pos.double()).dtype == torch.float64  # converting either side works


def test_models_and_modules_name_the_argument_with_the_wrong_dtype():
    torch.manual_seed(0)
    model = EquivariantTransformer("1x0e", "8x0e + 2x1o", "0e", 1.5, irreps_node_attr="2x0e")
    pos, _ = graph_inputs()
    attr = torch.ones(6, 2)
    edge_index = e3attn.radius_graph(pos, 1.5)
    vec = pos[edge_index[0]] - pos[edge_index[1]]
    cases = [
        (lambda: model(pos.double(), node_attr=attr), r"pos has dtype torch.float64, expected torch.float32 \(the dtype "
                                                      r"of the model\): convert pos with .to\(torch.float32\)"),
        (lambda: model(pos, torch.ones(6, 1, dtype=torch.float64), node_attr=attr), "x has dtype torch.float64"),
        (lambda: model(pos, node_attr=attr.double()), "node_attr has dtype torch.float64"),
        (lambda: model(pos, None, None, edge_index, vec.double(), node_attr=attr), "edge_vec has dtype torch.float64"),
        (lambda: MultiHeadAttention(8, 2)(torch.randn(3, 8, dtype=torch.float64)), "query has dtype torch.float64"),
        (lambda: MultiHeadAttention(8, 2)(torch.randn(3, 8), torch.randn(4, 8).half()), "key has dtype torch.float16"),
        (lambda: GraphMultiHeadAttention(8, 2)(torch.randn(2, 8).double(), edge_index[:, :0]), "x has dtype"),
        (lambda: IrrepsLinear(IRREPS, IRREPS)(torch.randn(2, 10).double()), "x has dtype torch.float64"),
        (lambda: EquivariantLayerNorm(IRREPS)(torch.randn(2, 10).double()), "x has dtype torch.float64"),
        (lambda: MultiHeadDot("2x0e", "2x0e").project_query(torch.randn(2, 2).double()), "q has dtype"),
        (lambda: RadialMLP(4, 8, [3])(torch.randn(2, 4).double()), "emb has dtype torch.float64"),
        (lambda: RadialEmbedding(4, 1.0)(torch.arange(3)), "r must be a floating-point tensor"),
        (lambda: SphericalHarmonics(2)(torch.ones(2, 3, dtype=torch.long)), "vectors must be a floating-point"),
        (lambda: dense_attention(torch.randn(2, 3), torch.randn(2, 3).double(), torch.randn(2, 1)),
         "q, k and v must share a dtype, got q torch.float32, k torch.float64 and v torch.float32"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()


def test_edge_vectors_names_a_cell_of_another_dtype():
    pos = torch.zeros(2, 3)
    edge_index, shifts = torch.tensor([[1], [0]]), torch.tensor([[1.0, 0.0, 0.0]])
    with pytest.raises(ValueError, match=r"cell has dtype torch.float64, expected torch.float32 \(the dtype of pos\)"):
        edge_vectors(pos, edge_index, shifts, torch.eye(3, dtype=torch.float64))


# ----------------------------------------------------------------------------- energies and forces without autograd


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_energy_and_forces_under_no_grad_and_inference_mode(context):
    torch.manual_seed(0)
    model = EquivariantTransformer("1x0e", "8x0e + 2x1o", "0e", 1.5, num_layers=1, reduce="sum").eval()
    pos = torch.randn(6, 3)
    energy, forces = energy_and_forces(model, pos)
    with context():
        inner = pos.clone()  # an inference tensor under inference_mode
        e, f = energy_and_forces(model, inner)
    assert not f.is_inference()
    assert torch.equal(e.detach(), energy.detach()) and torch.equal(f, forces)
    e, f = energy_and_forces(model, inner)  # an inference tensor, used outside inference mode
    assert torch.equal(f, forces)


def test_energy_and_forces_periodic_under_inference_mode():
    torch.manual_seed(0)
    model = EquivariantTransformer("1x0e", "8x0e + 2x1o", "0e", 1.2, num_layers=1, reduce="sum").eval()
    cell = 2.0 * torch.eye(3)
    pos = torch.rand(4, 3) * 2.0
    edge_index, shifts = e3attn.radius_graph_pbc(pos, cell, True, 1.2)
    expected = energy_and_forces(model, pos, edge_index=edge_index, shifts=shifts, cell=cell)
    with torch.inference_mode():
        inputs = [t.clone() for t in (pos, edge_index, shifts, cell)]
        e, f = energy_and_forces(model, inputs[0], edge_index=inputs[1], shifts=inputs[2], cell=inputs[3])
    assert torch.equal(e.detach(), expected[0].detach()) and torch.equal(f, expected[1])


# ----------------------------------------------------------------------------- the smooth step and the cutoff


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_soft_unit_step_has_finite_exact_gradients_for_tiny_x(dtype):
    x = torch.tensor([-1.0, 0.0, 1e-45, 1e-39, 1e-30, 1e-21, 1e-10, 1e-3, 1 / 700, 0.01, 0.5, 3.0], dtype=dtype)
    x = x.requires_grad_(True)
    u = soft_unit_step(x)
    (grad,) = torch.autograd.grad(u.sum(), x)
    assert torch.isfinite(grad).all()
    x64 = x.detach().double()
    positive = x64 > 0
    safe = torch.where(positive, x64, torch.ones_like(x64))
    exact_u = torch.where(positive, torch.exp(-1 / safe), torch.zeros_like(x64))
    exact_grad = torch.where(positive, torch.exp(-1 / safe - 2 * torch.log(safe)), torch.zeros_like(x64))
    tiny = torch.finfo(dtype).tiny  # below it, float32 rounds subnormal products coarsely
    torch.testing.assert_close(u.detach().double(), exact_u.to(dtype).double(), atol=tiny, rtol=1e-6)
    torch.testing.assert_close(grad.double(), exact_grad.to(dtype).double(), atol=tiny, rtol=1e-5)
    (second,) = torch.autograd.grad(torch.autograd.grad(soft_unit_step(x).sum(), x, create_graph=True)[0].sum(), x)
    assert torch.isfinite(second).all()


def test_coincident_points_finite_forces_nan_second_derivatives():
    """What the docs say about r = 0: the cutoff has a kink in the positions there."""
    pos = torch.tensor([[0.3, -0.2, 0.1], [0.3, -0.2, 0.1]], dtype=torch.float64, requires_grad=True)
    c = cutoff_weight((pos[1] - pos[0]).norm(), 1.5)
    assert c.item() == pytest.approx(math.exp(-0.1), rel=1e-15)
    (grad,) = torch.autograd.grad(c, pos, create_graph=True)
    assert torch.isfinite(grad).all()
    (second,) = torch.autograd.grad(grad.sum(), pos)
    assert torch.isnan(second).all()


# ----------------------------------------------------------------------------- extreme scales


def test_max_radius_whose_square_overflows_is_refused():
    pos, f = graph_inputs()
    big = make_layer(max_radius=1e39)  # fine in float64: distances up to 1e39 square to 1e78
    with pytest.raises(ValueError, match=r"max_radius = 1e\+39 is too large for torch.float32.*use float64"):
        big(f, pos)
    with pytest.raises(ValueError, match="max_radius = 1e\\+39 is too large for torch.float32"):
        big.dense(f, pos)
    big = big.double()
    pos64 = (pos.double() * 1e38).requires_grad_(True)
    out = big(f.double(), pos64)
    (grad,) = torch.autograd.grad(out.pow(2).sum(), pos64)
    assert torch.isfinite(out).all() and out.abs().max() > 0 and torch.isfinite(grad).all()
    with pytest.raises(ValueError, match="max_radius = 1e\\+160 is too large for torch.float64"):
        make_layer(max_radius=1e160)
    with pytest.raises(ValueError, match="max_radius = 1e\\+160 is too large"):
        EquivariantTransformer("1x0e", "4x0e", "0e", 1e160)
    near = make_layer(max_radius=1e18)  # just below the float32 limit: works
    out = near(f, pos * 1e17)
    assert torch.isfinite(out).all() and out.abs().max() > 0


def test_tiny_temperature_gives_hard_attention_or_a_clear_error():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(5, 4, generator=gen, requires_grad=True) for _ in range(3))
    edge_index = torch.tensor([[0, 1, 2, 3, 4, 1, 2], [0, 0, 0, 1, 1, 2, 2]])
    mask = torch.zeros(5, 5, dtype=torch.bool)
    mask[edge_index[1], edge_index[0]] = True
    for dtype, temperature in [(torch.float32, 1e-30), (torch.float64, 1e-40), (torch.float64, 1e-300)]:
        qd, kd, vd = (x.to(dtype) for x in (q, k, v))
        out, w = dense_attention(qd, kd, vd, mask=mask, temperature=temperature)
        hard_out, hard = dense_attention(qd, kd, vd, mask=mask, temperature=0.0)
        assert torch.equal(w, hard) and torch.equal(out, hard_out)  # no ties: exactly the arg-max
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        assert all(torch.isfinite(g).all() for g in grads)
        out_g, alpha = graph_attention(qd, kd, vd, edge_index, temperature=temperature)
        torch.testing.assert_close(alpha, w[edge_index[1], edge_index[0]], atol=0, rtol=0)
        torch.testing.assert_close(out_g, out, atol=1e-6, rtol=0)
    for call in (lambda t: dense_attention(q, k, v, temperature=t), lambda t: graph_attention(q, k, v, edge_index,
                                                                                             temperature=t)):
        with pytest.raises(ValueError, match=r"temperature = 1e-40 is outside the normal range of torch.float32"):
            call(1e-40)
        with pytest.raises(ValueError, match=r"temperature = 1e\+39 is outside the normal range of torch.float32"):
            call(1e39)


def test_moderate_temperatures_unchanged():
    """Subtracting the maximum before dividing by T changes nothing for ordinary temperatures."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(4, 6, 3, generator=gen, dtype=torch.float64) for _ in range(3))
    for temperature in (0.05, 0.5, 2.0, 1e3):
        _, w = dense_attention(q, k, v, temperature=temperature)
        s = q @ k.transpose(-1, -2) / math.sqrt(3) / temperature
        torch.testing.assert_close(w, torch.softmax(s, dim=-1), atol=1e-15, rtol=0)


# ----------------------------------------------------------------------------- numbers: no bools, NumPy welcome


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: make_layer(num_heads=True), "num_heads must be a positive integer, got True"),
        (lambda: make_layer(max_radius=True), "max_radius must be a positive finite number, got True"),
        (lambda: make_layer(lmax=np.bool_(True)), "lmax must be a non-negative integer"),
        (lambda: make_layer(number_of_basis=True), "number_of_basis must be a positive integer"),
        (lambda: make_layer(radial_neurons=True), "radial_neurons must be a positive integer"),
        (lambda: make_layer(num_heads=np.float64(2.0)), "num_heads must be a positive integer"),
        (lambda: EquivariantTransformer("1x0e", "4x0e", "0e", 1.5, num_layers=True), "num_layers must be a positive"),
        (lambda: EquivariantTransformer("1x0e", "4x0e", "0e", True), "max_radius must be a positive finite number"),
        (lambda: MultiHeadAttention(8, True), "num_heads must be a positive integer, got True"),
        (lambda: MultiHeadAttention(8, 2, dropout=False), "dropout must be a probability"),
        (lambda: dense_attention(*torch.randn(3, 2, 2), temperature=True), "temperature must be a number"),
        (lambda: dense_attention(*torch.randn(3, 2, 2), dropout_p=False), "dropout_p must be a probability"),
        (lambda: split_heads("4x0e", True), "num_heads must be a positive integer"),
        (lambda: RadialEmbedding(True, 1.0), "number_of_basis must be a positive integer"),
        (lambda: cutoff_weight(torch.ones(2), True), "max_radius must be a positive finite number"),
        (lambda: SphericalHarmonics(True), "lmax must be a non-negative integer"),
        (lambda: SphericalHarmonics(13), "lmax must be at most 12 \\(the degrees of e3nn's spherical harmonics\\), got 13"),
        # refused before anything is sized by the degree (the harmonics' irreps would be built first)
        (lambda: make_layer(lmax=10**9), "lmax must be at most 12"),
        (lambda: EquivariantLayerNorm("2x0e", eps=True), "eps must be a positive finite number"),
        (lambda: sparsify(torch.tensor([[0], [1]]), torch.ones(1), top_k=True), "top_k must be a non-negative"),
        (lambda: attention_centrality(torch.tensor([[0], [1]]), torch.ones(1), 2, max_iter=True), "max_iter must be"),
        (lambda: attention_matrix(torch.tensor([[0], [1]]), torch.ones(1), True), "num_nodes must be a non-negative"),
    ],
)
def test_booleans_are_never_numbers(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_numpy_scalars_are_accepted_where_python_numbers_are():
    pos, f = graph_inputs()
    layer = make_layer(max_radius=1.5, num_heads=2, lmax=2, number_of_basis=8, radial_neurons=12)
    twin = make_layer(max_radius=np.float32(1.5), num_heads=np.int64(2), lmax=np.int32(2),
                      number_of_basis=np.int64(8), radial_neurons=np.int16(12))
    assert type(twin.max_radius) is float and type(twin.num_heads) is int
    assert torch.equal(twin(f, pos), layer(f, pos))

    q, k, v = torch.randn(3, 4, 2)
    assert torch.equal(dense_attention(q, k, v, temperature=np.float32(0.5), dropout_p=np.float64(0.0))[1],
                       dense_attention(q, k, v, temperature=0.5)[1])
    torch.manual_seed(0)
    mha = MultiHeadAttention(np.int64(8), np.int32(2), head_dim=np.int64(3), dropout=np.float32(0.0))
    assert (mha.embed_dim, mha.num_heads, mha.head_dim, mha.dropout) == (8, 2, 3, 0.0)
    assert type(mha.embed_dim) is int
    assert torch.equal(cutoff_weight(torch.tensor([0.5]), np.float32(1.5)), cutoff_weight(torch.tensor([0.5]), 1.5))
    assert SphericalHarmonics(np.int64(2)).lmax == 2 and type(SphericalHarmonics(np.int64(2)).lmax) is int
    assert str(split_heads("4x0e", np.int64(2))) == "2x0e"
    assert EquivariantLayerNorm("2x0e", eps=np.float32(1e-5)).eps == pytest.approx(1e-5)
    edge_index, alpha = torch.tensor([[0, 1], [1, 0]]), torch.tensor([0.5, 1.0])
    assert torch.equal(sparsify(edge_index, alpha, top_k=np.int64(1))[0], sparsify(edge_index, alpha, top_k=1)[0])


def test_a_model_checks_each_input_value_once_per_call(monkeypatch):
    """EquivariantTransformer checks the values of its inputs (finite positions and edge vectors, edges in range)
    itself and lets its blocks skip the same checks (on a GPU each is a wait for the device); every call checks
    them again, also after writes that bypass PyTorch's version counter."""
    import e3attn._checks as checks

    model = EquivariantTransformer("1x0e", "8x0e + 4x1o", "0e", 2.0, num_layers=2, reduce="sum").double()
    pos = torch.randn(6, 3, dtype=torch.float64)
    edge_index = e3attn.radius_graph(pos, 2.0)
    performed, skip = [], checks._skip_values

    def counted() -> bool:
        skipped = skip()
        performed.extend([] if skipped else [1])
        return skipped

    monkeypatch.setattr(checks, "_skip_values", counted)
    model(pos, edge_index=edge_index)
    assert len(performed) == 3  # pos, edge_index and the edge vectors, once each
    pos.data[0, 0] = float("nan")  # not seen by the version counter: checked anyway
    with pytest.raises(ValueError, match="pos contains NaN"):
        model(pos, edge_index=edge_index)

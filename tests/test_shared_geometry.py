"""The edge geometry computed once for all the blocks of a model (e3attn.edge_geometry.shared_edge_geometry): equal to
every layer's own, the model's energies, forces and force-training gradients unchanged (on the kernels and on the
plain formulation, with sorted and unsorted edges), and clear errors for geometry that does not fit."""
import pytest
import torch

import e3attn.models.transformer as transformer
from e3attn import EquivariantAttention
from e3attn.edge_geometry import edge_geometry, shared_edge_geometry
from e3attn.models import EquivariantTransformer, NeighbourDensity, energy_and_forces
from kernel_switch import plain


def _model(lmax=2, layers=2, **options):
    torch.manual_seed(0)
    return EquivariantTransformer("1x0e", "6x0e + 2x1o + 2x2e", "0e", 1.6, num_layers=layers, num_heads=2, lmax=lmax,
                                  irreps_node_attr="2x0e", reduce="sum", density_channels=4, basis="bessel",
                                  avg_num_neighbors=3.0, **options)


MODELS = [{}, dict(lmax=1, density_lmax=2, density_angular_channels=2)]  # the second: harmonics of two degrees


def _inputs(num=9, seed=1, shuffle=False):
    g = torch.Generator().manual_seed(seed)
    pos = torch.randn(num, 3, generator=g, dtype=torch.float64)
    species = torch.randint(0, 2, (num,), generator=g)
    src, dst = [t.reshape(-1) for t in torch.meshgrid(torch.arange(num), torch.arange(num), indexing="xy")]
    keep = src != dst
    edge_index = torch.stack([src[keep], dst[keep]])  # grouped by destination
    if shuffle:
        edge_index = edge_index[:, torch.randperm(edge_index.shape[1], generator=g)]
    return pos, torch.nn.functional.one_hot(species, 2).double(), edge_index


def _own(monkeypatch):
    """Every layer computes its own geometry, as before the geometry was shared."""
    monkeypatch.setattr(transformer, "shared_edge_geometry", lambda edge_vec, layers: [None] * len(layers))


def _energy_forces_and_training_gradients(model, pos, node_attr, edge_index):
    energy, forces = energy_and_forces(model, pos, node_attr=node_attr, edge_index=edge_index, create_graph=True)
    weights = torch.linspace(-1.0, 1.0, forces.numel(), dtype=forces.dtype).reshape(forces.shape)
    loss = energy.square().sum() + (forces * weights).sum()
    grads = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad], allow_unused=True)
    return [energy.detach(), forces.detach()] + [g for g in grads if g is not None]


@pytest.mark.parametrize("kernels_on", [True, False])
def test_shared_geometry_equals_each_layers_own(kernels_on, float64_default):
    model = _model()
    layers = [m for block in model.layers for m in block.geometry_layers()]
    assert [type(m) for m in layers] == [EquivariantAttention, NeighbourDensity] * 2
    v = torch.randn(40, 3, generator=torch.Generator().manual_seed(3))
    v[0] = 0.0  # a zero-length edge and one beyond the cutoff
    v[1] = torch.tensor([2.0, 0.0, 0.0])
    with torch.no_grad():  # frozen: the kernels' path where they run

        def compute():
            shared = shared_edge_geometry(v, layers)
            own = [edge_geometry(v, m.radial.input_layer(), getattr(m, "sh", None) or layers[0].sh,
                                 m.embedding, m._plain_geometry) for m in layers]
            return shared, own

        shared, own = compute() if kernels_on else plain(compute)
    for m, (sh, pre, r), (sh2, pre2, r2) in zip(layers, shared, own):
        torch.testing.assert_close(pre, pre2, atol=1e-14, rtol=1e-14)
        # each layer's own columns, not a strided slice of all of them: its activation takes PyTorch's vectorised
        # loops (on a slice of 16 columns, with AVX-512, it ran more than ten times slower)
        assert pre.is_contiguous()
        torch.testing.assert_close(r, r2, atol=1e-15, rtol=0)
        if isinstance(m, EquivariantAttention):
            torch.testing.assert_close(sh, sh2, atol=1e-15, rtol=0)


@pytest.mark.parametrize("options", MODELS)
@pytest.mark.parametrize("kernels_on", [True, False])
@pytest.mark.parametrize("shuffle", [False, True])
def test_model_unchanged_by_sharing_the_geometry(kernels_on, shuffle, options, float64_default, monkeypatch):
    """Energies, forces, and the gradients of a force loss in every parameter (second derivatives), with the
    geometry shared against every layer's own."""
    model = _model(**options)
    pos, node_attr, edge_index = _inputs(shuffle=shuffle)

    def run():
        return _energy_forces_and_training_gradients(model, pos, node_attr, edge_index)

    shared = run() if kernels_on else plain(run)
    with monkeypatch.context() as m:
        _own(m)
        own = run() if kernels_on else plain(run)
    assert len(shared) == len(own) > 2
    for a, b in zip(shared, own):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("options", MODELS)
def test_model_with_frozen_weights_unchanged_by_sharing(options, float64_default, monkeypatch):
    """The calculator's call (frozen weights: the geometry on the kernels, in one pass for all the blocks)."""
    model = _model(**options).requires_grad_(False)
    pos, node_attr, edge_index = _inputs()
    shared = energy_and_forces(model, pos, node_attr=node_attr, edge_index=edge_index)
    _own(monkeypatch)
    own = energy_and_forces(model, pos, node_attr=node_attr, edge_index=edge_index)
    for a, b in zip(shared, own):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_geometry_that_does_not_fit_is_refused(float64_default):
    model = _model()
    attention, density = model.layers[0].geometry_layers()
    pos, node_attr, edge_index = _inputs()
    f = torch.randn(pos.shape[0], attention.irreps_input.dim)
    edge_vec = pos[edge_index[0]] - pos[edge_index[1]]
    sh, pre, r = shared_edge_geometry(edge_vec, [attention, density])[0]
    with pytest.raises(ValueError, match="geometry was given without edge_index"):
        attention(f, pos, geometry=(sh, pre, r))
    with pytest.raises(ValueError, match="geometry must have the shapes"):
        attention(f, pos, edge_index, geometry=(sh, pre[:, 1:], r))
    with pytest.raises(ValueError, match="geometry must be a tuple"):
        attention(f, pos, edge_index, geometry=(sh, pre))
    with pytest.raises(ValueError, match="geometry must hold p"):
        density(f, edge_index, edge_vec, (sh, pre, r))  # the attention's first layer, not the density's
    with pytest.raises(ValueError, match="embed the lengths alike"):
        shared_edge_geometry(edge_vec, [attention, NeighbourDensity("6x0e", 2, 1.6)])  # smooth_finite basis
    assert shared_edge_geometry(edge_vec, []) == []


def test_layers_of_other_degrees_get_their_own_harmonics(float64_default):
    """Harmonics of several degrees: computed once, of the largest, and every layer gets those of its own degree."""
    layers = [EquivariantAttention("6x0e + 2x1o", "2x0e", "2x0e", "2x0e", 1.6, lmax=lmax, basis="bessel")
              for lmax in (1, 3)] + [NeighbourDensity("6x0e", 2, 1.6, basis="bessel", lmax=2),
                                     NeighbourDensity("6x0e", 2, 1.6, basis="bessel")]
    edge_vec = torch.randn(11, 3, generator=torch.Generator().manual_seed(2))
    shared = shared_edge_geometry(edge_vec, layers)
    for layer, (sh, pre, r) in zip(layers, shared):
        own_sh, own_pre, own_r = edge_geometry(edge_vec, layer.radial.input_layer(), layer.sh or layers[1].sh,
                                               layer.embedding, layer._plain_geometry)
        torch.testing.assert_close(pre, own_pre, atol=1e-13, rtol=0)
        if layer.sh is not None:
            assert sh.shape[1] == (layer.sh.lmax + 1) ** 2
            torch.testing.assert_close(sh, own_sh, atol=1e-13, rtol=0)
    assert shared[3][0].shape[1] == 16  # a layer without harmonics gets them too, and ignores them


def test_geometry_given_to_the_layer_equals_its_own(float64_default):
    """A layer given its own geometry (computed beforehand) returns what it computes from the edge vectors."""
    layer = _model().layers[1].attention
    pos, _, edge_index = _inputs(shuffle=True)
    f = torch.randn(pos.shape[0], layer.irreps_input.dim, generator=torch.Generator().manual_seed(5))
    edge_vec = pos[edge_index[0]] - pos[edge_index[1]]
    (geometry,) = shared_edge_geometry(edge_vec, [layer])
    out, alpha = layer(f, pos, edge_index, edge_vec=edge_vec, geometry=geometry, return_attention=True)
    out2, alpha2 = layer(f, pos, edge_index, edge_vec=edge_vec, return_attention=True)
    torch.testing.assert_close(out, out2, atol=1e-13, rtol=0)
    torch.testing.assert_close(alpha, alpha2, atol=1e-13, rtol=0)


def test_model_under_autocast_unchanged_by_sharing(monkeypatch):
    """Under bfloat16 autocast the geometry and the density channels' outputs come out in bfloat16 (the weights
    stay float32): accepted (``--amp``), the forces those of every layer's own geometry and of float32 to bfloat16's
    resolution."""
    model = _model().float()
    pos, node_attr, edge_index = (t.float() if t.is_floating_point() else t for t in _inputs())

    def forces():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return energy_and_forces(model, pos, node_attr=node_attr, edge_index=edge_index)[1].float()

    shared = forces()
    exact = energy_and_forces(model, pos, node_attr=node_attr, edge_index=edge_index)[1]
    _own(monkeypatch)
    own = forces()
    assert torch.isfinite(shared).all()
    torch.testing.assert_close(shared, own, atol=3e-2 * own.abs().max().item(), rtol=0)
    torch.testing.assert_close(shared, exact, atol=6e-2 * exact.abs().max().item(), rtol=0)  # bfloat16: 8 bits

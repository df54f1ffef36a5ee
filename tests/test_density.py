import pytest
import torch

from e3attn.graph import radius_graph
from e3attn.models import EquivariantTransformer, NeighbourDensity, energy_and_forces
from e3attn.models.checkpoint import load_checkpoint, save_checkpoint
from e3attn.radial import soft_unit_step
from e3attn.testing import assert_equivariant, assert_smooth_cutoff

IRREPS = "4x0e + 2x0o + 2x1o + 2x1e"
HIDDEN = "4x0e + 2x0o + 2x1o + 2x1e + 2x2e"
MAX_RADIUS = 1.6


def make_density(seed=0, **kwargs):
    torch.manual_seed(seed)
    return NeighbourDensity(IRREPS, 5, MAX_RADIUS, **kwargs).double()


def cluster(n=7, seed=1):
    gen = torch.Generator().manual_seed(seed)
    pos = 1.6 * torch.rand(n, 3, generator=gen, dtype=torch.float64)
    f = torch.randn(n, 18, generator=gen, dtype=torch.float64)
    return pos, f


def density_of(density, pos, f):
    edge_index = radius_graph(pos, density.max_radius)
    return density(f, edge_index, pos[edge_index[0]] - pos[edge_index[1]])


# ---------------------------------------------------------------- the module


def neighbour_terms(density, pos, f, i):
    """``(j, unit vector j - i, c(r) R(r) [outputs], s_j [num_channels])`` of every neighbour j of node i, by loops."""
    w_s = density.source.weight.reshape(4, -1) / 2.0  # IrrepsLinear normalisation 1/sqrt(fan-in)
    for j in range(pos.shape[0]):
        r = (pos[j] - pos[i]).norm()
        if j == i or r >= MAX_RADIUS:
            continue
        (radial,) = density.radial(density.embedding(r[None]))
        c = soft_unit_step(10.0 * (1.0 - r / MAX_RADIUS))
        yield j, (pos[j] - pos[i]) / r, c * radial[0], f[j, :4] @ w_s  # the 4x0e of IRREPS; no other irreps


def test_density_equals_loop_over_neighbours():
    density = make_density(avg_num_neighbors=2.5)
    pos, f = cluster()
    expected = torch.zeros(pos.shape[0], 5, dtype=torch.float64)
    for i in range(pos.shape[0]):
        for _, _, radial, s in neighbour_terms(density, pos, f, i):
            expected[i] += radial * s / 2.5
    out = density_of(density, pos, f)
    assert expected.abs().max() > 1e-2
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)


LEGENDRE = [lambda x: 1.0 + 0 * x, lambda x: x, lambda x: (3 * x**2 - 1) / 2, lambda x: (5 * x**3 - 3 * x) / 2]


@pytest.mark.parametrize("lmax, angular", [(1, 5), (2, 3), (3, 2)])
def test_angular_density_equals_sum_over_pairs_of_neighbours(lmax, angular):
    """The power spectrum against the addition theorem, sums over pairs of neighbours of Legendre polynomials of
    their bond angle (no spherical harmonics), and the densities against the plain module's."""
    density = make_density(avg_num_neighbors=2.5, basis="bessel", lmax=lmax, angular_channels=angular)
    pos, f = cluster()
    expected = torch.zeros(pos.shape[0], 5 + angular * lmax, dtype=torch.float64)
    for i in range(pos.shape[0]):
        neighbours = [(u, radial * torch.cat([s, s[:angular].repeat_interleave(lmax)]) / 2.5)  # [K + K_a lmax] w / nu
                      for _, u, radial, s in neighbour_terms(density, pos, f, i)]
        for u, w in neighbours:
            expected[i, :5] += w[:5]
            for v, w2 in neighbours:
                angular_terms = (w[5:] * w2[5:]).view(angular, lmax)
                for l in range(1, lmax + 1):
                    expected[i, 5 + (l - 1) :: lmax] += angular_terms[:, l - 1] * LEGENDRE[l](u @ v)
    out = density_of(density, pos, f)
    assert expected[:, 5:].abs().min() > 1e-4  # every power is tested, none is 0 == 0
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
    plain = make_density(avg_num_neighbors=2.5, basis="bessel")
    with torch.no_grad():  # the same weights, the densities' columns of the last layer
        plain.radial.weight1.copy_(density.radial.weight1)
        plain.radial.weight2[0].copy_(density.radial.weight2[0][:, :5])
        plain.source.weight.copy_(density.source.weight)
    torch.testing.assert_close(density_of(plain, pos, f), out[:, :5], atol=1e-12, rtol=0)


def test_density_grows_with_the_number_of_neighbours():
    # k identical neighbours at one distance: k times one neighbour's density (attention would give the same
    # output for every k, its weights summing to one)
    density = make_density()
    f = torch.zeros(9, 18, dtype=torch.float64)
    f[:, :4] = torch.tensor([0.3, -1.0, 0.5, 2.0], dtype=torch.float64)
    directions = torch.eye(3, dtype=torch.float64).repeat(3, 1)[:8] * torch.tensor([1.0, -1.0]).repeat_interleave(4)[:, None]
    for k in (1, 2, 4, 8):
        pos = torch.cat([torch.zeros(1, 3, dtype=torch.float64), 1.1 * directions[:k]])
        edge_index = torch.stack([torch.arange(1, k + 1), torch.zeros(k, dtype=torch.long)])
        rho = density(f[: k + 1], edge_index, pos[edge_index[0]] - pos[edge_index[1]])
        if k == 1:
            single = rho[0]
            assert single.abs().max() > 1e-2
        torch.testing.assert_close(rho[0], k * single, atol=1e-12, rtol=0)


@pytest.mark.parametrize("lmax", [0, 2])
def test_density_o3_invariant(lmax):
    density = make_density(lmax=lmax, angular_channels=3 if lmax else None)
    pos, f = cluster()
    err = assert_equivariant(
        lambda pos, f: density_of(density, pos, f), [pos, f], ["cartesian_points", IRREPS],
        [f"{density.num_features}x0e"], ntrials=3
    )
    assert err <= 1e-10


@pytest.mark.parametrize("lmax", [0, 2])
def test_density_smooth_at_the_cutoff(lmax):
    density = make_density(lmax=lmax)
    pos, f = cluster(n=4)
    pos[1:3] = pos[0] + torch.tensor([[0.5, 0.2, 0.1], [-0.3, 0.6, 0.2]], dtype=torch.float64)
    assert_smooth_cutoff(lambda pos: density_of(density, pos, f), pos, max_radius=MAX_RADIUS)


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        (("2x1o", 4, 1.0), {}, "irreps_in must hold even scalars"),
        ((IRREPS, 0, 1.0), {}, "num_channels must be a positive int"),
        ((IRREPS, 4, 1.0), dict(avg_num_neighbors=0.0), "avg_num_neighbors must be a positive number"),
        ((IRREPS, 4, 1.0), dict(lmax=-1), "lmax must be"),
        ((IRREPS, 4, 1.0), dict(lmax=2, angular_channels=5), "angular_channels must be at most num_channels"),
        ((IRREPS, 4, 1.0), dict(lmax=2, angular_channels=0), "angular_channels must be"),
        ((IRREPS, 4, 1.0), dict(lmax=13), "lmax must be at most 12"),
        # checked before anything is sized by it (a huge degree would allocate first)
        ((IRREPS, 4, 1.0), dict(lmax=10**9), "lmax must be at most 12"),
        ((IRREPS, 4, 1.0), dict(angular_channels=2), r"angular_channels=2 needs lmax > 0"),
        ((IRREPS, 4, 1.0), dict(angular_channels=-7), "angular_channels must be a positive integer"),
        ((IRREPS, 4, 1.0), dict(angular_channels="x"), "angular_channels must be a positive integer"),
    ],
)
def test_density_rejects_bad_configuration(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        NeighbourDensity(*args, **kwargs)


# ---------------------------------------------------------------- in the transformer


def make_model(seed=0, **kwargs):
    torch.manual_seed(seed)
    kwargs = {"irreps_node_attr": "3x0e", **kwargs}
    return EquivariantTransformer("1x0e", HIDDEN, "1x0e + 1x1o", MAX_RADIUS, num_layers=2, num_heads=2, **kwargs).double()


VARIANTS = [
    dict(density_channels=4), dict(layer_norm="pre"), dict(layer_norm="none"),
    dict(density_channels=3, layer_norm="pre", basis="bessel"), dict(density_channels=3, basis="gaussian"),
    dict(self_connection="node_attr"), dict(self_connection="node_attr", layer_norm="pre", density_channels=3),
    dict(density_channels=3, density_lmax=2, density_angular_channels=2, basis="bessel"),
    dict(density_channels=3, density_lmax=3, lmax=1),
]  # their smoothness at the cutoff: tests/test_models.py::test_neighbour_fades_out_smoothly_at_the_cutoff


@pytest.mark.parametrize("options", VARIANTS)
def test_transformer_options_o3_equivariant(options):
    model = make_model(**options, avg_num_neighbors=3.0)
    pos, _ = cluster(n=9)
    attr = torch.nn.functional.one_hot(torch.arange(9) % 3, 3).double()
    out = model(pos, node_attr=attr)
    assert out[:, 0].abs().max() > 1e-2 and out[:, 1:].abs().max() > 1e-3  # the test is not 0 == 0
    err = assert_equivariant(
        lambda pos: model(pos, node_attr=attr), [pos], ["cartesian_points"], [model.irreps_out], ntrials=2
    )
    assert err <= 1e-10


def test_density_enters_the_energy_and_forces():
    torch.manual_seed(0)
    model = EquivariantTransformer(
        "1x0e", HIDDEN, "0e", MAX_RADIUS, num_layers=2, irreps_node_attr="3x0e", reduce="sum", density_channels=4
    ).double()
    pos, _ = cluster(n=9)
    attr = torch.nn.functional.one_hot(torch.arange(9) % 3, 3).double()
    energy, forces = energy_and_forces(model, pos, node_attr=attr, create_graph=True)
    (energy.sum() + forces.pow(2).sum()).backward()
    for block in model.layers:
        assert all(p.grad.abs().max() > 0 for p in block.density.parameters())
    with torch.no_grad():
        for block in model.layers:
            block.density_mix[-1].weight.zero_()
    without, _ = energy_and_forces(model, pos, node_attr=attr)
    assert (without - energy).abs().max() > 1e-3


def test_self_connection_depends_on_the_elements_in_every_block():
    model = make_model(self_connection="node_attr")
    pos, _ = cluster(n=9)
    attr = torch.nn.functional.one_hot(torch.arange(9) % 3, 3).double()
    model(pos, node_attr=attr).pow(2).sum().backward()
    for block in model.layers:
        assert block.skip.weight.grad.abs().max() > 1e-6
    # the block's residual for an atom of element s is a linear map of its own: W_s h, with W_s from the weights
    block, h = model.layers[0], torch.randn(9, block.skip.irreps_in1.dim, dtype=torch.float64)
    basis, elements = torch.eye(h.shape[1], dtype=h.dtype), torch.eye(3, dtype=h.dtype)
    per_element = torch.stack([block.skip(basis, elements[s].expand(h.shape[1], 3)) for s in range(3)])  # [s, in, out]
    expected = torch.einsum("ni,nio->no", h, per_element[torch.arange(9) % 3])
    torch.testing.assert_close(block.skip(h, attr), expected, rtol=1e-12, atol=1e-12)
    assert (per_element[0] - per_element[1]).abs().max() > 1e-3  # elements get maps of their own


def test_angular_density_enters_the_energy_and_forces():
    """The power spectrum reaches the energy, the forces and the force-training gradients of every block."""
    torch.manual_seed(0)
    model = EquivariantTransformer("1x0e", HIDDEN, "0e", MAX_RADIUS, num_layers=2, irreps_node_attr="3x0e",
                                   reduce="sum", density_channels=4, density_lmax=2, density_angular_channels=2,
                                   avg_num_neighbors=3.0).double()
    assert model.config["density_lmax"] == 2 and model.config["density_angular_channels"] == 2
    pos, _ = cluster(n=9)
    attr = torch.nn.functional.one_hot(torch.arange(9) % 3, 3).double()
    energy, forces = energy_and_forces(model, pos, node_attr=attr, create_graph=True)
    (energy.sum() + forces.pow(2).sum()).backward()
    for block in model.layers:
        power = block.density_mix[0].weight.grad[:, 4:]  # the mix's weights of the power spectrum's inputs
        assert power.shape == (4, 4) and power.abs().min() > 0
    default = make_model(density_channels=20, density_lmax=1)
    assert default.config["density_angular_channels"] == 16 and default.layers[0].density.num_features == 36
    fewer = make_model(density_channels=12, density_lmax=1)  # as many as there are channels
    assert fewer.config["density_angular_channels"] == 12 and fewer.layers[0].density.num_features == 24


@pytest.mark.parametrize("num_nodes", [0, 1])
def test_angular_density_on_an_empty_graph_and_a_lone_atom(num_nodes):
    density = make_density(lmax=2, angular_channels=3)
    out = density(torch.randn(num_nodes, 18, dtype=torch.float64), torch.zeros(2, 0, dtype=torch.long),
                  torch.zeros(0, 3, dtype=torch.float64))
    assert torch.equal(out, torch.zeros(num_nodes, 5 + 3 * 2, dtype=torch.float64))
    model = make_model(density_channels=4, density_lmax=2, reduce="sum")
    assert model(torch.zeros(0, 3, dtype=torch.float64), node_attr=torch.zeros(0, 3, dtype=torch.float64)).shape[1] == 4


def test_harmonics_that_do_not_fit_are_refused():
    density = make_density(lmax=2)
    pos, f = cluster()
    edge_index = radius_graph(pos, MAX_RADIUS)
    edge_vec = pos[edge_index[0]] - pos[edge_index[1]]
    y, p, r = density._plain_geometry(edge_vec, density.radial.input_layer())
    torch.testing.assert_close(density(f, edge_index, edge_vec, (y, p, r)), density(f, edge_index, edge_vec))
    with pytest.raises(ValueError, match=r"geometry must hold the harmonics Y \[\d+, 9\] \(degrees 0 to lmax=2\)"):
        density(f, edge_index, edge_vec, (y[:, :4], p, r))
    assert "lmax=2, angular_channels=5" in repr(density) and "15x0e" in repr(density)


def test_defaults_are_the_old_model():
    # the new options default to the model without them: same parameters, same outputs
    old_names = {"embedding.weight", "output.weight"}
    model = make_model()
    assert model.config["density_channels"] == 0 and model.config["layer_norm"] == "post"
    assert model.config["density_lmax"] == 0 and model.config["density_angular_channels"] is None
    assert model.config["self_connection"] == "identity"
    assert all(block.density is None and block.norm is not None and not block.pre_norm and block.skip is None
               for block in model.layers)
    assert old_names <= set(model.state_dict())
    assert not any("density" in name for name in model.state_dict())


def test_checkpoint_without_the_new_options_loads_as_the_old_model(tmp_path):
    model = make_model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    save_checkpoint(model, tmp_path / "model.pt")
    checkpoint = torch.load(tmp_path / "model.pt", weights_only=True)
    for key in ("density_channels", "avg_num_neighbors", "layer_norm", "basis", "self_connection",  # e3attn 0.1.0
                "density_lmax", "density_angular_channels"):
        del checkpoint["config"][key]
    # as that version wrote it: the digest of the weights only (format 2)
    checkpoint["format"] = "e3attn.models.checkpoint/2"
    del checkpoint["content_sha256"]
    torch.save(checkpoint, tmp_path / "old.pt")
    loaded, _ = load_checkpoint(tmp_path / "old.pt")
    pos, _ = cluster(n=9)
    attr = torch.nn.functional.one_hot(torch.arange(9) % 3, 3).double()
    assert loaded.config == model.config
    assert torch.equal(loaded(pos, node_attr=attr), model(pos, node_attr=attr))


@pytest.mark.parametrize("options", [dict(layer_norm="pre"), dict(self_connection="node_attr"),
                                     dict(density_lmax=2, density_angular_channels=3)])
def test_options_checkpoint_round_trip(tmp_path, options):
    model = make_model(density_channels=4, avg_num_neighbors=3.0, **options)
    save_checkpoint(model, tmp_path / "model.pt")
    loaded, _ = load_checkpoint(tmp_path / "model.pt")
    pos, _ = cluster(n=9)
    attr = torch.nn.functional.one_hot(torch.arange(9) % 3, 3).double()
    assert loaded.config == model.config
    assert torch.equal(loaded(pos, node_attr=attr), model(pos, node_attr=attr))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(density_channels=-1), "density_channels must be a non-negative int"),
        (dict(density_channels=True), "density_channels must be a non-negative int"),
        (dict(density_channels=2, avg_num_neighbors=-1.0), "avg_num_neighbors must be a positive number"),
        (dict(layer_norm=False), "layer_norm must be one of"),
        (dict(self_connection="attr"), "self_connection must be one of"),
        (dict(self_connection="node_attr", irreps_node_attr=None), "self_connection='node_attr' needs irreps_node_attr"),
        (dict(density_lmax=2), "density_lmax=2 needs density_channels > 0"),
        (dict(density_channels=2, density_lmax=-1), "density_lmax must be"),
        (dict(density_channels=2, density_lmax=1, density_angular_channels=3),
         "density_angular_channels must be at most density_channels"),
        (dict(density_channels=2, density_lmax=1, density_angular_channels=0), "density_angular_channels must be"),
        (dict(density_channels=2, density_angular_channels=2), "density_angular_channels=2 needs density_lmax > 0"),
        (dict(density_channels=2, density_angular_channels="x"), "density_angular_channels must be a positive"),
        (dict(density_channels=2, density_lmax=13), "density_lmax must be at most 12"),
        (dict(density_channels=2, density_lmax=10**9), "density_lmax must be at most 12"),
        (dict(lmax=10**9), "lmax must be at most 12"),
    ],
)
def test_transformer_rejects_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_model(**kwargs)


@pytest.mark.parametrize("num_nodes", [0, 1])
def test_self_connection_on_an_empty_graph_and_a_lone_atom(num_nodes):
    model = make_model(self_connection="node_attr")
    pos = torch.randn(num_nodes, 3, dtype=torch.float64, requires_grad=True)
    attr = torch.nn.functional.one_hot(torch.zeros(num_nodes, dtype=torch.long), 3).double()
    out = model(pos, node_attr=attr)
    assert out.shape == (num_nodes, model.irreps_out.dim)
    (grad,) = torch.autograd.grad(out.sum(), pos, allow_unused=True)
    assert grad is None or torch.equal(grad, torch.zeros_like(pos))  # no neighbour, no force

import itertools
import math

import pytest
import torch
from e3nn import o3

from e3attn.graph import radius_graph_pbc
from e3attn.heads import split_heads
from e3attn.models.checkpoint import load_checkpoint, save_checkpoint
from e3attn.models.energy import edge_vectors, energy_and_forces, energy_forces_stress
from e3attn.models.norm import EquivariantLayerNorm
from e3attn.models.gate import Gate, second_moment_constant
from e3attn.models.transformer import EquivariantTransformer
from e3attn.testing import assert_equivariant, assert_permutation_equivariant

HIDDEN = "4x0e + 2x0o + 2x1o + 2x1e + 2x2e"
ODD_OUT = "1x0e + 1x0o + 1x1o + 1x1e + 1x2o"


def make_model(irreps_out=ODD_OUT, seed=0, irreps_in="1x0e", **kwargs):
    torch.manual_seed(seed)
    kwargs.setdefault("num_layers", 2)
    kwargs.setdefault("num_heads", 2)
    return EquivariantTransformer(irreps_in, HIDDEN, irreps_out, 1.6, **kwargs).double()


def random_clusters(num_graphs=3, num_nodes=6, seed=1):
    """Points in boxes of side 1.6 (dense enough that every point has neighbours), graphs interleaved."""
    gen = torch.Generator().manual_seed(seed)
    n = num_graphs * num_nodes
    pos = 1.6 * torch.rand(n, 3, generator=gen, dtype=torch.float64)
    batch = torch.arange(n) % num_graphs
    return pos, batch


def one_hot(n, num_species=3, seed=2):
    gen = torch.Generator().manual_seed(seed)
    species = torch.randint(num_species, (n,), generator=gen)
    return torch.nn.functional.one_hot(species, num_species).double()


# ---------------------------------------------------------------- layer norm and gate


def layer_norm_loops(x, irreps, weight, bias, eps):
    """EquivariantLayerNorm written with plain loops over nodes and channels."""
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        even, other = [], []  # (column slice, channel, l)
        col = channel = 0
        for mul, ir in irreps:
            for _ in range(mul):
                (even if (ir.l, ir.p) == (0, 1) else other).append((slice(col, col + ir.dim), channel, ir.l))
                col += ir.dim
                channel += 1
        values = [float(x[n, s]) for s, _, _ in even]
        mean = sum(values) / len(values)
        var = sum((v - mean) ** 2 for v in values) / len(values)
        for k, (s, c, _) in enumerate(even):
            out[n, s] = weight[c] * (x[n, s] - mean) / math.sqrt(var + eps) + bias[k]
        rho2 = sum(float(x[n, s].pow(2).sum()) / (2 * l + 1) for s, _, l in other) / len(other)
        for s, c, _ in other:
            out[n, s] = weight[c] * x[n, s] / math.sqrt(rho2 + eps)
    return out


def test_layer_norm_equals_loops():
    irreps = o3.Irreps("3x0e + 2x1o + 1x0o + 2x0e + 1x2e")
    torch.manual_seed(0)
    norm = EquivariantLayerNorm(irreps, eps=1e-3).double()
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    x = torch.randn(4, irreps.dim, dtype=torch.float64)
    expected = layer_norm_loops(x, irreps, norm.weight.detach(), norm.bias.detach(), 1e-3)
    torch.testing.assert_close(norm(x), expected, atol=1e-12, rtol=0)


def layer_norm_per_channel(x, irreps, weight, bias, eps):
    """EquivariantLayerNorm channel by channel in differentiable operations (a reference for its derivatives)."""
    even, other = [], []  # (columns, channel, l)
    col = 0
    for mul, ir in irreps:
        for _ in range(mul):
            (even if (ir.l, ir.p) == (0, 1) else other).append((x[:, col:col + ir.dim], len(even) + len(other), ir.l))
            col += ir.dim
    out = [None] * (len(even) + len(other))
    if even:
        values = torch.cat([v for v, _, _ in even], dim=1)
        centred = values - values.mean(dim=1, keepdim=True)
        scale = (centred.pow(2).mean(dim=1, keepdim=True) + eps).rsqrt()
        for k, (_, c, _) in enumerate(even):
            out[c] = (weight[c] if weight is not None else 1) * centred[:, k:k + 1] * scale \
                + (bias[k] if bias is not None else 0)
    if other:
        rho2 = sum(v.pow(2).sum(dim=1) / (2 * l + 1) for v, _, l in other) / len(other)
        for v, c, _ in other:
            out[c] = (weight[c] if weight is not None else 1) * v * (rho2 + eps).rsqrt()[:, None]
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("irreps", ["3x0e + 2x1o + 1x0o + 2x0e + 1x2e", "4x0e", "2x1o + 1x0o", "1x0e + 1x1o"])
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_first_and_second_derivatives_equal_a_per_channel_reference(irreps, affine):
    irreps = o3.Irreps(irreps)
    torch.manual_seed(1)
    norm = EquivariantLayerNorm(irreps, eps=1e-2, affine=affine).double()
    params = list(norm.parameters())
    with torch.no_grad():
        for p in params:
            p.normal_()
    x = torch.randn(5, irreps.dim, dtype=torch.float64, requires_grad=True)
    g = torch.randn(5, irreps.dim, dtype=torch.float64)

    def derivatives(fn):
        out = fn(x)
        first = torch.autograd.grad((out * g).sum(), [x] + params, create_graph=True, materialize_grads=True)
        # a force-training-like second derivative: of |d<out, g>/dx|^2 in x and the parameters
        second = torch.autograd.grad(first[0].pow(2).sum(), [x] + params, materialize_grads=True)
        return [out] + list(first) + list(second)

    weight, bias = (norm.weight, norm.bias) if affine else (None, None)
    for ours, ref in zip(derivatives(norm), derivatives(lambda t: layer_norm_per_channel(t, irreps, weight, bias, 1e-2))):
        torch.testing.assert_close(ours, ref, atol=1e-11, rtol=1e-11)


def test_layer_norm_equivariant_and_keeps_symmetry_zeros_small():
    irreps = o3.Irreps("4x0e + 2x0o + 3x1o + 2x1e + 2x2o")
    norm = EquivariantLayerNorm(irreps).double()
    x = irreps.randn(6, -1, dtype=torch.float64)
    assert_equivariant(norm, [x], [irreps], [irreps])
    # an irrep that is only rounding noise stays noise: scaled like the others, not to unit size
    x[:, 4:6] = 1e-12
    assert norm(x)[:, 4:6].abs().max() < 1e-11


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_layer_norm_in_half_precision_has_finite_gradients_at_zero_vectors(dtype):
    """Features whose non-scalar channels are all zero (an atom without neighbours, the vectors of a first block
    fed scalars): in half precision the derivative of the root mean square at zero, eps^(-3/2), overflowed and
    the gradients were NaN. Now as float64's, to the dtype's precision."""
    torch.manual_seed(0)
    norm = EquivariantLayerNorm("4x0e + 2x1o")
    x = torch.cat([torch.randn(3, 4), torch.zeros(3, 6)], dim=1)
    grads = []
    for d in (dtype, torch.float64):
        xd = x.to(d).requires_grad_(True)
        out = norm.to(d)(xd)
        assert out.dtype == d
        grad, = torch.autograd.grad((out[:, :4] ** 2).sum() + out[:, 4:].sum(), xd)
        grads.append(grad.double())
    assert bool(torch.isfinite(grads[0]).all())
    torch.testing.assert_close(grads[0], grads[1], atol=20 * torch.finfo(dtype).eps * grads[1].abs().max(), rtol=0)


def test_layer_norm_rejects_bad_input():
    with pytest.raises(ValueError, match="eps"):
        EquivariantLayerNorm("2x0e", eps=0.0)
    with pytest.raises(ValueError, match=r"x must have shape \[N, 5\]"):
        EquivariantLayerNorm("2x0e + 1x1o")(torch.zeros(3, 4))


@pytest.mark.parametrize(
    "name, fn",
    [("silu", lambda z: z / (1 + math.exp(-z))), ("tanh", math.tanh), ("sigmoid", lambda z: 1 / (1 + math.exp(-z)))],
)
def test_second_moment_constant_equals_quadrature(name, fn):
    integrate = pytest.importorskip("scipy.integrate")
    moment, _ = integrate.quad(lambda z: fn(z) ** 2 * math.exp(-z * z / 2) / math.sqrt(2 * math.pi), -40, 40)
    assert abs(second_moment_constant(name) - 1 / math.sqrt(moment)) < 1e-10


def test_gate_equals_loops_and_is_equivariant():
    irreps = o3.Irreps("3x0e + 2x1o + 2x0o + 1x2e")
    gate = Gate(irreps)
    assert gate.irreps_out == irreps and gate.irreps_in == irreps + o3.Irreps("3x0e")
    x = gate.irreps_in.randn(4, -1, dtype=torch.float64)
    c = {name: second_moment_constant(name) for name in ("silu", "tanh", "sigmoid")}
    expected = torch.zeros(4, irreps.dim, dtype=torch.float64)
    for n in range(4):
        col, g = 0, irreps.dim  # the gates follow the features
        for mul, ir in irreps:
            for _ in range(mul):
                block = x[n, col : col + ir.dim]
                if ir.l == 0:
                    expected[n, col] = c["silu"] * torch.nn.functional.silu(block[0]) if ir.p == 1 else c["tanh"] * torch.tanh(block[0])
                else:
                    expected[n, col : col + ir.dim] = c["sigmoid"] * torch.sigmoid(x[n, g]) * block
                    g += 1
                col += ir.dim
    torch.testing.assert_close(gate(x), expected, atol=1e-14, rtol=0)
    assert_equivariant(gate, [x], [gate.irreps_in], [gate.irreps_out])
    split_heads(Gate("8x0e + 4x0o + 4x1o + 4x2e").irreps_in, 4)  # raises if a multiplicity is not divisible
    assert Gate("4x0e + 2x0o").irreps_in == o3.Irreps("4x0e + 2x0o")  # no gates when nothing is gated


# ---------------------------------------------------------------- symmetries


@pytest.mark.parametrize("seed", [0, 1])
def test_node_outputs_o3_equivariant(seed):
    model = make_model(seed=seed, irreps_in="1x0e + 1x1o", irreps_node_attr="3x0e")
    pos, batch = random_clusters(seed=seed)
    x = model.irreps_in.randn(pos.shape[0], -1, dtype=torch.float64)
    attr = one_hot(pos.shape[0])
    out = model(pos, x, batch, node_attr=attr)
    assert out.abs().max() > 0.1
    assert out[:, 1].abs().max() > 1e-3  # the odd scalar is reached, the test is not trivially 0 == 0
    err = assert_equivariant(
        lambda pos, x: model(pos, x, batch, node_attr=attr),
        [pos, x], ["cartesian_points", model.irreps_in], [model.irreps_out], ntrials=2,
    )
    assert err <= 1e-10


@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_pooled_scalars_invariant(reduce):
    model = make_model("2x0e", reduce=reduce)
    pos, batch = random_clusters()
    assert model(pos, batch=batch).shape == (3, 2)
    assert_equivariant(lambda pos: model(pos, batch=batch), [pos], ["cartesian_points"], ["2x0e"], ntrials=3)


def test_odd_outputs_flip_sign_under_parity():
    model = make_model("2x0e + 2x0o", reduce="sum", num_layers=3)  # 0o needs 3 layers from 0e inputs
    pos, batch = random_clusters()
    out = model(pos, batch=batch)
    mirror = torch.diag(torch.tensor([1.0, 1.0, -1.0], dtype=torch.float64))  # a reflection: parity times a rotation
    for transformed in (-pos, pos @ mirror):
        flipped = model(transformed, batch=batch)
        torch.testing.assert_close(flipped[:, :2], out[:, :2], atol=1e-10, rtol=0)
        torch.testing.assert_close(flipped[:, 2:], -out[:, 2:], atol=1e-10, rtol=0)
    assert out[:, 2:].abs().min() > 1e-4  # random clusters are chiral: the odd scalars are not zero


def test_permutation_equivariant():
    model = make_model(irreps_node_attr="3x0e")
    pos, batch = random_clusters()
    attr = one_hot(pos.shape[0])
    assert_permutation_equivariant(lambda pos, attr, batch: model(pos, batch=batch, node_attr=attr), [pos, attr, batch])
    pooled = make_model("1x0e + 1x0o", reduce="sum", irreps_node_attr="3x0e")
    assert_permutation_equivariant(
        lambda pos, attr, batch: pooled(pos, batch=batch, node_attr=attr), [pos, attr, batch], node_outputs=[False]
    )


@pytest.mark.parametrize("reduce", [None, "sum", "mean"])
def test_batch_equals_one_by_one(reduce):
    model = make_model(reduce=reduce)
    pos, batch = random_clusters(num_graphs=3, num_nodes=5)
    together = model(pos, batch=batch)
    for g in range(3):
        alone = model(pos[batch == g])
        expected = together[batch == g] if reduce is None else together[g : g + 1]
        torch.testing.assert_close(alone, expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize(
    "options",
    [{}, dict(density_channels=4), dict(layer_norm="pre"), dict(layer_norm="none"),
     dict(density_channels=3, layer_norm="pre", basis="bessel")],
)
def test_neighbour_fades_out_smoothly_at_the_cutoff(options):
    # a dimer: as the distance reaches max_radius the energy flattens onto that of two lone atoms
    model = make_model("1x0e", reduce="sum", **options)
    r = model.max_radius
    direction = torch.tensor([0.48, -0.36, 0.8], dtype=torch.float64)

    def dimer(d):
        return energy_and_forces(model, torch.stack([torch.zeros(3, dtype=torch.float64), d * direction]))

    alone, _ = dimer(3 * r)
    inside, _ = dimer(r - 0.1)
    assert abs(inside.item() - alone.item()) > 1e-3
    # the smooth_finite basis vanishes with every derivative, the bessel basis (polynomial envelope) as (1 - r/r_max)^4
    near = 1e-3 if options.get("basis", "smooth_finite") == "smooth_finite" else 1e-5
    for d in (r - near, r - 1e-6, r + 1e-6):
        energy, forces = dimer(d)
        assert abs(energy.item() - alone.item()) < 1e-10 and forces.abs().max() < 1e-10


# ---------------------------------------------------------------- energies and forces


def minus_gradient(energy, pos, h=1e-5):
    """-dE/dpos by the 5-point central difference (error O(h^4)), one coordinate at a time."""
    forces = torch.zeros_like(pos)
    for i, k in itertools.product(range(pos.shape[0]), range(3)):
        values = []
        for step in (-2, -1, 1, 2):
            moved = pos.clone()
            moved[i, k] += step * h
            values.append(energy(moved).item())
        forces[i, k] = -(values[0] - 8 * values[1] + 8 * values[2] - values[3]) / (12 * h)
    return forces


def energy_model(**kwargs):
    return make_model("1x0e", reduce="sum", **kwargs)


def test_forces_equal_finite_differences():
    model = energy_model(num_layers=1)
    pos, _ = random_clusters(num_graphs=1, num_nodes=4)
    energy, forces = energy_and_forces(model, pos)
    assert energy.shape == (1,) and forces.shape == pos.shape
    expected = minus_gradient(lambda p: model(p).sum(), pos)
    torch.testing.assert_close(forces, expected, atol=1e-8, rtol=0)
    assert forces.abs().max() > 0.1


def test_forces_rotation_equivariant():
    model = energy_model()
    pos, batch = random_clusters()

    def energy_and_forces_of(pos):
        energy, forces = energy_and_forces(model, pos, batch=batch)
        return energy[:, None], forces

    assert_equivariant(energy_and_forces_of, [pos], ["cartesian_points"], ["0e", "1o"], ntrials=2)


def test_forces_train_through_create_graph():
    model = energy_model()
    pos, batch = random_clusters()
    _, forces = energy_and_forces(model, pos, batch=batch)  # training mode: create_graph=True
    assert forces.requires_grad
    forces.pow(2).sum().backward()
    radial = model.layers[0].attention.radial.weight1
    assert radial.grad is not None and radial.grad.abs().max() > 0
    model.eval()
    with torch.no_grad():
        energy, forces = energy_and_forces(model, pos, batch=batch)
    assert not forces.requires_grad and torch.isfinite(forces).all()


def test_energy_helper_rejects_non_scalar_models():
    pos, _ = random_clusters(num_graphs=1)
    with pytest.raises(ValueError, match="one scalar per graph"):
        energy_and_forces(make_model("1x0e"), pos)  # per-node outputs
    with pytest.raises(ValueError, match="shifts were given without edge_index"):
        energy_and_forces(energy_model(), pos, shifts=torch.zeros(1, 3, dtype=torch.float64), cell=torch.eye(3))


# ---------------------------------------------------------------- periodic systems

CELL = torch.tensor([[2.0, 0.0, 0.0], [0.3, 1.8, 0.0], [0.2, -0.1, 1.9]], dtype=torch.float64)  # < 2 * r_max
FRAC = torch.tensor([[0.1, 0.2, 0.3], [0.6, 0.5, 0.4], [0.3, 0.8, 0.9]], dtype=torch.float64)


def brute_force_pbc(pos, cell, r_max, reach=2):
    """All (src, dst, shift) with |pos[src] - pos[dst] + shift @ cell| < r_max, by loops over images."""
    edges, vecs = [], []
    for src, dst in itertools.product(range(pos.shape[0]), repeat=2):
        for shift in itertools.product(range(-reach, reach + 1), repeat=3):
            if src == dst and shift == (0, 0, 0):
                continue
            vec = pos[src] - pos[dst] + torch.tensor(shift, dtype=pos.dtype) @ cell
            if float(vec.norm()) < r_max:
                edges.append((src, dst))
                vecs.append(vec)
    return torch.tensor(edges).T, torch.stack(vecs)


def crystal_energy(model, pos, cell):
    edge_index, shifts = radius_graph_pbc(pos, cell, [True, True, True], model.max_radius)
    energy, forces = energy_and_forces(model, pos, edge_index=edge_index, shifts=shifts, cell=cell)
    return energy, forces


def test_crystal_energy_equals_brute_force_images():
    model = energy_model()
    pos = FRAC @ CELL
    energy, _ = crystal_energy(model, pos, CELL)
    edge_index, edge_vec = brute_force_pbc(pos, CELL, model.max_radius)
    assert edge_index.shape[1] > 3 * pos.shape[0]  # several images of the same pairs
    torch.testing.assert_close(energy, model(pos, edge_index=edge_index, edge_vec=edge_vec)[:, 0], atol=1e-10, rtol=0)


def test_crystal_energy_extensive_and_forces_periodic():
    model = energy_model()
    pos = FRAC @ CELL
    energy, forces = crystal_energy(model, pos, CELL)
    supercell = torch.stack([2 * CELL[0], CELL[1], CELL[2]])
    super_pos = torch.cat([pos, pos + CELL[0]])
    super_energy, super_forces = crystal_energy(model, super_pos, supercell)
    torch.testing.assert_close(super_energy, 2 * energy, atol=1e-10, rtol=0)
    torch.testing.assert_close(super_forces, torch.cat([forces, forces]), atol=1e-10, rtol=0)


def test_crystal_invariances():
    model = energy_model()
    pos = FRAC @ CELL
    energy, forces = crystal_energy(model, pos, CELL)
    rot = o3.rand_matrix(dtype=torch.float64)
    for new_pos, new_cell, new_forces in [
        (pos @ rot.T, CELL @ rot.T, forces @ rot.T),  # rotate positions and cell together
        (-pos @ rot.T, -CELL @ rot.T, -forces @ rot.T),  # with parity
        (pos + torch.tensor([0.7, -3.1, 0.4], dtype=torch.float64), CELL, forces),  # translate
        (pos + torch.stack([CELL[1], torch.zeros(3), -CELL[0] + 2 * CELL[2]]), CELL, forces),  # wrap to images
    ]:
        e, f = crystal_energy(model, new_pos, new_cell)
        torch.testing.assert_close(e, energy, atol=1e-10, rtol=0)
        torch.testing.assert_close(f, new_forces, atol=1e-10, rtol=0)


def test_crystal_forces_equal_finite_differences():
    model = energy_model(num_layers=1)
    pos = FRAC @ CELL
    _, forces = crystal_energy(model, pos, CELL)
    expected = minus_gradient(lambda p: crystal_energy(model, p, CELL)[0], pos)
    torch.testing.assert_close(forces, expected, atol=1e-8, rtol=0)


def crystal_stress(model, pos, cell, batch=None):
    """Energy, forces and stress of crystals ``[B, 3, 3]`` (or one ``[3, 3]``) on their periodic graph."""
    edge_index, shifts = radius_graph_pbc(pos, cell, True, model.max_radius, batch)
    return energy_forces_stress(model, pos, batch=batch, cell=cell, edge_index=edge_index, shifts=shifts)


def test_crystal_stress_equals_finite_strain_derivative_in_a_batch():
    model = energy_model(num_layers=1)
    cells = torch.stack([CELL, torch.tensor([[2.2, 0.1, 0.0], [0.0, 2.1, 0.2], [-0.3, 0.0, 2.4]], dtype=torch.float64)])
    pos = torch.cat([FRAC @ cells[0], FRAC.flip(0) @ cells[1]])
    batch = torch.tensor([0, 0, 0, 1, 1, 1])
    energy, forces, stress = crystal_stress(model, pos, cells, batch)
    assert stress.shape == (2, 3, 3) and stress.abs().max() > 1e-2
    torch.testing.assert_close(stress, stress.transpose(1, 2), atol=1e-14, rtol=0)
    torch.testing.assert_close((energy, forces), crystal_energy_batched(model, pos, cells, batch), atol=1e-12, rtol=0)
    for b in range(2):
        pos_b, cell_b = pos[batch == b], cells[b]
        single = crystal_stress(model, pos_b, cell_b)
        torch.testing.assert_close(single[2][0], stress[b], atol=1e-12, rtol=0)
        for i, j in [(0, 0), (1, 1), (2, 2), (1, 2), (0, 2), (0, 1)]:
            unit = torch.zeros(3, 3, dtype=torch.float64)
            unit[i, j] = unit[j, i] = 1.0 if i == j else 0.5
            h = 1e-6
            plus = torch.eye(3, dtype=torch.float64) + h * unit
            minus = torch.eye(3, dtype=torch.float64) - h * unit
            derivative = (crystal_stress(model, pos_b @ plus, cell_b @ plus)[0]
                          - crystal_stress(model, pos_b @ minus, cell_b @ minus)[0]) / (2 * h)
            expected = derivative / torch.linalg.det(cell_b).abs()
            torch.testing.assert_close(stress[b, i, j], expected[0], atol=1e-8, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_crystal_stress_in_half_precision(dtype):
    """The half-precision model gives float64's energy, forces and stress to its precision (the volume is computed
    in float32: torch.linalg.det has no half-precision kernel), in the model's dtype."""
    model = energy_model(num_layers=1)
    pos, cell = (FRAC @ CELL).to(dtype), CELL.to(dtype)
    half = crystal_stress(model.to(dtype), pos, cell)
    exact = crystal_stress(model.double(), pos.double(), cell.double())
    for got, want in zip(half, exact):
        assert got.dtype == dtype and bool(torch.isfinite(got).all())
        scale = want.abs().max().item()
        error = (got.double() - want).abs().max().item()
        assert scale > 1e-2 and error < 25 * torch.finfo(dtype).eps * scale  # measured: up to 17 (6 in bfloat16)


def crystal_energy_batched(model, pos, cells, batch):
    edge_index, shifts = radius_graph_pbc(pos, cells, True, model.max_radius, batch)
    return energy_and_forces(model, pos, batch=batch, edge_index=edge_index, shifts=shifts, cell=cells)


def test_stress_under_inference_mode_equals_stress_with_autograd():
    model = energy_model(num_layers=1).eval()
    pos = FRAC @ CELL
    expected = crystal_stress(model, pos, CELL)
    with torch.inference_mode():
        result = crystal_stress(model, pos.clone(), CELL.clone())  # inference tensors in, ordinary tensors out
    for r, e in zip(result, expected):
        assert not r.is_inference()
        torch.testing.assert_close(r, e, atol=0, rtol=0)


def test_stress_needs_a_volume():
    model = energy_model()
    pos = FRAC @ CELL
    flat = CELL.clone()
    flat[2] = 0.0
    with pytest.raises(ValueError, match="linearly independent"):
        energy_forces_stress(model, pos, cell=flat)
    with pytest.raises(ValueError, match=r"shape \[3, 3\] or \[B, 3, 3\]"):
        energy_forces_stress(model, pos, cell=None)
    energy, forces, stress = energy_forces_stress(model, pos[:0], cell=CELL)  # no atoms, no graphs
    assert energy.shape == (0,) and forces.shape == (0, 3) and stress.shape == (0, 3, 3)


def test_edge_vectors_per_graph_cells():
    pos = torch.tensor([[0.0, 0.0, 0.0], [0.5, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    cells = torch.stack([torch.eye(3, dtype=torch.float64), 2 * torch.eye(3, dtype=torch.float64)])
    batch = torch.tensor([0, 0, 1])
    edge_index = torch.tensor([[1, 2], [0, 2]])
    shifts = torch.tensor([[-1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], dtype=torch.float64)
    expected = torch.tensor([[0.5 - 1.0, 0.0, 0.0], [0.0, 2.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(edge_vectors(pos, edge_index, shifts, cells, batch), expected)
    with pytest.raises(ValueError, match="batch is required"):
        edge_vectors(pos, edge_index, shifts, cells)
    with pytest.raises(ValueError, match="shifts must be a tensor of shape"):
        edge_vectors(pos, edge_index, shifts[:1], cells, batch)


# ---------------------------------------------------------------- training, checkpoints, inputs


def test_a_few_training_steps_lower_the_loss():
    torch.manual_seed(0)
    model = EquivariantTransformer("1x0e", "8x0e + 2x1o", "1x0e", 1.6, num_layers=2, reduce="mean")
    gen = torch.Generator().manual_seed(3)
    pos = 1.6 * torch.rand(8 * 5, 3, generator=gen)
    batch = torch.arange(40) // 5
    # target: the mean squared distance of each cluster from its centroid, an invariant of the shape
    centred = pos - torch.stack([pos[batch == b].mean(0) for b in range(8)])[batch]
    target = torch.stack([centred[batch == b].pow(2).sum(1).mean() for b in range(8)])[:, None]
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        loss = (model(pos, batch=batch) - target).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.2 * losses[0]


def test_checkpoint_round_trip(tmp_path):
    model = make_model("1x0e + 1x1o", reduce="sum", irreps_node_attr="3x0e")
    pos, batch = random_clusters()
    attr = one_hot(pos.shape[0])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))  # not the initial values
    save_checkpoint(model, tmp_path / "model.pt", scale=torch.tensor(0.5), species=["Cu", "Au"])
    loaded, extra = load_checkpoint(tmp_path / "model.pt")
    assert isinstance(loaded, EquivariantTransformer) and not loaded.training
    assert loaded.config == model.config and next(loaded.parameters()).dtype == torch.float64
    assert extra["species"] == ["Cu", "Au"] and extra["scale"].item() == 0.5
    assert torch.equal(loaded(pos, batch=batch, node_attr=attr), model(pos, batch=batch, node_attr=attr))


def test_load_rejects_other_files(tmp_path):
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not a checkpoint"):
        load_checkpoint(tmp_path / "other.pt")
    with pytest.raises(ValueError, match="model must be one of"):
        save_checkpoint(torch.nn.Linear(2, 2), tmp_path / "linear.pt")


class StandIn:
    """A stand-in for a torch_geometric Batch: attributes, some missing."""

    def __init__(self, pos, batch, node_attr):
        self.pos, self.batch, self.node_attr = pos, batch, node_attr


def test_accepts_mappings_and_data_objects():
    model = make_model(reduce="sum", irreps_node_attr="3x0e")
    pos, batch = random_clusters()
    attr = one_hot(pos.shape[0])
    expected = model(pos, batch=batch, node_attr=attr)
    assert torch.equal(model({"pos": pos, "batch": batch, "node_attr": attr}), expected)
    assert torch.equal(model(StandIn(pos, batch, attr)), expected)
    with pytest.raises(ValueError, match="not both"):
        model({"pos": pos}, batch=batch)
    with pytest.raises(ValueError, match="a mapping with a 'pos' key"):
        model(object())


def test_given_graph_equals_built_graph():
    model = make_model()
    pos, batch = random_clusters()
    edge_index = torch.tensor(
        [(s, d) for d in range(len(pos)) for s in range(len(pos))
         if s != d and batch[s] == batch[d] and (pos[s] - pos[d]).norm() < model.max_radius]
    ).T
    torch.testing.assert_close(model(pos, batch=batch, edge_index=edge_index), model(pos, batch=batch), atol=1e-12, rtol=0)


# ---------------------------------------------------------------- edge cases and errors


def test_empty_single_and_duplicate_points():
    node, pooled = make_model(), energy_model()
    empty = torch.zeros(0, 3, dtype=torch.float64)
    assert node(empty).shape == (0, node.irreps_out.dim)
    assert pooled(empty).shape == (0, 1)
    single = torch.tensor([[0.3, -0.2, 0.1]], dtype=torch.float64)
    energy, forces = energy_and_forces(pooled, single)
    assert energy.shape == (1,) and torch.equal(forces, torch.zeros(1, 3, dtype=torch.float64))
    torch.testing.assert_close(pooled(single), pooled(single + 5.0), atol=0, rtol=0)  # no neighbours: a constant
    duplicate = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.9, 0.3, 0.0]], dtype=torch.float64)
    energy, forces = energy_and_forces(pooled, duplicate)
    assert torch.isfinite(energy).all() and torch.isfinite(forces).all()
    out = node(duplicate)
    torch.testing.assert_close(out[0], out[1], atol=1e-12, rtol=0)  # coincident points are indistinguishable


def test_empty_graph_index_pools_to_zero():
    model = make_model("1x0e", reduce="mean")
    pos, _ = random_clusters(num_graphs=1, num_nodes=4)
    out = model(pos, batch=torch.tensor([0, 0, 2, 2]))
    assert out.shape == (3, 1) and out[1].item() == 0.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_heads=3), "irreps_hidden .* cannot be split into 3 heads"),
        (dict(num_heads=2, irreps_key="3x0e"), "irreps_key .* cannot be split into 2 heads"),
        (dict(num_layers=0), "num_layers must be a positive int"),
        (dict(reduce="max"), "reduce must be one of"),
        (dict(irreps_node_attr="nonsense"), "irreps_node_attr must be e3nn irreps"),
    ],
)
def test_rejects_bad_configuration(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EquivariantTransformer("1x0e", HIDDEN, "1x0e", 1.6, **kwargs)


def test_rejects_bad_inputs():
    model = make_model(irreps_in="1x0e + 1x1o", irreps_node_attr="3x0e")
    pos, _ = random_clusters(num_graphs=1)
    attr = one_hot(pos.shape[0])
    with pytest.raises(ValueError, match="x is required"):
        model(pos, node_attr=attr)
    x = model.irreps_in.randn(pos.shape[0], -1, dtype=torch.float64)
    with pytest.raises(ValueError, match="node_attr is required"):
        model(pos, x)
    with pytest.raises(ValueError, match=r"x must have shape \[N, 4\]"):
        model(pos, x[:, :3], node_attr=attr)
    with pytest.raises(ValueError, match="edge_vec was given without edge_index"):
        model(pos, x, node_attr=attr, edge_vec=torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="edge_index has entries"):
        model(pos, x, node_attr=attr, edge_index=torch.tensor([[0], [99]]))
    with pytest.raises(ValueError, match="node_attr was given but the model has no irreps_node_attr"):
        make_model()(pos, node_attr=attr)


def test_layer_norm_under_autocast_and_with_empty_irreps():
    """Its statistics are sums (matrix products): never in autocast's bfloat16, and the output keeps the
    dtype of the elementwise formula (float32 weights promote a bfloat16 input); empty irreps pass x through."""
    irreps = o3.Irreps("8x0e + 4x1o + 2x2e")
    torch.manual_seed(2)
    norm = EquivariantLayerNorm(irreps)
    x = torch.randn(6, irreps.dim) + 30 * (torch.arange(irreps.dim) < 8)  # an offset on the even scalars
    reference = EquivariantLayerNorm(irreps).double()(x.double())
    for inputs in (x, x.bfloat16()):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = norm(inputs)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out.double(), layer_norm_loops(inputs.double(), irreps, norm.weight.detach().double(),
                                                                  norm.bias.detach().double(), 1e-5), atol=1e-5, rtol=0)
    torch.testing.assert_close(norm(x).double(), reference, atol=1e-5, rtol=0)
    for empty in ("", "0x0e"):
        assert EquivariantLayerNorm(empty)(torch.zeros(3, 0)).shape == (3, 0)

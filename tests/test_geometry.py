"""The edges' geometry on the kernels (e3attn.kernels.geometry_ops): harmonics, radial first layer and lengths
against the plain formulation and e3nn (values, first and second derivatives, float64 and float32), at the special
lengths (0, below the normalisation's floor, the cutoff exactly, beyond it), over tile and group boundaries,
repeatable, and where the layer uses it."""
import pytest
import torch
from e3nn import o3

from e3attn import EquivariantAttention, kernels
from e3attn.radial import RadialEmbedding
from kernel_switch import plain

pytest.importorskip("numba")
from e3attn.kernels import geometry_ops  # noqa: E402

RMAX = 1.3


def _layer(basis="smooth_finite", lmax=3, dtype=torch.float64, number_of_basis=7):
    torch.manual_seed(0)
    layer = EquivariantAttention("4x0e + 2x1o", "3x0e + 1x1o", "3x0e + 1x1o", "2x0e + 2x1o", max_radius=RMAX,
                                 lmax=lmax, basis=basis, number_of_basis=number_of_basis, radial_neurons=5)
    return layer.to(dtype)


def _vectors(num=300, dtype=torch.float64, seed=1):
    """Random edge vectors (300: two full tiles and a partial one) with the special lengths first."""
    v = torch.randn(num, 3, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 0.8
    special = [[0.0, 0.0, 0.0], [1e-13, 0.0, 0.0], [0.0, 0.0, -5e-13], [RMAX, 0.0, 0.0], [0.0, -RMAX, 0.0],
               [2.0, 1.0, 0.0], [0.0, 0.0, RMAX * 0.999999], [1e-12, 0.0, 0.0]]  # the last: the floor exactly
    v[: len(special)] = torch.tensor(special, dtype=torch.float64)
    return v.to(dtype).requires_grad_()


def _fused(layer, v, first):
    return geometry_ops.edge_geometry(v, first, layer.sh, layer.embedding, layer._plain_geometry)


def _first(layer):
    return layer.radial.input_layer().detach().requires_grad_()


def _compare(a, b, atol, rtol=0.0):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=atol, rtol=rtol)


def _cotangents(outputs, seed=2):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.dtype) for o in outputs]


def _grads(outputs, inputs, cotangents, **kwargs):
    used = [(o, c) for o, c in zip(outputs, cotangents) if o.requires_grad]
    return torch.autograd.grad([o for o, _ in used], inputs, [c for _, c in used], allow_unused=True, **kwargs)


@pytest.mark.parametrize("basis", RadialEmbedding.BASES)
@pytest.mark.parametrize("lmax", [0, 1, 3, 4])
def test_geometry_equals_the_plain_formulation(basis, lmax, float64_default):
    layer, v = _layer(basis, lmax), _vectors()
    first = _first(layer)
    fused, plain = _fused(layer, v, first), layer._plain_geometry(v, first)
    _compare(fused, plain, atol=1e-12, rtol=1e-13)
    assert fused[2][0] == 0 and fused[2][3] == RMAX and fused[2][4] == RMAX  # exactly: the cutoff is 0 there
    cot = _cotangents(plain)
    got, want = _grads(fused, (v, first), cot), _grads(plain, (v, first), cot)
    if basis == "bessel":  # at r <= 1e-12 PyTorch's sinc derivative is rounding noise (the kernels use its series)
        keep = v.detach().norm(dim=1) > 1e-11
        got, want = (got[0][keep], got[1]), (want[0][keep], want[1])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)  # 1e12-sized at the floor: relative there


def test_geometry_gradient_of_the_first_layer_alone(float64_default):
    """Fixed edge vectors (energy-only training): the kernels skip the vectors' gradient, the first layer's is
    unchanged."""
    layer, v = _layer(), _vectors().detach()
    first = _first(layer)
    fused, plain = _fused(layer, v, first), layer._plain_geometry(v, first)
    cot = _cotangents(plain)
    torch.testing.assert_close(_grads(fused, (first,), cot)[0], _grads(plain, (first,), cot)[0], atol=1e-12, rtol=0)


def test_geometry_matches_e3nn(float64_default):
    """The harmonics against e3nn's own, the first layer against e3nn's embedding (away from the special lengths)."""
    layer, v = _layer(), _vectors()[10:]
    first = _first(layer)
    sh, pre, r = _fused(layer, v, first)
    want = o3.spherical_harmonics(list(range(4)), v, normalize=True, normalization="component")
    torch.testing.assert_close(sh, want, atol=1e-12, rtol=0)
    torch.testing.assert_close(r, torch.linalg.vector_norm(v, dim=-1), atol=1e-15, rtol=0)
    from e3nn.math import soft_one_hot_linspace

    emb = soft_one_hot_linspace(r, 0.0, RMAX, 7, basis="smooth_finite", cutoff=True) * 7**0.5
    torch.testing.assert_close(pre, emb @ first, atol=1e-12, rtol=0)


@pytest.mark.parametrize("basis", RadialEmbedding.BASES)
def test_geometry_float32(basis, float32_default):
    layer32, v32 = _layer(basis, dtype=torch.float32), _vectors(dtype=torch.float32)[10:]
    first = _first(layer32)
    fused = _fused(layer32, v32, first)
    v64, first64 = v32.detach().double().requires_grad_(), first.detach().double().requires_grad_()
    plain = _layer(basis, dtype=torch.float64)._plain_geometry(v64, first64)
    _compare([t.double() for t in fused], plain, atol=2e-5, rtol=2e-5)
    cot = _cotangents(plain)
    want = _grads(plain, (v64, first64), cot)
    got = _grads(fused, (v32, first), [c.float() for c in cot])
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, atol=1e-4, rtol=1e-4)


def test_bessel_basis_on_either_side_of_its_series(float64_default):
    """The Bessel basis switches from its series (short edges) to sines by rotations at r = r_max / 100: both
    sides equal the plain formulation, values and gradients."""
    layer = _layer("bessel", lmax=1, number_of_basis=16)
    lengths = 1e-2 * RMAX * torch.tensor([1 - 1e-6, 1 + 1e-6, 0.5, 2.0, 30.0, 99.0])
    v = (lengths[:, None] * torch.nn.functional.normalize(torch.randn(6, 3, generator=torch.Generator().manual_seed(2)),
                                                          dim=1)).requires_grad_()
    first = _first(layer)
    fused, plain = _fused(layer, v, first), layer._plain_geometry(v, first)
    _compare(fused, plain, atol=1e-12, rtol=1e-12)
    cot = _cotangents(plain)
    for a, b in zip(_grads(fused, (v, first), cot), _grads(plain, (v, first), cot)):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_geometry_second_derivatives(float64_default):
    """gradcheck and gradgradcheck (the second derivatives are the plain formulation's), away from the kinks."""
    for lmax in (0, 2):  # lmax 0: constant harmonics
        layer = _layer(lmax=lmax, number_of_basis=4)
        v = _vectors(num=13)[8:].detach().requires_grad_()
        first = _first(layer)
        assert torch.autograd.gradcheck(lambda v, w: _fused(layer, v, w), (v, first))
        assert torch.autograd.gradgradcheck(lambda v, w: _fused(layer, v, w), (v, first))


def test_geometry_empty_and_repeatable(float64_default):
    layer = _layer()
    first = _first(layer)
    sh, pre, r = _fused(layer, torch.zeros(0, 3, requires_grad=True), first)
    assert sh.shape == (0, 16) and pre.shape == (0, first.shape[1]) and r.shape == (0,)
    (g,) = torch.autograd.grad(pre.sum() + sh.sum(), first)
    assert torch.equal(g, torch.zeros_like(first))
    v = _vectors(num=20000).detach()  # enough work for two threads (e3attn.kernels.threads.SERIAL_BELOW)
    results = []
    for threads in (1, 2, 1):
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            vv, w = v.clone().requires_grad_(), first.detach().clone().requires_grad_()
            out = _fused(layer, vv, w)
            results.append(torch.autograd.grad(out[0].sum() + out[1].pow(2).sum(), (vv, w)))
        finally:
            torch.set_num_threads(previous)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def test_geometry_checks_its_inputs(float64_default):
    layer = _layer()
    first = _first(layer)
    with pytest.raises(ValueError, match=r"vectors must be a float32 or float64 CPU tensor \[E, 3\]"):
        _fused(layer, torch.zeros(4, 2), first)
    with pytest.raises(ValueError, match="float32 or float64"):
        _fused(layer, torch.zeros(4, 3, dtype=torch.float16), first)
    with pytest.raises(ValueError, match="first_layer must be"):
        _fused(layer, torch.zeros(4, 3), first[:3])
    with pytest.raises(ValueError, match="first_layer must be"):
        _fused(layer, torch.zeros(4, 3), first.float())


def test_layer_uses_the_kernels_only_in_eager_mode(float64_default, monkeypatch):
    """The layer's geometry runs on the kernels in eager mode on the CPU with its weights frozen, and on the plain
    formulation while they are trained, with the kernels switched off, under a dispatch mode and for tensor
    subclasses (and under torch.compile, where tests/test_compile.py runs the layer)."""
    layer, calls = _layer(), []
    original = geometry_ops.edge_geometry
    monkeypatch.setattr(geometry_ops, "edge_geometry", lambda *a, **k: calls.append(1) or original(*a, **k))
    pos = torch.randn(12, 3, dtype=torch.float64)
    f = layer.irreps_input.randn(12, -1, dtype=torch.float64)
    trained = layer(f, pos)
    assert calls == []
    layer.requires_grad_(False)
    out = layer(f, pos)
    assert calls == [1]
    torch.testing.assert_close(out, trained, atol=1e-12, rtol=0)
    torch.testing.assert_close(plain(lambda: layer(f, pos)), out, atol=1e-12, rtol=0)
    assert calls == [1]
    v = torch.randn(5, 3, dtype=torch.float64)
    assert kernels.eager_on_cpu(v, v) and not kernels.eager_on_cpu(v.half(), v)
    assert not kernels.eager_on_cpu(torch.nn.Parameter(v), v)  # a tensor subclass
    from torch.utils._python_dispatch import TorchDispatchMode

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Mode():
        assert not kernels.eager_on_cpu(v, v)


def test_edge_geometry_takes_the_kernels_for_frozen_first_layers_only(float64_default):
    """The dispatch of e3attn.edge_geometry: the kernels where the first layer is frozen or autograd is off (the
    calculator, evaluation); the plain formulation where it is trained (forces differentiated again)."""
    from e3attn.edge_geometry import edge_geometry

    layer = _layer()
    v, first = _vectors(num=50), _first(layer).detach()

    def grad_fn(w):
        return type(edge_geometry(v, w, layer.sh, layer.embedding, layer._plain_geometry)[1].grad_fn).__name__

    assert grad_fn(first) == "_GeometryBackward"
    assert grad_fn(first.requires_grad_()) != "_GeometryBackward"
    with torch.no_grad():
        assert edge_geometry(v, first, layer.sh, layer.embedding, layer._plain_geometry)[1].grad_fn is None

"""The angular moments of NeighbourDensity on their kernel (e3attn.kernels.moments_ops) against the plain
formulation, to every order of derivative that force training takes."""
import pytest
import torch

import e3attn.kernels
from e3attn.graph import radius_graph
from e3attn.kernels import moments_ops
from e3attn.models import NeighbourDensity

LMAX = 3
DEGREE = torch.tensor([l for l in range(1, LMAX + 1) for _ in range(2 * l + 1)]) - 1


def plain_moments(a, y, dst, num_nodes):
    """The moments by a gather, a broadcast product and a scatter (no kernel)."""
    terms = a.index_select(1, DEGREE) * y[:, :, None]
    return torch.zeros(num_nodes, *terms.shape[1:], dtype=a.dtype).index_add(0, dst, terms)


def csr_inputs(num_edges=23, num_nodes=6, channels=4, seed=0):
    """Edges sorted by destination, the first and the last node without any."""
    gen = torch.Generator().manual_seed(seed)
    dst = torch.sort(torch.randint(1, num_nodes - 1, (num_edges,), generator=gen))[0]
    rowptr = torch.searchsorted(dst, torch.arange(num_nodes + 1))
    a = torch.randn(num_edges, LMAX, channels, generator=gen, dtype=torch.float64, requires_grad=True)
    y = torch.randn(num_edges, DEGREE.shape[0], generator=gen, dtype=torch.float64, requires_grad=True)
    return a, y, dst, rowptr


def test_moments_equal_the_plain_formulation():
    a, y, dst, rowptr = csr_inputs()
    expected = plain_moments(a, y, dst, 6)
    assert expected[0].abs().max() == 0 and expected[1:5].abs().min() > 0
    torch.testing.assert_close(moments_ops.angular_moments_csr(a, y, rowptr, DEGREE), expected, atol=1e-13, rtol=0)
    moments32 = moments_ops.angular_moments_csr(a.detach().float(), y.detach().float(), rowptr, DEGREE)
    assert moments32.dtype == torch.float32
    torch.testing.assert_close(moments32, expected.detach().float(), atol=1e-5, rtol=1e-5)


def test_moments_derivatives_to_third_order():
    a, y, dst, rowptr = csr_inputs(num_edges=9, num_nodes=4, channels=2)
    kernel = lambda a, y: moments_ops.angular_moments_csr(a, y, rowptr, DEGREE)  # noqa: E731
    assert torch.autograd.gradcheck(kernel, (a, y))
    assert torch.autograd.gradgradcheck(kernel, (a, y))
    weights = torch.randn(4, DEGREE.shape[0], 2, dtype=torch.float64)
    results = []
    for moments in (kernel, lambda a, y: plain_moments(a, y, dst, 4)):
        power = (moments(a, y).pow(2) * weights).sum()  # like the power spectrum: quadratic in the moments
        (gy,) = torch.autograd.grad(power, y, create_graph=True)  # like forces
        (ga,) = torch.autograd.grad(gy.pow(2).sum(), a, create_graph=True)  # like force training
        results.append(torch.autograd.grad(ga.sin().sum(), (a, y)))  # one order more
    for kernel_grad, plain_grad in zip(*results):
        scale = plain_grad.abs().max()
        assert scale > 1e-3
        torch.testing.assert_close(kernel_grad, plain_grad, atol=1e-12 * scale, rtol=1e-10)


def test_moments_the_same_on_two_threads(monkeypatch):
    from e3attn.kernels import threads as kernel_threads

    monkeypatch.setattr(kernel_threads, "SERIAL_BELOW", 1)  # small work, split all the same
    a, y, dst, rowptr = csr_inputs(num_edges=400, num_nodes=30, channels=16)
    g = torch.randn(30, DEGREE.shape[0], 16, dtype=torch.float64)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert kernel_threads.threads_for(400) == n
            outs.append(list(moments_ops._run(a, y, g, rowptr, DEGREE, ("g", "a", "y")).values()))
    finally:
        torch.set_num_threads(threads)
    for one, two in zip(*outs):
        assert torch.equal(one, two)


def test_batched_gradients_take_the_plain_contractions():
    """Gradients given as a batch (is_grads_batched, as torch.autograd.functional's vectorized Jacobians and
    Hessians take them) cannot enter the kernel; they are taken in PyTorch operations, to the second order."""
    a, y, dst, rowptr = csr_inputs(num_edges=9, num_nodes=4, channels=2)
    weights = torch.randn(4, DEGREE.shape[0], 2, dtype=torch.float64)
    batch = torch.randn(3, 4, DEGREE.shape[0], 2, dtype=torch.float64)
    batch_y = torch.randn(3, *y.shape, dtype=torch.float64)
    results = []
    for moments in (lambda a, y: moments_ops.angular_moments_csr(a, y, rowptr, DEGREE),
                    lambda a, y: plain_moments(a, y, dst, 4)):
        out = moments(a, y)
        first = torch.autograd.grad(out, (a, y), batch, is_grads_batched=True, create_graph=True)
        (gy,) = torch.autograd.grad((out.pow(2) * weights).sum(), y, create_graph=True)  # like forces
        second = torch.autograd.grad(gy, a, batch_y, is_grads_batched=True)
        results.append(first + second)
    for kernel_grad, plain_grad in zip(*results):
        assert kernel_grad.shape[0] == 3 and plain_grad.abs().max() > 1e-3
        torch.testing.assert_close(kernel_grad, plain_grad, atol=1e-12, rtol=1e-12)


def test_a_hessian_of_the_density_on_the_kernel():
    torch.manual_seed(0)
    density = NeighbourDensity("4x0e + 2x1o", 6, 1.6, lmax=2, angular_channels=3).double()
    pos = 1.6 * torch.rand(5, 3, dtype=torch.float64)
    f = torch.randn(5, 10, dtype=torch.float64)
    edge_index = radius_graph(pos, 1.6)
    energy = lambda p: density(f, edge_index, p[edge_index[0]] - p[edge_index[1]]).pow(2).sum()  # noqa: E731
    on = torch.autograd.functional.hessian(energy, pos, vectorize=True)
    previous = e3attn.kernels.set_fused_kernels(False)
    try:
        off = torch.autograd.functional.hessian(energy, pos, vectorize=True)
    finally:
        e3attn.kernels.set_fused_kernels(previous)
    assert off.abs().max() > 1e-3
    torch.testing.assert_close(on, off, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("change, match", [
    (dict(a=torch.zeros(5, 3)), "a must be a float32 or float64 CPU tensor"),
    (dict(y=torch.zeros(5, 8, dtype=torch.float64)), r"y must be a torch.float64 tensor \[5, 15\]"),
    (dict(degree=DEGREE.flip(0)), "degree must be a rising"),
    (dict(degree=DEGREE[:8]), "degree must be a rising"),
    (dict(rowptr=torch.tensor([0, 2, 1, 5])), "rowptr must rise"),
])
def test_moments_reject_bad_arguments(change, match):
    args = dict(a=torch.zeros(5, LMAX, 2, dtype=torch.float64), y=torch.zeros(5, 15, dtype=torch.float64),
                rowptr=torch.tensor([0, 2, 2, 5]), degree=DEGREE)
    args.update(change)
    with pytest.raises(ValueError, match=match):
        moments_ops.angular_moments_csr(**args)


@pytest.mark.parametrize("shuffle", [False, True])
def test_density_on_the_kernel_equals_the_plain_density(monkeypatch, shuffle):
    """The module's output and its force-training gradients, kernel (edges sorted by destination) against the
    plain formulation; edges in another order take the plain formulation."""
    torch.manual_seed(0)
    density = NeighbourDensity("4x0e + 2x1o", 6, 1.6, lmax=LMAX, angular_channels=4, avg_num_neighbors=3.0).double()
    pos = 1.6 * torch.rand(9, 3, dtype=torch.float64, requires_grad=True)
    f = torch.randn(9, 10, dtype=torch.float64)
    edge_index = radius_graph(pos.detach(), 1.6)
    if shuffle:
        edge_index = edge_index[:, torch.randperm(edge_index.shape[1])]
    calls = []
    original = moments_ops.angular_moments_csr
    monkeypatch.setattr(moments_ops, "angular_moments_csr", lambda *args: calls.append(1) or original(*args))

    def force_training():
        out = density(f, edge_index, pos[edge_index[0]] - pos[edge_index[1]])
        (forces,) = torch.autograd.grad((out * torch.arange(out.shape[1])).sum(), pos, create_graph=True)
        grads = torch.autograd.grad(forces.pow(2).sum(), list(density.parameters()))
        return [out, forces, *grads]

    on = force_training()
    assert len(calls) == (0 if shuffle else 1)
    previous = e3attn.kernels.set_fused_kernels(False)
    try:
        off = force_training()
    finally:
        e3attn.kernels.set_fused_kernels(previous)
    assert len(calls) == (0 if shuffle else 1)
    for x, y in zip(on, off):
        torch.testing.assert_close(x, y, atol=1e-12, rtol=1e-12)


def test_degree_checked_again_after_a_change_in_place():
    """The values of ``degree`` are checked once per tensor and version: a change in place is seen."""
    degree = DEGREE.clone()
    args = dict(a=torch.zeros(5, LMAX, 2, dtype=torch.float64), y=torch.zeros(5, 15, dtype=torch.float64),
                rowptr=torch.tensor([0, 2, 2, 5]))
    assert moments_ops.angular_moments_csr(degree=degree, **args).shape == (3, 15, 2)
    degree[-1] = LMAX  # a row that a does not have
    with pytest.raises(ValueError, match="degree must be a rising"):
        moments_ops.angular_moments_csr(degree=degree, **args)


def test_the_plain_contractions_name_their_slot():
    from e3attn.kernels.moments import contract

    with pytest.raises(ValueError, match="slot must be one of"):
        contract("b", None, None, torch.zeros(1, 15, 2), torch.zeros(1, dtype=torch.long), 1, DEGREE)

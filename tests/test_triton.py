"""The Triton backend of the node contraction (e3attn.kernels.segments_triton) where the layer runs it: on CUDA
after ``kernels.set_cuda_kernels(True)``, equal to the CPU's kernels and accurate in float32; the switches that
choose it. The operators themselves are tested on both backends in test_node_contraction.py.

On a machine with CUDA they run on the GPU; elsewhere Triton's interpreter runs the same kernels on CPU tensors
(``TRITON_INTERPRET=1``, set in conftest.py, and the operators routed to them with
``kernels.set_cpu_backend("triton")``), so these tests run everywhere.
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from e3attn import kernels
from e3attn.attention import EquivariantAttention

pytest.importorskip("triton")
CUDA = torch.cuda.is_available()


@pytest.fixture
def device():
    """The device whose tensors the operators send to the Triton kernels."""
    if CUDA:
        previous = kernels.set_cuda_kernels(True)
        yield torch.device("cuda")
        kernels.set_cuda_kernels(previous)
    else:
        previous = kernels.set_cpu_backend("triton")
        yield torch.device("cpu")
        kernels.set_cpu_backend(previous)


def test_the_layer_runs_the_triton_kernels_when_enabled(device, monkeypatch):
    import e3attn.kernels.segments_triton as segments_triton  # interpreted without CUDA (conftest.py)

    calls, original = [], segments_triton.node_pass
    monkeypatch.setattr(segments_triton, "node_pass", lambda *args: calls.append(args[-1]) or original(*args))
    torch.manual_seed(0)
    layer = EquivariantAttention("2x0e + 1x1o", "2x0e", "2x0e", "2x0e + 1x1o", max_radius=1.5).to(device)
    layer(torch.randn(6, 5, device=device), torch.randn(6, 3, device=device))
    assert len(calls) == 2  # the logits (node_expand) and the output (node_outer)


def test_cuda_kernels_run_recorded_graphs_by_default_and_everything_when_switched_on():
    cuda = torch.device("cuda")
    previous = kernels.set_cuda_kernels(None)  # the default (unless E3ATTN_CUDA_KERNELS says otherwise)
    assert not kernels.fused_enabled(cuda, torch.float32)  # eager calls: the plain formulation
    with kernels.recording_graph():
        assert kernels.fused_enabled(cuda, torch.float32) and kernels.fused_enabled(cuda, torch.float64)
        assert not kernels.fused_enabled(cuda, torch.bfloat16)
        assert kernels.fused_enabled(torch.device("cpu"), torch.float32)  # the CPU's are on whatever the setting
    assert not kernels.fused_enabled(cuda, torch.float32)  # the block's end restores it
    try:
        kernels.set_cuda_kernels(True)
        assert kernels.fused_enabled(cuda, torch.float32) and kernels.fused_enabled(cuda, torch.float64)
        assert not kernels.fused_enabled(cuda, torch.bfloat16)
        kernels.set_cuda_kernels(False)
        with kernels.recording_graph():  # switched off: not even in recordings
            assert not kernels.fused_enabled(cuda, torch.float32)
        kernels.set_cuda_kernels(True)
        kernels.set_fused_kernels(False)  # the switch for every device
        assert not kernels.fused_enabled(cuda, torch.float32)
    finally:
        kernels.set_fused_kernels(True)
        kernels.set_cuda_kernels(previous)
    for bad in ("yes", 1, "auto"):
        with pytest.raises(ValueError, match="enabled must be a bool or None"):
            kernels.set_cuda_kernels(bad)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="CUDA is not available")
def test_layer_force_step_on_cuda_equals_cpu(float64_default):
    """The whole layer on the GPU (the node contraction on Triton) against the CPU, a force-training step in
    float64."""
    torch.manual_seed(0)
    layer = EquivariantAttention("4x0e + 2x1o", "3x0e + 1x1o", "3x0e + 1x1o", "2x0e + 2x1o", max_radius=1.5)
    pos, f = torch.randn(40, 3), layer.irreps_input.randn(40, -1)

    def step(device):
        model = layer.to(device)
        p = pos.to(device).requires_grad_()
        energy = model(f.to(device), p)[:, :2].sum()
        forces = -torch.autograd.grad(energy, p, create_graph=True)[0]
        loss = energy ** 2 + forces.pow(2).sum()
        return [g.cpu() for g in torch.autograd.grad(loss, list(model.parameters()))]

    previous = kernels.set_cuda_kernels(True)
    try:
        on_kernels = step("cuda")
    finally:
        kernels.set_cuda_kernels(previous)
    for a, b, c in zip(on_kernels, step("cuda"), step("cpu")):  # Triton, plain on CUDA, numba
        torch.testing.assert_close(a, c, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(b, c, atol=1e-10, rtol=1e-10)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="CUDA is not available")
def test_transformer_with_density_on_cuda_equals_cpu(float64_default):
    """A whole energy model (attention and density channels) on the GPU against the CPU: energies and forces, with
    the weights trained (plain geometry) and frozen (the calculator's case; the CPU takes the geometry kernels)."""
    from e3attn.models import EquivariantTransformer
    from e3attn.models.energy import energy_and_forces

    torch.manual_seed(0)
    model = EquivariantTransformer("1x0e", "8x0e + 4x1o", "0e", 2.0, irreps_node_attr="2x0e", reduce="sum",
                                   density_channels=4)
    pos, attr = torch.randn(30, 3) * 1.5, torch.nn.functional.one_hot(torch.arange(30) % 2, 2).double()
    for frozen in (False, True):
        model.requires_grad_(not frozen)
        results = [energy_and_forces(model.to(d), pos.to(d), node_attr=attr.to(d)) for d in ("cuda", "cpu")]
        for a, b in zip(*results):
            torch.testing.assert_close(a.cpu(), b, atol=1e-10, rtol=1e-10)


def test_layer_float32_on_the_triton_node_kernels_is_accurate(device):
    """The node contraction in float32 (IEEE products, no TF32) against float64, to single-precision accuracy."""
    torch.manual_seed(0)
    layer = EquivariantAttention("4x0e + 2x1o", "3x0e + 1x1o", "3x0e + 1x1o", "2x0e + 2x1o", max_radius=1.5,
                                 num_heads=1).double()
    pos, f = torch.randn(30, 3, dtype=torch.float64), torch.randn(30, 10, dtype=torch.float64)
    ref = layer(f, pos)
    out = layer.float().to(device)(f.float().to(device), pos.float().to(device)).cpu().double()
    torch.testing.assert_close(out, ref, atol=1e-5 * ref.abs().max().item(), rtol=1e-5)


@pytest.mark.parametrize("nodes, heads, width, dim_l, kdim, hidden",
                         [(100, 1, 5, 3, 4, 10), (33, 2, 20, 1, 3, 16), (70, 3, 3, 5, 2, 8), (0, 2, 4, 3, 2, 4),
                          (40, 2, 4, 3, 0, 4)])
def test_node_sum_over_shares_equals_the_sum_of_products(device, nodes, heads, width, dim_l, kdim, hidden):
    """The gradient of the radial networks' last layer, ``sum_i z_i^T U_i`` in its head-diagonal blocks, on strided
    views of ``z`` and ``U`` as the node kernels pass them, split into several shares of nodes (the last one
    partial), in float64."""
    from e3attn.kernels.segments_triton import _node_sum

    torch.manual_seed(0)
    rows, cols = heads * width, kdim * heads * hidden
    z = torch.randn(nodes, 2 + rows * dim_l + 3, dtype=torch.float64, device=device)
    u = torch.randn(nodes, 4 + dim_l * kdim + 1, heads * hidden, dtype=torch.float64, device=device)
    zb = z[:, 2 : 2 + rows * dim_l].unflatten(1, (rows, dim_l))
    ub = u[:, 4 : 4 + dim_l * kdim].unflatten(1, (dim_l, -1)).flatten(2)
    full = torch.einsum("irm,imc->rc", zb, ub).view(heads, width, kdim, heads, hidden)
    expected = torch.diagonal(full, dim1=0, dim2=3).permute(3, 0, 1, 2).reshape(heads, width, kdim * hidden)
    assert ub.shape[2] == cols
    torch.testing.assert_close(_node_sum(zb, ub, heads, hidden), expected, atol=1e-12, rtol=1e-12)


def test_layer_with_a_block_without_paths_runs_on_the_triton_kernels(device):
    """A support that cuts every path into an output irrep leaves a block of the product without paths (``1x1e``
    here): its gradients are zero on the Triton kernels as on numba's, forces and weights alike."""
    torch.manual_seed(0)
    layer = EquivariantAttention("4x0e + 2x1o", "4x0e + 2x1o", "4x0e + 2x1o", "4x0e + 2x1o + 2x1e", max_radius=1.4,
                                 num_heads=2, lmax=2, input_support="0e").double().to(device)
    assert any(row[1] == 0 for row in layer.nodes._value_blocks.tolist())  # the case in question
    pos = torch.randn(30, 3, dtype=torch.float64, requires_grad=True)
    f = torch.randn(30, 10, dtype=torch.float64)
    f[:, 4:] = 0.0  # the support: scalars only
    f.requires_grad_()

    def run():
        out = layer(f.to(device), pos.to(device))
        return [out, *torch.autograd.grad(out.pow(2).sum(), [f, pos, *layer.parameters()], allow_unused=True)]

    on_triton = [t.cpu() if t is not None else None for t in run()]
    previous = kernels.set_cpu_backend("numba") if device.type == "cpu" else kernels.set_cuda_kernels(False)
    try:
        reference = run()
    finally:
        (kernels.set_cpu_backend if device.type == "cpu" else kernels.set_cuda_kernels)(previous)
    for a, b in zip(on_triton, reference):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b.cpu(), atol=1e-10, rtol=1e-10)


@pytest.mark.skipif(CUDA, reason="on a GPU the choices are timed and one is taken")
@pytest.mark.parametrize("pick", range(6))
def test_every_tuned_choice_of_tiles_and_warps_gives_the_same_layer(device, monkeypatch, pick):
    """The Triton kernels' tiles and warps are chosen by timing on a GPU (``tuned``): the layer's output and its
    gradients (every tuned kernel: both edge contractions, the node outer product, the path features and their
    gradients) are the same with each choice, in the interpreter, against the numba kernels."""
    from triton.runtime.autotuner import Autotuner

    from e3attn.kernels import paths_triton, segments_triton

    original = Autotuner.prune_configs
    monkeypatch.setattr(Autotuner, "prune_configs", lambda self, kwargs: [original(self, kwargs)[pick % len(
        original(self, kwargs))]])
    monkeypatch.setattr(segments_triton, "_TUNE_IN_INTERPRETER", True)
    for kernel in (segments_triton._segment_rows_kernel, segments_triton._segment_outer_kernel,
                   paths_triton._coefficients_kernel):
        monkeypatch.setattr(kernel, "cache", {})
    torch.manual_seed(0)
    layer = EquivariantAttention("6x0e + 3x1o + 2x2e", "6x0e + 2x1o", "6x0e + 2x1o", "4x0e + 4x1o", max_radius=1.4,
                                 num_heads=2).double()
    pos = torch.randn(40, 3, dtype=torch.float64, requires_grad=True)
    f = torch.randn(40, 25, dtype=torch.float64, requires_grad=True)

    def run():
        out = layer(f, pos)
        grads = torch.autograd.grad(out.pow(2).sum(), [f, pos, *layer.parameters()])
        return [out, *grads]

    tuned = run()
    kernels.set_cpu_backend("numba")
    for a, b in zip(tuned, run()):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


_SUBPROCESS = textwrap.dedent("""
    import sys, torch, e3attn
    from e3attn import kernels
    layer = e3attn.EquivariantAttention("4x0e + 1x1o", "2x0e", "2x0e", "2x0e + 1x1o", max_radius=1.5).double()
    pos, f = torch.randn(12, 3, dtype=torch.float64), torch.randn(12, 7, dtype=torch.float64)
    out = layer(f, pos)
    kernels.set_fused_kernels(False)
    print(kernels.backend(torch.device("cpu")), "e3attn.kernels.segments_triton" in sys.modules,
          float((out - layer(f, pos)).abs().max()))
""")


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | env
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=600)


@pytest.mark.skipif(CUDA, reason="the interpreter is for machines without a GPU")
def test_kernel_backend_environment_variable():
    """``E3ATTN_KERNEL_BACKEND=triton`` runs the layer's node kernels on Triton (interpreted) on CPU tensors, equal to
    the plain formulation; an unknown value is refused, naming the variable."""
    done = _python(_SUBPROCESS, E3ATTN_KERNEL_BACKEND="Triton ")
    assert done.returncode == 0, done.stderr
    name, imported, diff = done.stdout.split()
    assert name == "triton" and imported == "True" and float(diff) < 1e-12
    refused = _python("import e3attn", E3ATTN_KERNEL_BACKEND="cuda")
    assert refused.returncode != 0 and "E3ATTN_KERNEL_BACKEND must be 'numba' or 'triton'" in refused.stderr

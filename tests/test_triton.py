"""The Triton kernels (e3attn.kernels.gpu): equal to the plain formulation, values, first and second derivatives.

On a machine with CUDA they run on the GPU; elsewhere Triton's interpreter runs the same kernels on CPU tensors
(``TRITON_INTERPRET=1``, set in conftest.py, and the operators routed to them with
``kernels.set_cpu_backend("triton")``), so these tests run everywhere.
"""
import importlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from e3attn import kernels
from e3attn.attention import EquivariantAttention
from e3attn.kernels import ops
from test_fast_paths import TP_CASES
from test_kernels import _case, _op_args

pytest.importorskip("triton")
CUDA = torch.cuda.is_available()


gpu = importlib.import_module("e3attn.kernels.gpu")  # interpreted without CUDA (conftest.py)


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


def _on(device, tensors):
    return [t.detach().to(device).requires_grad_(t.requires_grad) if t is not None and t.is_floating_point()
            else (t.to(device) if t is not None else None) for t in tensors]


@pytest.mark.parametrize("case, nodes, num", [(case, nodes, 37) for case in TP_CASES for nodes in (None, 5)]
                         + [(TP_CASES[0], 40, 300)])
def test_triton_forward_and_backward_equal_the_plain_formulation(case, nodes, num, device, float64_default):
    """Gathered or not, one tile or several (300 edges); every gradient, against plain autograd in float64."""
    tp, x, sh, hs, ls, index = _case(case, num=num, nodes=nodes or 0)
    inputs = [x, sh, *hs, *ls]
    ref = tp._forward_plain(x, sh, hs, ls, index, tp.constant("cg", torch.float64))
    cot = [torch.randn(o.shape, dtype=torch.float64) for o in ref]
    ref_grads = torch.autograd.grad(ref, inputs, cot)

    x_d, sh_d, index_d, *rest = _on(device, [x, sh, index, *hs, *ls])
    hs_d, ls_d = rest[: len(hs)], rest[len(hs):]
    outs = tp.to(device).forward_factored(x_d, sh_d, hs_d, ls_d, index=index_d)
    grads = torch.autograd.grad(outs, [x_d, sh_d, *hs_d, *ls_d], [c.to(device) for c in cot])
    for a, b in zip([*outs, *grads], [*ref, *ref_grads]):
        torch.testing.assert_close(a.cpu(), b, atol=1e-12, rtol=1e-12)


def test_triton_kernels_run_when_enabled(device, float64_default, monkeypatch):
    calls, original = [], gpu.forward
    monkeypatch.setattr(gpu, "forward", lambda *args: calls.append(args[0]) or original(*args))
    tp, *args = _op_args()
    ops.fused_product(tp._spec, 0, *_on(device, args[0][:5]), args[0][5])
    assert len(calls) == 1


def test_cuda_kernels_are_opt_in():
    cuda = torch.device("cuda")
    assert not kernels.fused_enabled(cuda, torch.float32)  # off by default
    previous = kernels.set_cuda_kernels(True)
    try:
        assert kernels.fused_enabled(cuda, torch.float32) and kernels.fused_enabled(cuda, torch.float64)
        assert not kernels.fused_enabled(cuda, torch.bfloat16)
        kernels.set_fused_kernels(False)  # the switch for every device
        assert not kernels.fused_enabled(cuda, torch.float32)
    finally:
        kernels.set_fused_kernels(True)
        kernels.set_cuda_kernels(previous)
    with pytest.raises(ValueError, match="enabled must be a bool"):
        kernels.set_cuda_kernels("yes")


def test_triton_second_derivatives_equal_the_plain_formulation(device, float64_default):
    """Forces-style: a differentiable first derivative, then the gradient of a function of it (the output
    gradient too): the backward of the backward composed from the Triton forward and backward."""
    tp, x, sh, hs, ls, index = _case(TP_CASES[1], num=11, nodes=5)
    results = []
    for on in ("plain", device):
        inputs = [x, sh, index, *hs, *ls] if on == "plain" else _on(on, [x, sh, index, *hs, *ls])
        xi, shi, idx, *rest = inputs
        hsi, lsi = rest[: len(hs)], rest[len(hs):]
        if on == "plain":
            outs = tp._forward_plain(xi, shi, hsi, lsi, idx, tp.constant("cg", torch.float64))
        else:
            outs = tp.forward_factored(xi, shi, hsi, lsi, index=idx)
        cot = [torch.linspace(-1, 1, o.numel(), dtype=torch.float64, device=o.device).reshape(o.shape)
               .requires_grad_() for o in outs]
        leaves = [xi, shi, *hsi, *lsi]
        first = torch.autograd.grad(outs, leaves, cot, create_graph=True)
        scalar = sum((g * g.detach().sin()).sum() for g in first)
        results.append([g.cpu() for g in torch.autograd.grad(scalar, leaves + cot, materialize_grads=True,
                                                              allow_unused=True)])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-11)


def test_triton_float32_is_accurate(device):
    """float32 kernels (IEEE products, no TF32) against float64 to single-precision accuracy."""
    tp, (x, index, sh, hidden, linear, sizes) = _op_args(TP_CASES[0], nodes=9, num=70)
    args64 = [t.detach() if t is not None else None for t in (x, index, sh, hidden, linear)]
    ref = ops.fused_product(tp._spec, 0, *_on(device, args64), sizes).cpu()
    args32 = [t.float() if t is not None and t.is_floating_point() else t for t in args64]
    out = ops.fused_product(tp._spec, 0, *_on(device, args32), sizes).cpu()
    torch.testing.assert_close(out.double(), ref, atol=1e-5 * ref.abs().max().item(), rtol=1e-5)


def test_triton_empty_and_single_edge(device, float64_default):
    for num in (0, 1):
        tp, x, sh, hs, ls, index = _case(TP_CASES[0], num=num, nodes=3)
        ref = tp._forward_plain(x, sh, hs, ls, index, tp.constant("cg", torch.float64))
        x_d, sh_d, index_d, *rest = _on(device, [x, sh, index, *hs, *ls])
        outs = tp.forward_factored(x_d, sh_d, rest[:2], rest[2:], index=index_d)
        for a, b in zip(outs, ref):
            assert a.shape == b.shape
            torch.testing.assert_close(a.cpu(), b, atol=1e-12, rtol=0)
        grads = torch.autograd.grad([o.sum() for o in outs], [x_d, sh_d, *rest])
        ref_grads = torch.autograd.grad([o.sum() for o in ref], [x, sh, *hs, *ls])
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a.cpu(), b, atol=1e-12, rtol=0)


def test_backward_backward_operator_is_numba_only(device):
    tp, (x, index, sh, hidden, linear, sizes) = _op_args()
    args = _on(device, [x.detach(), index, sh.detach(), hidden.detach(), linear.detach()])
    grad = torch.zeros(sh.shape[0], sum(o.dim for o in tp.irreps_outs), dtype=sh.dtype, device=device)
    with pytest.raises(NotImplementedError, match="numba kernels"):
        ops.fused_product_backward_backward(tp._spec, 0, *args, sizes, grad, None, None, None, None, [True] * 5)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="CUDA is not available")
def test_layer_force_step_on_cuda_equals_cpu(float64_default):
    """The whole layer on the GPU (fused kernels) against the CPU, a force-training step in float64."""
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


def test_layer_float32_on_the_triton_node_kernels_is_accurate(device):
    """The node contraction in float32 (IEEE products, no TF32) against float64, to single-precision accuracy."""
    torch.manual_seed(0)
    layer = EquivariantAttention("4x0e + 2x1o", "3x0e + 1x1o", "3x0e + 1x1o", "2x0e + 2x1o", max_radius=1.5,
                                 num_heads=1).double()
    pos, f = torch.randn(30, 3, dtype=torch.float64), torch.randn(30, 10, dtype=torch.float64)
    ref = layer(f, pos)
    out = layer.float().to(device)(f.float().to(device), pos.float().to(device)).cpu().double()
    torch.testing.assert_close(out, ref, atol=1e-5 * ref.abs().max().item(), rtol=1e-5)


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

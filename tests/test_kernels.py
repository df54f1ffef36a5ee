"""The fused kernels (e3attn.kernels): equal to e3nn and to the plain formulation, values and first and second
derivatives, in float64; custom operators that pass opcheck; bitwise repeatable; opt-in switch."""
import os
from pathlib import Path

import pytest
import torch
from e3nn import o3

from e3attn import kernels
from e3attn.attention import EquivariantAttention
from e3attn.kernels import ops
from e3attn.tensor_product import SphericalTensorProduct
from kernel_switch import plain
from test_compile import _benchmark
from test_fast_paths import TP_CASES, _inputs

pytest.importorskip("numba")


@pytest.fixture
def fused(monkeypatch):
    """Yields the list of the fused kernels' forward calls (by product) during a test."""
    calls, original = [], ops.fused_product
    monkeypatch.setattr(ops, "fused_product", lambda *args: calls.append(args[0]) or original(*args))
    previous = kernels.set_fused_kernels(True)
    yield calls
    kernels.set_fused_kernels(previous)


def _case(case, num=13, nodes=6, seed=0):
    irreps_in, lmax, outs = case
    tp = SphericalTensorProduct(irreps_in, o3.Irreps.spherical_harmonics(lmax), outs)
    x, sh, hs, ls = _inputs(tp, num, nodes=nodes, seed=seed)
    index = torch.randint(0, nodes, (num,), generator=torch.Generator().manual_seed(seed + 1)) if nodes else None
    return tp, x, sh, hs, ls, index


def test_forward_factored_runs_the_kernels_by_default(fused, float64_default):
    tp, x, sh, hs, ls, index = _case(TP_CASES[0])
    tp.forward_factored(x, sh, hs, ls, index=index)
    assert fused == [tp._spec]
    kernels.set_fused_kernels(False)
    tp.forward_factored(x, sh, hs, ls, index=index)  # the plain formulation
    assert fused == [tp._spec]


@pytest.mark.parametrize("case", TP_CASES)
def test_fused_second_derivatives_equal_the_plain_formulation(case, fused, float64_default):
    """Forces-style: a differentiable first derivative, then the gradient of a function of it (every input,
    the output gradient too), against plain autograd of the plain formulation."""
    tp, x, sh, hs, ls, index = _case(case, num=11, nodes=5)
    inputs = [x, sh, *hs, *ls]
    results = []
    for run in (lambda: tp.forward_factored(x, sh, hs, ls, index=index, chunk_size=4),
                lambda: tp._forward_plain(x, sh, hs, ls, index, tp.constant("cg", torch.float64))):
        outs = run()
        cot = [torch.linspace(-1, 1, o.numel(), dtype=torch.float64).reshape(o.shape).requires_grad_() for o in outs]
        first = torch.autograd.grad(outs, inputs, cot, create_graph=True)
        scalar = sum((g * g.detach().sin()).sum() for g in first if g.requires_grad)
        results.append(torch.autograd.grad(scalar, inputs + cot, allow_unused=True, materialize_grads=True))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-12)


def test_fused_gradcheck_and_gradgradcheck(fused, float64_default):
    tp, x, sh, hs, ls, index = _case(TP_CASES[3], num=5, nodes=3)

    def f(x, sh, h, w):
        return tp.forward_factored(x, sh, [h], [w], index=index, chunk_size=2)[0]

    args = (x, sh, hs[0], ls[0])
    assert torch.autograd.gradcheck(f, args)
    assert torch.autograd.gradgradcheck(f, args)


def _op_args(case=TP_CASES[1], nodes=5, num=11):
    tp, x, sh, hs, ls, index = _case(case, num=num, nodes=nodes)
    hidden = torch.cat(hs, dim=1).detach().requires_grad_()
    linear = torch.cat([w.reshape(-1) for w in ls]).detach().requires_grad_()
    return tp, (x, index, sh, hidden, linear, [h.shape[1] for h in hs])


@pytest.mark.parametrize("nodes", [None, 5])
def test_fused_operators_pass_opcheck(nodes):
    # schema, fake implementation, autograd registration (double backward included) and AOT dispatch
    tp, (x, index, sh, hidden, linear, sizes) = _op_args(nodes=nodes)
    torch.library.opcheck(ops.fused_product, (tp._spec, 4, x, index, sh, hidden, linear, sizes))
    grad = torch.randn(sh.shape[0], sum(o.dim for o in tp.irreps_outs), dtype=torch.float64, requires_grad=True)
    for needs in ([True] * 4, [False, True, True, False], [True, False, False, True]):
        torch.library.opcheck(ops.fused_product_backward,
                              (tp._spec, 4, x, index, sh, hidden, linear, sizes, grad, needs))


def test_fused_results_are_bitwise_repeatable():
    """Run to run and for any number of threads: the weight gradient is summed per fixed group of tiles."""
    tp, (x, index, sh, hidden, linear, sizes) = _op_args(TP_CASES[0], nodes=40, num=300)
    args = (tp._spec, 8, *[t.detach().float() if t is not None and t.is_floating_point() else t
                           for t in (x, index, sh, hidden, linear)], sizes)
    grad = torch.randn(300, sum(o.dim for o in tp.irreps_outs))
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 2):
            torch.set_num_threads(threads)
            results.append([ops.fused_product(*args), *ops.fused_product_backward(*args, grad, [True] * 4)])
    finally:
        torch.set_num_threads(before)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def test_fused_empty_and_single_edge(fused, float64_default):
    tp = SphericalTensorProduct(*TP_CASES[0][:1], o3.Irreps.spherical_harmonics(TP_CASES[0][1]), TP_CASES[0][2])
    for num in (0, 1):
        x, sh, hs, ls = _inputs(tp, num, nodes=3)
        index = torch.zeros(num, dtype=torch.long)
        outs = tp.forward_factored(x, sh, hs, ls, index=index)
        ref = tp._forward_plain(x, sh, hs, ls, index, tp.constant("cg", torch.float64))
        for a, b in zip(outs, ref):
            assert a.shape == b.shape == (num, b.shape[1])
            torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
        inputs = [x, sh, *hs, *ls]
        got = torch.autograd.grad([o.sum() for o in outs], inputs)
        for a, b in zip(got, torch.autograd.grad([o.sum() for o in ref], inputs)):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_layer_forces_training_with_fused_kernels_equals_plain(float64_default):
    """A force-training step (second derivative in positions) gives the same gradients either way."""
    torch.manual_seed(0)
    layer = EquivariantAttention("4x0e + 2x1o", "3x0e + 1x1o", "3x0e + 1x1o", "2x0e + 2x1o", max_radius=1.5)
    pos = torch.randn(12, 3)
    f = layer.irreps_input.randn(12, -1)

    def step():
        p = pos.clone().requires_grad_()
        energy = layer(f, p)[:, :2].sum()
        forces = -torch.autograd.grad(energy, p, create_graph=True)[0]
        loss = energy ** 2 + forces.pow(2).sum()
        return torch.autograd.grad(loss, list(layer.parameters()))

    for a, b in zip(step(), plain(step)):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_fused_switch_and_where_it_applies():
    assert kernels.fused_enabled(torch.device("cpu"), torch.float32)  # on by default
    with pytest.raises(ValueError, match="enabled must be a bool"):
        kernels.set_fused_kernels(1)
    assert kernels.set_fused_kernels(False) is True
    assert not kernels.fused_enabled(torch.device("cpu"), torch.float64)
    kernels.set_fused_kernels(True)
    try:
        assert kernels.fused_enabled(torch.device("cpu"), torch.float64)
        assert not kernels.fused_enabled(torch.device("cpu"), torch.bfloat16)
        assert not kernels.fused_enabled(torch.device("meta"), torch.float32)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not kernels.fused_enabled(torch.device("cpu"), torch.float32)
    finally:
        kernels.set_fused_kernels(True)


def test_kernels_leave_torch_thread_count_alone():
    """numba's OpenMP launch must not change the number of threads of torch's own operations."""
    tp, (x, index, sh, hidden, linear, sizes) = _op_args()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        ops.fused_product(tp._spec, 4, x.detach(), index, sh.detach(), hidden.detach(), linear.detach(), sizes)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("directions", [(True, True, True, True), (False, True, True, False),
                                        (True, False, False, True)])
def test_fused_backward_backward_operator(directions):
    """The one-pass backward of the backward passes opcheck and equals the composed path (calls of the forward
    and backward operators with one argument replaced, used when it must itself be differentiable)."""
    tp, (x, index, sh, hidden, linear, sizes) = _op_args(nodes=5)
    grad = torch.randn(sh.shape[0], sum(o.dim for o in tp.irreps_outs), dtype=torch.float64, requires_grad=True)
    gen = torch.Generator().manual_seed(3)
    vs = [torch.randn(t.shape, generator=gen, dtype=torch.float64) if given else None
          for t, given in zip((x, sh, hidden, linear), directions)]
    needs = [True] * 5
    args = (tp._spec, 4, x.detach(), index, sh.detach(), hidden.detach(), linear.detach(), sizes, grad.detach())
    torch.library.opcheck(ops.fused_product_backward_backward, (*args, *vs, needs))
    fused = ops.fused_product_backward_backward(*args, *vs, needs)

    inputs = [x, sh, hidden, linear, grad]
    first = ops.fused_product_backward(tp._spec, 4, x, index, sh, hidden, linear, sizes, grad, [True] * 4)
    pairs = [(g, v) for g, v in zip(first, vs) if v is not None]
    composed = torch.autograd.grad([g for g, _ in pairs], inputs, [v for _, v in pairs], create_graph=True,
                                   materialize_grads=True)
    reorder = [composed[4], *composed[:4]]  # grad first, as the operator returns them
    for a, b in zip(fused, reorder):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-11)


@pytest.fixture(params=["openmp", "python"])
def kernel_threads(request, monkeypatch):
    """Both backends of :mod:`e3attn.kernels.threads` (PyTorch's OpenMP threads where its runtime has them)."""
    from e3attn.kernels import threads

    monkeypatch.setenv("E3ATTN_KERNEL_THREADS", request.param)
    monkeypatch.setattr(threads, "SERIAL_BELOW", 0)  # small test cases on the threads too
    if threads.backend() != request.param:
        pytest.skip(f"PyTorch's OpenMP runtime has no GOMP_parallel here (backend {threads.backend()})")
    return threads


def test_kernels_from_several_python_threads_at_once(kernel_threads):
    """Concurrent calls (e.g. a threaded server) give the results of sequential calls."""
    import concurrent.futures

    tp, (x, index, sh, hidden, linear, sizes) = _op_args(TP_CASES[0], nodes=30, num=200)
    args = (tp._spec, 8, x.detach(), index, sh.detach(), hidden.detach(), linear.detach(), sizes)
    expected = ops.fused_product(*args)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: ops.fused_product(*args), range(8)))
    assert all(torch.equal(r, expected) for r in results)


@pytest.mark.parametrize("num_threads", [1, 2, 3])
def test_parallel_runs_every_group_once_and_returns_only_when_all_are_done(kernel_threads, num_threads):
    """Each group once, and when one fails the error is raised only once no group runs any more (they write
    into the caller's buffers)."""
    import threading
    import time

    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        seen, lock = [], threading.Lock()

        def record(group):
            with lock:
                seen.append((group, threading.get_ident()))

        kernel_threads.parallel(record, 13, work=1)
        assert sorted(g for g, _ in seen) == list(range(13))
        running, started = [0], []

        def task(group):
            with lock:
                running[0] += 1
                started.append(group)
            try:
                if group == 1:
                    raise RuntimeError("group 1 failed")
                time.sleep(0.01)
            finally:
                with lock:
                    running[0] -= 1

        with pytest.raises(RuntimeError, match="group 1 failed"):
            kernel_threads.parallel(task, 6, work=1)
        assert running == [0] and 1 in started  # nothing still runs, and no group ran twice
        assert len(started) == len(set(started))
        seen.clear()
        kernel_threads.SERIAL_BELOW = 100
        kernel_threads.parallel(record, 13, work=99)  # too little work for threads: all on the calling thread
        assert [g for g, _ in seen] == list(range(13)) and {t for _, t in seen} == {threading.get_ident()}
    finally:
        torch.set_num_threads(previous)


def test_threads_backend_refuses_an_unknown_choice(monkeypatch):
    from e3attn.kernels import threads

    monkeypatch.setenv("E3ATTN_KERNEL_THREADS", "tbb")
    with pytest.raises(ValueError, match=r"E3ATTN_KERNEL_THREADS must be 'openmp' or 'python' \(in any case, or "
                                         r"unset\), got 'tbb'"):
        threads.backend()
    monkeypatch.setenv("E3ATTN_KERNEL_THREADS", " Python ")
    assert threads.backend() == "python"


def test_layer_is_bitwise_the_same_on_either_threads_backend(kernel_threads, float64_default):
    """Results (values and gradients, forces included) do not depend on the threads that run the kernels."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.manual_seed(0)
        layer = EquivariantAttention("4x0e + 2x1o", "4x0e + 2x1o", "4x0e + 2x1o", "4x0e + 2x1o", max_radius=1.0,
                                     num_heads=2)
        pos = (torch.rand(60, 3) * 2).requires_grad_()
        f = torch.randn(60, layer.irreps_input.dim, requires_grad=True)

        def run():
            energy = layer(f, pos).pow(2).sum()
            (forces,) = torch.autograd.grad(energy, pos, create_graph=True)
            return [energy.detach(), forces.detach(), *torch.autograd.grad(forces.pow(2).sum(), [f, pos])]

        results = run()
        for backend in ("python", "openmp"):
            os.environ["E3ATTN_KERNEL_THREADS"] = backend
            assert all(torch.equal(a, b) for a, b in zip(run(), results))
    finally:
        torch.set_num_threads(previous)


def test_fused_operators_refuse_out_of_range_arguments():
    tp, (x, index, sh, hidden, linear, sizes) = _op_args(nodes=5)
    args = [tp._spec, 4, x.detach(), index, sh.detach(), hidden.detach(), linear.detach(), sizes]
    with pytest.raises(IndexError, match=r"index must be in \[0, 5\)"):
        ops.fused_product(*args[:3], index + 5, *args[4:])
    with pytest.raises(IndexError, match="index must be in"):
        ops.fused_product(*args[:3], index - 1, *args[4:])
    with pytest.raises(ValueError, match="hidden must have shape"):
        ops.fused_product(*args[:5], hidden.detach()[:-1], *args[6:])
    with pytest.raises(ValueError, match="linear must have shape"):
        ops.fused_product(*args[:6], linear.detach()[:-1], sizes)
    with pytest.raises(ValueError, match="too few columns"):
        ops.fused_product(*args[:4], sh.detach()[:, :2], *args[5:])
    # through the public method, too
    with pytest.raises(IndexError, match="index must be in"):
        tp.forward_factored(x, sh, list(hidden.split(sizes, 1)), [w.view(h, -1) for h, w in
                            zip(sizes, linear.split([h * n for h, n in zip(sizes, tp.weight_numel)]))], index=index + 5)


def test_kernels_benchmark_counts_the_weight_products_and_runs(tmp_path):
    bench = _benchmark("kernels")
    report = bench.main(["--quick", "--configs", "guide", "--out", str(tmp_path / "k.json")])
    (row,) = report["results"]
    # the blocks tile every output's [K, W] weights: w = h L costs 2 * hidden * weight_numel per edge and output
    layer = EquivariantAttention(*bench.CONFIGS["guide"]["irreps"], 1.0, lmax=bench.CONFIGS["guide"]["lmax"])
    expected = sum(2 * layer.radial.hidden * n for n in layer.tp.weight_numel)
    assert row["flops_per_edge"]["weights_forward"] == expected
    assert row["flops_per_edge"]["backward"] > 3 * expected
    for key in ("forward_gflops", "backward_gflops", "peak_gflops", "blas_gflops", "floor_ms",
                "node_forward_gflops", "node_backward_gflops", "node_floor_ms"):
        assert row[key] > 0, key
    # at the nodes: 15 paths into 0e (10 + 5) and 20 into 1o (10 + 5 + 5, 3 components) for 1 head x 16 hidden
    assert layer.nodes.num_paths == 75
    edges = row["edges"]
    assert row["node_flops"]["node_forward"] > edges * 2 * (2 * 16 * 75)  # D + U per edge, plus the rest
    assert row["node_flops"]["node_forward"] < row["flops_per_edge"]["forward"] * edges  # the point of it
    assert row["node_flops"]["node_backward"] < row["flops_per_edge"]["backward"] * edges


@pytest.mark.slow
def test_cold_start_benchmark_smoke(tmp_path):
    """benchmarks/cold_start.py: a process with an empty numba cache compiles, a second one loads the cache, a
    third runs without the kernels."""
    cold, warm, plain = _benchmark("cold_start").main(["--dtypes", "float32", "--out", str(tmp_path / "c.json")])
    assert (cold["start"], warm["start"], plain["start"]) == ("cold", "warm", "plain")
    assert cold["startup_s"] > warm["startup_s"] > 0 and plain["startup_s"] > 0  # compiling costs most


@pytest.mark.slow
def test_kernel_cache_of_a_read_only_install(tmp_path):
    """Installed where the user cannot write (e.g. a system site-packages), the kernels compile into numba's
    per-user cache directory (``$XDG_CACHE_HOME/numba``) and the next process loads them from there. Root,
    whom file permissions do not stop, gets a read-only bind mount of the package in a mount namespace."""
    import json
    import shutil
    import subprocess
    import sys

    site, cache = tmp_path / "site", tmp_path / "cache"
    shutil.copytree(Path(kernels.__file__).parents[1], site / "e3attn",
                    ignore=shutil.ignore_patterns("__pycache__", "*.nbi", "*.nbc"))
    cache.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env.update(PYTHONPATH=str(site), XDG_CACHE_HOME=str(cache))
    child = _benchmark("cold_start").CHILD + f"\nassert e3attn.__file__.startswith({str(site)!r}), e3attn.__file__\n"
    command = [sys.executable, "-c", child, "float64"]
    if os.geteuid() == 0:
        mount = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"'
        command = ["unshare", "-m", "--propagation", "private", "sh", "-c", mount, str(site), *command]
        probe = subprocess.run(command[:6] + [mount.split(" && exec")[0] + ' && ! touch "$0/probe"', str(site)],
                               capture_output=True)
        if probe.returncode != 0:
            pytest.skip(f"no read-only bind mount for root here: {probe.stderr.decode()[-200:]}")
    else:
        for path in [site, *site.rglob("*")]:
            path.chmod(0o555 if path.is_dir() else 0o444)

    def start_up() -> float:
        done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        row = json.loads(done.stdout.strip().splitlines()[0])
        return row["first_step_s"] - row["second_step_s"]

    try:
        compiled, loaded = start_up(), start_up()
        assert list((cache / "numba").rglob("*.nbi")) and not list(site.rglob("*.nbi"))
        assert loaded < compiled / 3  # the second process found the first one's cache
    finally:
        for path in [site, *site.rglob("*")]:
            if path.is_dir():
                path.chmod(0o755)

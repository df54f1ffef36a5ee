"""The kernels' switches and threads (e3attn.kernels, e3attn.kernels.threads): where the compiled kernels run,
results that do not depend on the threads that run them, several Python threads at once, the numba cache."""
import os
from pathlib import Path

import pytest
import torch
from e3nn import o3

from e3attn import kernels
from e3attn.attention import EquivariantAttention
from e3attn.kernels import segment_ops
from e3attn.tensor_product import SphericalTensorProduct
from test_compile import _benchmark

pytest.importorskip("numba")


def _path_features_args(num, nodes, seed=0):
    """The arguments ``spec, x, index, sh`` of ``segment_ops.path_features`` for the guide's keys and values."""
    tp = SphericalTensorProduct("10x0e + 5x1o", o3.Irreps.spherical_harmonics(3), ["12x0e + 3x1o", "14x0e + 6x1o"])
    gen = torch.Generator().manual_seed(seed)
    x, sh = torch.randn(nodes, tp.irreps_in.dim, generator=gen), torch.randn(num, tp.irreps_sh.dim, generator=gen)
    return tp._spec, x, torch.randint(0, nodes, (num,), generator=gen), sh


def test_kernel_switch_and_where_it_applies():
    assert kernels.fused_enabled(torch.device("cpu"), torch.float32)  # on by default
    with pytest.raises(ValueError, match="enabled must be a bool"):
        kernels.set_fused_kernels(1)
    assert kernels.set_fused_kernels(False) is True
    assert not kernels.fused_enabled(torch.device("cpu"), torch.float64)
    assert not kernels.segments_enabled(torch.device("cpu"), torch.float64)
    kernels.set_fused_kernels(True)
    try:
        assert kernels.fused_enabled(torch.device("cpu"), torch.float64)
        assert not kernels.fused_enabled(torch.device("cpu"), torch.bfloat16)
        assert not kernels.fused_enabled(torch.device("meta"), torch.float32)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not kernels.fused_enabled(torch.device("cpu"), torch.float32)
    finally:
        kernels.set_fused_kernels(True)


def test_kernels_leave_torch_thread_count_alone(monkeypatch):
    """Running the numba kernels on threads must not change the number of threads of torch's own operations."""
    from e3attn.kernels import threads

    monkeypatch.setattr(threads, "SERIAL_BELOW", 0)  # a small case on the threads too
    args = _path_features_args(num=300, nodes=40)
    before = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            segment_ops.path_features(*args)
            assert torch.get_num_threads() == count
    finally:
        torch.set_num_threads(before)


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

    args = _path_features_args(num=200, nodes=30)
    grad = torch.randn(200, segment_ops.path_features(*args).shape[1], generator=torch.Generator().manual_seed(1))

    def call(_):
        return [segment_ops.path_features(*args), *segment_ops.path_features_backward(*args, grad, [True, True])]

    expected = call(None)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(call, range(8)))
    assert all(torch.equal(a, b) for r in results for a, b in zip(r, expected))


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


def test_kernels_benchmark_counts_the_weight_products_and_runs(tmp_path):
    bench = _benchmark("kernels")
    report = bench.main(["--quick", "--configs", "guide", "--out", str(tmp_path / "k.json")])
    (row,) = report["results"]
    # the blocks tile every output's [K, W] weights: w = h L costs 2 * hidden * weight_numel per edge and output
    layer = EquivariantAttention(*bench.CONFIGS["guide"]["irreps"], 1.0, lmax=bench.CONFIGS["guide"]["lmax"])
    expected = sum(2 * layer.radial.hidden * n for n in layer.tp.weight_numel)
    assert row["flops_per_edge"]["weights_forward"] == expected
    assert row["flops_per_edge"]["backward"] > 3 * expected
    for key in ("peak_gflops", "blas_gflops", "edge_floor_ms", "node_forward_gflops", "node_backward_gflops",
                "node_floor_ms"):
        assert row[key] > 0, key
    # at the nodes: 15 paths into 0e (10 + 5) and 20 into 1o (10 + 5 + 5, 3 components) for 1 head x 16 hidden
    assert layer.nodes.num_paths == 75
    edges = row["edges"]
    assert row["node_flops"]["node_forward"] > edges * 2 * (2 * 16 * 75)  # D + U per edge, plus the rest
    assert row["node_flops"]["node_forward"] < row["flops_per_edge"]["forward"] * edges  # the point of it
    assert row["node_flops"]["node_backward"] < row["flops_per_edge"]["backward"] * edges
    assert row["node_floor_ms"] < row["edge_floor_ms"]


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

"""Smoke test of benchmarks/dense_vs_sparse.py and checks of its pieces."""
import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "dense_vs_sparse.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("dense_vs_sparse", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.mark.slow  # about 10 s on 2 idle cores: 16 configurations, each run 5 times, and a figure
def test_quick_run_writes_json_and_figure(bench, tmp_path, capsys):
    out, fig = tmp_path / "r.json", tmp_path / "r.png"
    report = bench.main(["--quick", "--device", "cpu", "--min-time", "0", "--out", str(out), "--fig", str(fig)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert fig.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["meta"]["clock"] == "cpu" and report["meta"]["device_type"] == "cpu"
    rows = report["results"]
    keys = {(r["kind"], r["density"], r["form"], r["n"]) for r in rows}
    assert keys == {(k, d, f, n) for k in bench.KINDS for d in bench.DENSITIES for f in bench.FORMS for n in (8, 16)}
    for r in rows:
        assert r["skipped"] is None
        assert r["fwd_s"] > 0 and r["fwdbwd_s"] > 0
        if report["meta"]["memory_method"] != "none":
            assert r["fwd_mb"] >= 0 and r["fwdbwd_mb"] >= 0
        if r["density"] == "complete":  # plain: with self loops; equivariant: radius graph without them
            assert r["edges"] == r["n"] ** 2 - (r["n"] if r["kind"] == "equivariant" else 0)
        assert r["pairs"] == (r["n"] ** 2 if r["form"] == "dense" else r["edges"])
    expected = {f"{k}/{d}/{p}" for k in bench.KINDS for d in bench.DENSITIES for p in bench.PASSES}
    assert set(report["crossover"]) == expected
    printed = capsys.readouterr().out
    assert "crossover" in printed and "sparse" in printed


def _rows(times_dense, times_sparse, sizes):
    return [
        {"kind": "plain", "density": "radius", "form": form, "n": n, "skipped": None, "fwd_s": t}
        for form, times in (("dense", times_dense), ("sparse", times_sparse))
        for n, t in zip(sizes, times)
    ]


@pytest.mark.parametrize(
    "dense, sparse, first",
    [
        ([1, 2, 4, 8], [4, 3, 2, 1], 1000),  # sparse wins from 1000 on
        ([1, 2, 4, 8], [0.5, 3, 2, 1], 1000),  # an early win that does not last does not count
        ([1, 2, 4, 8], [0.5, 1, 2, 4], 10),  # sparse always faster
        ([1, 2, 4, 8], [0.5, 1, 2, 9], None),  # dense wins at the largest size
    ],
)
def test_crossover_definition(bench, dense, sparse, first):
    sizes = [10, 100, 1000, 10000]
    c = bench.crossover(_rows(dense, sparse, sizes), "plain", "radius", "fwd_s")
    assert c["n"] == first and c["sizes"] == sizes
    if first in (None, 10):
        assert c["interpolated"] is None
    else:  # the ratio sparse/dense crosses 1 between the two sizes: interpolate log(ratio) against log(N)
        i = sizes.index(first)
        log_ratio = [math.log(sparse[j] / dense[j]) for j in (i, i - 1)]  # increasing, for np.interp
        expected = math.exp(np.interp(0.0, log_ratio, [math.log(sizes[i]), math.log(sizes[i - 1])]))
        assert c["interpolated"] == pytest.approx(expected, rel=1e-12)
        assert sizes[i - 1] < c["interpolated"] < sizes[i]


def test_crossover_ignores_skipped_sizes(bench):
    rows = _rows([1, 2, 4, 8], [4, 3, 2, 1], [10, 100, 1000, 10000])
    rows[3]["skipped"] = "estimated 9 GB > --max-gb 4"  # dense at 10000
    c = bench.crossover(rows, "plain", "radius", "fwd_s")
    assert c["sizes"] == [10, 100, 1000] and c["n"] == 1000


def test_box_side_gives_the_requested_neighbours(bench):
    n, neighbours = 3000, 16
    side = bench.box_side(n, neighbours)
    pos = torch.rand(n, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * side
    inner = ((pos > 1) & (pos < side - 1)).all(dim=1)  # the whole unit ball lies inside the box
    counts = (torch.cdist(pos[inner], pos) < 1).sum(dim=1) - 1  # minus the point itself
    assert inner.sum() > 200
    assert abs(counts.double().mean().item() - neighbours) < 1.0


def test_peak_memory_of_a_known_allocation(bench):
    method = bench.memory_method(torch.device("cpu"))
    if method == "none":
        pytest.skip("peak memory is measured on Linux only")

    def allocate():
        x = torch.ones(16 * 2**20, dtype=torch.float32)  # 64 MiB, touched
        y = x * 2  # another 64 MiB while x is alive
        del x, y

    allocate()  # warm-up
    assert 127 < bench.peak_mib(allocate, method, torch.device("cpu")) < 136


def test_clock_choice(bench):
    assert bench.clock_name(torch.device("cpu")) == "cpu"
    assert bench.clock_name(torch.device("cuda")) == "wall"
    assert bench.clock_name(torch.device("cpu"), "wall") == "wall"


def test_skip_rule(bench):
    previous = {"pairs": 100, "fwd_mb": 50.0, "fwdbwd_mb": 100.0, "fwdbwd_s": 0.1}
    assert bench._too_big(None, 10**9, 4.0, 20.0) is None
    assert bench._too_big(previous, 1600, 4.0, 20.0) is None  # 1.6 GB, 1.6 s
    assert "max-gb" in bench._too_big(previous, 6400, 4.0, 20.0)  # 6.25 GB
    assert "max-seconds" in bench._too_big(previous, 6400, 8.0, 5.0)  # 6.4 s

"""torch.compile of the layer on CPU: fullgraph, dynamic numbers of nodes and edges, same values and gradients.

One compilation (about a minute without inductor's cache) serves the check and the smoke test of
``benchmarks/compile.py``: the benchmark compares the compiled layer with the eager one in float64.
"""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _benchmark(name):
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_compiled_layer_equals_eager_for_dynamic_edge_counts(tmp_path):
    args = ["--quick", "--dtype", "float64", "--threads", "1", "--out", str(tmp_path / "c.json")]
    report = _benchmark("compile").main(args)
    first, second = report["results"]
    assert second["edges"] != first["edges"]
    assert second["recompiles"] == 0, "a new number of edges recompiled the layer"
    for row in (first, second):
        assert row["max_abs_diff"] < 1e-12
        assert row["max_grad_rel_diff"] < 1e-12
        assert row["compiled_fwdbwd_ms"] > 0 and row["eager_fwdbwd_ms"] > 0
    assert (tmp_path / "c.json").exists()

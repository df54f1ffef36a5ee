"""Smoke test of benchmarks/train_step.py: both settings measured, the same model, and the switch restored."""
import json

import pytest

pytest.importorskip("ase")

from script_loader import load_script  # noqa: E402


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/train_step.py")


def test_quick_run_writes_the_table_and_json(bench, tmp_path, capsys):
    out = tmp_path / "r.json"
    report = bench.main(["--quick", "--molecule", "H2O", "--batch-size", "2", "--out", str(out), "--",
                         "--layers", "1", "--max-radius", "3"])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["meta"]["atoms"] == 6 and report["meta"]["edges"] == 12  # two waters, every pair within 3 A
    assert report["meta"]["model"]["layers"] == 1
    for setting in bench.SETTINGS:
        assert report["median_seconds"][setting]["step"] > 0 and report["median_seconds"][setting]["call"] > 0
    assert "| shared |" in capsys.readouterr().out


def test_the_per_layer_setting_is_the_model_without_sharing(bench):
    import e3attn.models.transformer as transformer

    shared = transformer.shared_edge_geometry
    with bench.geometry("per-layer"):
        assert transformer.shared_edge_geometry("edge_vec", [1, 2, 3]) == [None] * 3
    assert transformer.shared_edge_geometry is shared
    with bench.geometry("shared"):
        assert transformer.shared_edge_geometry is shared

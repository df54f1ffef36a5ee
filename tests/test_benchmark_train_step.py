"""Smoke test of benchmarks/train_step.py: both settings of every baseline measured, the same model, and the
switches restored."""
import json

import pytest

pytest.importorskip("ase")

from script_loader import load_script  # noqa: E402


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/train_step.py")


@pytest.mark.parametrize("baseline", ["geometry", "moments", "adam", "checks"])
def test_quick_run_writes_the_table_and_json(bench, tmp_path, capsys, baseline):
    out = tmp_path / "r.json"
    report = bench.main(["--quick", "--molecule", "H2O", "--batch-size", "2", "--out", str(out), "--baseline",
                         baseline, "--", "--layers", "1", "--max-radius", "3"])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["meta"]["atoms"] == 6 and report["meta"]["edges"] == 12  # two waters, every pair within 3 A
    assert report["meta"]["model"]["layers"] == 1 and report["meta"]["baseline"] == baseline
    out = capsys.readouterr().out
    for setting in bench.BASELINES[baseline]:
        assert report["median_seconds"][setting]["step"] > 0 and report["median_seconds"][setting]["call"] > 0
        assert f"| {setting} |" in out
    assert set(report["median_seconds"]) == set(bench.BASELINES[baseline])


def test_the_settings_are_the_model_without_the_part_and_are_restored(bench):
    import e3attn.models.transformer as transformer
    from e3attn.models.density import NeighbourDensity

    shared, moments = transformer.shared_edge_geometry, NeighbourDensity._moments
    with bench.setting("per-layer"):
        assert transformer.shared_edge_geometry("edge_vec", [1, 2, 3]) == [None] * 3
        assert NeighbourDensity._moments is moments
    with bench.setting("plain moments"):
        assert NeighbourDensity._moments is NeighbourDensity._plain_moments
        assert transformer.shared_edge_geometry is shared
    assert transformer.shared_edge_geometry is shared and NeighbourDensity._moments is moments
    from e3attn.kernels import segment_ops

    trusted = segment_ops._TRUSTED
    with bench.setting("checked in backward"):
        segment_ops._TRUSTED.set(True)
        assert not segment_ops._TRUSTED.get()  # the backward formulas' flag stays off: they check every call
    assert segment_ops._TRUSTED is trusted and not trusted.get()
    for name in ("shared", "moments kernel", "fused Adam", "Adam loop", "checked in forward"):
        with bench.setting(name):
            assert transformer.shared_edge_geometry is shared and NeighbourDensity._moments is moments
            assert segment_ops._TRUSTED is trusted

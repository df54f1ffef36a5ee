"""Smoke test of benchmarks/compiled_step.py: the traced step (run as traced, without compiling) against the eager
step, its report."""
import json

import pytest

pytest.importorskip("ase")

from script_loader import load_script  # noqa: E402


@pytest.mark.slow
def test_quick_run_compares_the_traced_step_with_the_eager_step(tmp_path, capsys):
    bench = load_script("benchmarks/compiled_step.py")
    out = tmp_path / "r.json"
    report = bench.main(["--molecule", "H2O", "--batch-size", "2", "--backend", "none", "--dtype", "float64",
                         "--steps", "3", "--repeats", "1", "--unsorted", "--out", str(out), "--", "--layers", "1",
                         "--max-radius", "3"])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["meta"]["atoms"] == 6 and report["meta"]["edges"] == 12 and report["meta"]["backend"] == "none"
    assert report["largest_relative_difference"] < 1e-12  # the eager step's loss and gradients, float64
    assert report["median_seconds"]["eager"] > 0 and report["median_seconds"]["compiled"] > 0
    assert report["meta"]["unsorted"] and report["median_seconds"]["edges sorted in the graph"] > 0
    printed = capsys.readouterr().out
    assert "force-training step: eager" in printed and "compiled, edges sorted in the graph: first call" in printed


@pytest.mark.parametrize("flag", ["--python-wrapper", "--one-unit", "--wrapper-o0", "--inductor-index-add",
                                  "--serial-builds"])
def test_other_inductor_variants_are_timed_only_beside_inductor(capsys, flag):
    bench = load_script("benchmarks/compiled_step.py")
    with pytest.raises(SystemExit) as stop:
        bench.parse_args([flag, "--backend", "none"])
    assert stop.value.code == 2
    assert f"argument {flag}: only with --backend inductor" in capsys.readouterr().err
    assert bench.parse_args([flag]).backend == "inductor"


@pytest.mark.slow
def test_batches_of_a_file_s_structures(tmp_path, capsys):
    from ase.build import molecule
    from ase.io import write

    bench = load_script("benchmarks/compiled_step.py")
    frames = tmp_path / "frames.xyz"
    write(frames, [molecule("H2O"), molecule("NH3")] * 3)
    with pytest.raises(SystemExit) as stop:
        bench.parse_args(["--frames", str(tmp_path / "none.xyz")])
    assert stop.value.code == 2 and "argument --frames: no such file:" in capsys.readouterr().err
    report = bench.main(["--frames", str(frames), "--batch-size", "2", "--backend", "none", "--dtype", "float64",
                         "--steps", "3", "--repeats", "1", "--out", str(tmp_path / "r.json"), "--", "--layers", "1"])
    assert report["meta"]["atoms"] == 7 and report["meta"]["frames"] == str(frames)  # H2O and NH3
    assert report["largest_relative_difference"] < 1e-12
    with pytest.raises(SystemExit, match="has 6 structures, fewer than --batch-size times --steps"):
        bench.main(["--frames", str(frames), "--batch-size", "4", "--backend", "none", "--steps", "2",
                    "--out", str(tmp_path / "r.json")])

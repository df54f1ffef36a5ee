"""Smoke test of benchmarks/md_speed.py and checks of its pieces."""
import json
import sys

import numpy as np
import pytest

pytest.importorskip("ase")

from script_loader import load_script  # noqa: E402


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/md_speed.py")


def test_quick_run_writes_the_table_and_json(bench, tmp_path, capsys):
    out = tmp_path / "r.json"
    # a Python without MACE: the MACE column stays empty and the failure is reported, the rest is measured
    report = bench.main(["--quick", "--device", "cpu", "--sizes", "32", "--out", str(out), "--mace",
                         "--mace-python", sys.executable])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    (row,) = report["results"]
    assert row["atoms"] == 32 and row["mace_s"] is None
    # fcc copper vibrating 0.1 A about its sites: the 12 + 6 neighbours within 4 A, the shell at 4.42 A outside
    assert 18 * 32 - 8 <= row["edges"] <= 18 * 32 + 8
    assert row["skin_s"] > 0 and row["no_skin_s"] > 0
    assert row["searches_per_call"] == pytest.approx(1 / 5)  # one search in 1 + 2 * 2 steps: the skin holds
    if sys.platform.startswith("linux"):  # counted by getrusage (None elsewhere)
        assert row["page_faults_per_call"] >= 0 and row["system_s_per_call"] >= 0
        assert 50 < row["peak_rss_mib"] < 100_000  # torch alone takes more than 50 MiB
    captured = capsys.readouterr()
    assert "| 32 | " in captured.out and "MACE run failed" in captured.err


@pytest.mark.parametrize("option, keep_memory", [("auto", None), ("on", True), ("off", False)])
def test_stress_and_allocator_options_are_passed_and_reported(bench, tmp_path, monkeypatch, option, keep_memory):
    made = []
    calculator = bench.E3AttnCalculator

    def recording(*args, **kwargs):
        made.append((calculator(*args, **kwargs), kwargs))
        return made[-1][0]

    monkeypatch.setattr(bench, "E3AttnCalculator", recording)
    report = bench.main(["--quick", "--device", "cpu", "--sizes", "32", "--out", str(tmp_path / "r.json"), "--stress",
                         "--keep-memory", option])
    assert report["meta"]["stress"] is True and report["meta"]["keep_memory"] == option
    assert made and all(kwargs["keep_memory"] is keep_memory for _, kwargs in made)
    assert all(calc._stress and "stress" in calc.results for calc, _ in made)  # asked at every step


def test_the_compiled_calculator_runs_in_the_same_turns(bench, tmp_path, capsys):
    report = bench.main(["--quick", "--device", "cpu", "--sizes", "32", "--out", str(tmp_path / "r.json"),
                         "--compile", "eager"])  # dynamo without a compiler: the traced graph, quickly
    (row,) = report["results"]
    assert report["meta"]["compile"] == "eager" and row["compiled_s"] > 0 and row["compile_first_call_s"] > 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("| 32 | "))
    assert f"| {row['compiled_s'] * 1e3:,.2f} ({row['compile_first_call_s']:.1f}) |" in line


def test_trajectory_vibrates_about_the_sites(bench):
    sites = bench.fcc_copper(108).positions
    trajectory = bench.Trajectory(sites)
    frames = np.stack([trajectory.frame(t) for t in range(400)])
    assert np.allclose(frames.mean(0), sites, atol=0.06)  # two periods and more: the mean is the site
    assert 0.06 < (frames - sites).std() < 0.08  # N(0, 0.1) amplitudes: the rms of a sine is a / sqrt(2)
    steps = np.linalg.norm(np.diff(frames, axis=0), axis=2)
    assert 0.002 < steps.mean() < 0.006  # a few thousandths of an Angstrom per fs, as copper at 300 K


@pytest.mark.parametrize("argv, message", [(["--sizes", "100"], "4 n^3"), (["--mace"], "--mace-python"),
                                           (["--skin", "-1"], "skin"),
                                           (["--clock", "cpu", "--threads", "2"], "one thread")])
def test_bad_arguments_exit_with_one_line(bench, argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1

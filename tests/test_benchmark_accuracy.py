"""Smoke test of benchmarks/accuracy.py and checks of its NequIP-style peer."""
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from e3attn.models import energy_and_forces
from e3attn.testing import assert_equivariant

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "accuracy.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("accuracy", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_quick_run_trains_both_models_and_writes_json(bench, tmp_path):
    out = tmp_path / "accuracy.json"
    report = bench.main(["--quick", "--time-budget", "60", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert [r["model"] for r in report["results"]] == ["e3attn", "nequip"]
    for row in report["results"]:
        assert row["epochs"] == 2 and row["parameters"] > 0
        assert math.isfinite(row["energy_mae_meV_per_atom"]) and row["energy_mae_meV_per_atom"] > 0
        assert math.isfinite(row["force_mae_meV_per_A"]) and row["force_mae_meV_per_A"] > 0
    assert report["meta"]["num_train"] == 8 and report["meta"]["num_test"] == 4


@pytest.mark.slow
def test_quick_organic_run_trains_with_the_command_and_the_peer_on_the_same_split(bench, tmp_path, monkeypatch):
    from ase.io import write

    monkeypatch.syspath_prepend(str(SCRIPT.parents[1] / "tests"))
    from test_train import frames  # EMT clusters with REF_energy / REF_forces, the keys of organic_data.py

    write(tmp_path / "tiny_train.xyz", frames(12, 0, ref_keys=True))
    write(tmp_path / "tiny_test.xyz", frames(4, 1, ref_keys=True))
    out = tmp_path / "organic.json"
    report = bench.main(["--organic", "tiny", "--data", str(tmp_path), "--quick", "--time-budget", "60",
                         "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert [(r["molecule"], r["model"]) for r in report["results"]] == [("tiny", "e3attn"), ("tiny", "nequip")]
    for row in report["results"]:
        assert row["epochs"] == 2 and row["num_train"] == 9 and row["num_test"] == 4 and row["parameters"] > 0
        assert math.isfinite(row["force_mae_meV_per_A"]) and row["force_mae_meV_per_A"] > 0


@pytest.mark.slow
def test_quick_organic_run_of_the_command_as_two_ddp_processes(bench, tmp_path, monkeypatch):
    """``--processes 2``: the training command as two DDP processes under torchrun, one thread each."""
    from ase.io import write

    monkeypatch.syspath_prepend(str(SCRIPT.parents[1] / "tests"))
    from test_train import frames

    write(tmp_path / "tiny_train.xyz", frames(12, 0, ref_keys=True))
    write(tmp_path / "tiny_test.xyz", frames(4, 1, ref_keys=True))
    report = bench.main(["--organic", "tiny", "--data", str(tmp_path), "--quick", "--time-budget", "60",
                         "--models", "e3attn", "--threads", "2", "--processes", "2", "--out", str(tmp_path / "o.json")])
    (row,) = report["results"]
    assert row["processes"] == 2 and report["meta"]["e3attn_processes"] == 2
    assert row["epochs"] == 2 and row["num_train"] == 9 and row["num_test"] == 4
    assert math.isfinite(row["force_mae_meV_per_A"]) and row["force_mae_meV_per_A"] > 0


def test_a_training_command_past_its_time_is_stopped_and_reported(bench, tmp_path):
    """A run of the command that does not end in time (a hang) stops the benchmark with one message, its process
    gone, instead of hanging it."""
    with pytest.raises(SystemExit, match=r"e3attn-train did not end within 0 s \(before writing its metrics\); stopped"):
        bench.run_command(["--train-file", str(tmp_path / "none.xyz")], threads=1, seconds=0.2)
    assert bench.command_seconds(bench.parse_args(["--data", str(tmp_path), "--time-budget", "600"])) == 1800.0
    assert bench.command_seconds(bench.parse_args(["--data", str(tmp_path), "--time-budget", "0"])) is None


@pytest.mark.parametrize("argv, message", [
    (["--organic", "tiny", "--threads", "3", "--processes", "2"], "--processes: must divide --threads (3), got 2"),
    (["--threads", "2", "--processes", "2"], "--processes: only with --organic"),
])
def test_bad_processes_get_one_line_and_status_2(bench, tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(argv + ["--data", str(tmp_path)])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def peer(bench):
    torch.manual_seed(0)
    return bench.NequIPStyle(3, "4x0e + 2x0o + 2x1o + 2x1e", 1.6, num_layers=2, lmax=2).double()


def test_peer_energy_invariant_and_forces_equivariant(bench):
    model = peer(bench)
    gen = torch.Generator().manual_seed(1)
    pos = 1.6 * torch.rand(8, 3, generator=gen, dtype=torch.float64)
    attr = torch.nn.functional.one_hot(torch.arange(8) % 3, 3).double()
    edge_index = torch.tensor([[i, j] for i in range(8) for j in range(8) if i != j and (pos[i] - pos[j]).norm() < 1.6]).T
    energy, _ = energy_and_forces(model, pos, node_attr=attr, edge_index=edge_index)
    assert energy.abs().item() > 1e-3
    err = assert_equivariant(
        lambda pos: model(pos, node_attr=attr, edge_index=edge_index)[:, None], [pos], ["cartesian_points"], ["0e"],
        ntrials=2,
    )
    assert err <= 1e-10
    err = assert_equivariant(
        lambda pos: energy_and_forces(model, pos, node_attr=attr, edge_index=edge_index)[1],
        [pos], ["cartesian_points"], ["1o"], ntrials=2,
    )
    assert err <= 1e-10


def test_peer_fades_a_neighbour_out_smoothly(bench):
    model = peer(bench)
    attr = torch.eye(3, dtype=torch.float64)[:2]
    direction = torch.tensor([0.48, -0.36, 0.8], dtype=torch.float64)

    def dimer(d):
        pos = torch.stack([torch.zeros(3, dtype=torch.float64), d * direction])
        edge_index = torch.tensor([[0, 1], [1, 0]]) if d < 1.6 else torch.zeros(2, 0, dtype=torch.long)
        return energy_and_forces(model, pos, node_attr=attr, edge_index=edge_index)

    alone, _ = dimer(5.0)
    assert abs(dimer(1.0)[0].item() - alone.item()) > 1e-4
    for d in (1.6 - 1e-5, 1.6 - 1e-6):  # the polynomial cutoff vanishes as (1 - r / r_c)^3
        energy, forces = dimer(d)
        assert abs(energy.item() - alone.item()) < 1e-10 and forces.abs().max() < 1e-9

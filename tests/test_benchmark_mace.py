"""benchmarks/mace_peer.py against a stand-in for MACE's two commands: the budget, the files, the errors."""
import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("ase")
from ase.io import write  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SECONDS_PER_EPOCH = 0.4

# mace_run_train: a log whose two time stamps are SECONDS_PER_EPOCH per epoch apart, and a model with 7 weights
RUN_TRAIN = f"""
import argparse, pathlib, torch
p = argparse.ArgumentParser()
for key in ("--name", "--max_num_epochs", "--train_file", "--test_file", "--num_channels", "--max_L"):
    p.add_argument(key)
args = p.parse_known_args()[0]
assert pathlib.Path(args.train_file).is_file() and pathlib.Path(args.test_file).is_file(), "no such file"
pathlib.Path("logs").mkdir(exist_ok=True)
end = 12.0 + {SECONDS_PER_EPOCH} * int(args.max_num_epochs)
pathlib.Path("logs", args.name + "_run-0.log").write_text(
    "2026-01-01 10:00:00.000 INFO: MACE version: stand-in\\n"
    "2026-01-01 10:00:12.000 INFO: Started training, reporting errors on validation set\\n"
    f"2026-01-01 10:00:{{int(end):02d}}.{{round(1000 * (end % 1)):03d}} INFO: Training complete\\n")
pathlib.Path("epochs.txt").write_text(args.max_num_epochs + " " + args.num_channels + " " + args.max_L)
torch.save(torch.nn.Linear(3, 2, bias=False).requires_grad_(), args.name + "_stagetwo.model")
import time; time.sleep(8)  # MACE's evaluation of every split, after its training
pathlib.Path("evaluated.txt").write_text("the run went on after 'Training complete'")
"""

# mace_eval_configs: predictions off by 10 meV/atom in the energy and by 2 meV/A in every force component
EVAL_CONFIGS = """
import argparse
from ase.io import read, write
p = argparse.ArgumentParser()
for key in ("--configs", "--model", "--output", "--default_dtype", "--device"):
    p.add_argument(key)
args = p.parse_args()
frames = read(args.configs, index=":")
for atoms in frames:
    atoms.info["MACE_energy"] = atoms.info["REF_energy"] - 0.010 * len(atoms)
    atoms.arrays["MACE_forces"] = atoms.arrays["REF_forces"] + 0.002
write(args.output, frames)
"""


@pytest.fixture(scope="module")
def mace_peer():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("mace_peer", ROOT / "benchmarks" / "mace_peer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    sys.path.remove(str(ROOT / "benchmarks"))


@pytest.fixture()
def fake_mace(tmp_path):
    """A folder with a Python and the two commands, as a MACE environment has."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python").chmod(0o755)
    for name, code in (("mace_run_train", RUN_TRAIN), ("mace_eval_configs", EVAL_CONFIGS)):
        script = bin_dir / name
        script.write_text(f"#!{sys.executable}\n" + textwrap.dedent(code))
        script.chmod(0o755)
    sys.path.insert(0, str(ROOT / "tests"))
    from test_train import frames

    sys.path.remove(str(ROOT / "tests"))
    data = tmp_path / "data"
    data.mkdir()
    write(data / "mol_train.xyz", frames(4, 0, ref_keys=True))
    write(data / "mol_test.xyz", frames(3, 1, ref_keys=True))
    return bin_dir / "python", data


def test_budget_sets_the_epochs_and_the_errors_are_those_of_the_predictions(mace_peer, fake_mace, tmp_path):
    python, data = fake_mace
    row = mace_peer.run_mace(python, "mol", data, "24x2", budget=10.0, threads=1, max_radius=5.0,
                             workdir=tmp_path / "work")
    assert row["calibration_seconds_per_epoch"] == pytest.approx(SECONDS_PER_EPOCH)
    assert row["epochs"] == 25  # 10 s / 0.4 s
    assert row["train_seconds"] == pytest.approx(SECONDS_PER_EPOCH * 25)
    assert (tmp_path / "work" / "mol-24x2" / "epochs.txt").read_text() == "25 24 2"
    assert (tmp_path / "work" / "mol-24x2-calibration" / "epochs.txt").read_text() == "2 24 2"
    assert not (tmp_path / "work" / "mol-24x2-calibration" / "evaluated.txt").exists()  # stopped after training
    assert (tmp_path / "work" / "mol-24x2" / "evaluated.txt").exists()
    assert row["energy_mae_meV_per_atom"] == pytest.approx(10.0, rel=1e-9)
    assert row["force_mae_meV_per_A"] == pytest.approx(2.0, rel=1e-9)
    assert row["num_test"] == 3 and row["parameters"] == 6 and row["model"] == "mace-24x2"
    assert "--swa" in row["commands"][0] and "--r_max 5" in row["commands"][0]
    assert row["commands"][1].endswith("--default_dtype float32 --device cpu")


def test_given_epochs_skip_the_calibration(mace_peer, fake_mace, tmp_path, monkeypatch):
    python, data = fake_mace
    monkeypatch.chdir(tmp_path)  # a data folder relative to here, where MACE does not run
    row = mace_peer.run_mace(python, "mol", data.relative_to(tmp_path), "8x0", budget=10.0, threads=1,
                             max_radius=4.0, workdir=tmp_path / "work", epochs=3)
    assert row["epochs"] == 3 and "calibration_seconds_per_epoch" not in row
    assert not (tmp_path / "work" / "mol-8x0-calibration").exists()


def test_a_bad_setting_and_a_log_without_time_stamps_are_errors(mace_peer):
    assert mace_peer.parse_setting("128x3") == {"channels": 128, "max_L": 3}
    for bad in ("32", "32x", "x1", "32 x 1", "-1x1"):
        with pytest.raises(ValueError, match="CHANNELSxMAX_L"):
            mace_peer.parse_setting(bad)
    with pytest.raises(RuntimeError, match="Started training"):
        mace_peer.training_seconds("2026-01-01 10:00:00.000 INFO: Started training\n")

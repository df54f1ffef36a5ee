r"""MACE as a peer of ``benchmarks/accuracy.py --organic``: trained and evaluated with its own documented commands,
in its own environment (mace-torch pins e3nn 0.4.4, e3attn needs 0.6), within a wall-clock training budget.

For every setting (``CHANNELSxL``, e.g. ``32x1``: ``--num_channels 32 --max_L 1``), in a folder of its own:

1. *calibration* (unless ``--mace-epochs`` is given): ``mace_run_train ... --max_num_epochs 2``, stopped at its
   log line ``Training complete`` (before its evaluation of every split); the seconds per epoch are those between
   its log lines ``Started training`` and ``Training complete`` over the epochs;
2. *training*: ``mace_run_train`` with :func:`train_command`'s options and ``--max_num_epochs`` the number of epochs
   that fit in the budget (``--swa``: MACE's stage two, lower learning rate and higher energy weight, from 3/4 of
   the epochs on, its default);
3. *evaluation*: ``mace_eval_configs --configs <test file> --model <stage-two model, else the model>``; the errors
   are computed here from its predictions (``MACE_energy``, ``MACE_forces``) and the labels of the test file.

The training seconds reported are those between the two log lines of step 2 (start-up and the final evaluation
excluded, as for e3attn's ``train_seconds``).
"""
from __future__ import annotations

import datetime
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) \w+: (Started training|Training complete)")
SETTING = re.compile(r"^(\d+)x(\d+)$")


def parse_setting(text: str) -> Dict[str, int]:
    """``"32x1"`` to ``{"channels": 32, "max_L": 1}``; a ValueError names the expected form.

    Example::

        >>> parse_setting("64x0")
        {'channels': 64, 'max_L': 0}
    """
    match = SETTING.match(text)
    if not match:
        raise ValueError(f"a MACE setting is CHANNELSxMAX_L such as 32x1, got {text!r}")
    return {"channels": int(match.group(1)), "max_L": int(match.group(2))}


def train_command(bin_dir: Path, name: str, train_file: Path, test_file: Path, setting: str, epochs: int,
                  max_radius: float, seed: int = 0) -> List[str]:
    """The ``mace_run_train`` command of one setting: MACE's defaults (2 interactions, correlation 3, 8 Bessel
    functions, Adam with AMSGrad, lr 0.01, EMA off) but those given here; float32 on the CPU, 5% validation."""
    s = parse_setting(setting)
    return [str(bin_dir / "mace_run_train"), "--name", name, "--model", "MACE", "--train_file", str(train_file),
            "--valid_fraction", "0.05", "--test_file", str(test_file), "--energy_key", "REF_energy",
            "--forces_key", "REF_forces", "--E0s", "average", "--num_channels", str(s["channels"]),
            "--max_L", str(s["max_L"]), "--correlation", "3", "--r_max", f"{max_radius:g}", "--batch_size", "5",
            "--max_num_epochs", str(epochs), "--swa", "--default_dtype", "float32", "--device", "cpu",
            "--seed", str(seed), "--error_table", "PerAtomMAE"]


def training_seconds(log_text: str) -> float:
    """Seconds between MACE's log lines ``Started training`` and ``Training complete``."""
    stamps = {}
    for line in log_text.splitlines():
        match = STAMP.match(line)
        if match:
            stamps[match.group(2)] = datetime.datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S.%f")
    if len(stamps) != 2:
        raise RuntimeError("MACE's log has no 'Started training' and 'Training complete' lines")
    return (stamps["Training complete"] - stamps["Started training"]).total_seconds()


def _log(folder: Path) -> str:
    logs = sorted((folder / "logs").glob("*_run-*[0-9].log")) if (folder / "logs").is_dir() else []
    return logs[-1].read_text() if logs else ""


def _run(command: List[str], folder: Path, threads: int, until: Optional[str] = None) -> str:
    """Run ``command`` in ``folder``; returns MACE's log. With ``until``, the process is stopped as soon as its
    log has that text (the calibration needs no final evaluation)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    env.pop("PYTHONPATH", None)  # MACE's environment only
    with open(folder / "stderr.txt", "w") as stderr:
        process = subprocess.Popen(command, cwd=folder, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
        while process.poll() is None:
            if until is not None and until in _log(folder):
                process.terminate()
                process.wait()
                return _log(folder)
            time.sleep(1.0)
    if process.returncode != 0:
        error = (folder / "stderr.txt").read_text().strip()[-2000:]
        raise SystemExit(f"{Path(command[0]).name} failed ({process.returncode}): {error}")
    return _log(folder)


def test_errors(prediction_file: Path) -> Dict[str, float]:
    """Energy MAE (meV/atom) and force MAE (meV/Å) of ``mace_eval_configs``'s output against its ``REF_`` labels."""
    from ase.io import read

    energy, forces = [], []
    for atoms in read(prediction_file, index=":"):
        energy.append((atoms.info["MACE_energy"] - atoms.info["REF_energy"]) / len(atoms))
        forces.append((atoms.arrays["MACE_forces"] - atoms.arrays["REF_forces"]).ravel())
    return {"energy_mae_meV_per_atom": 1000 * float(np.abs(energy).mean()),
            "force_mae_meV_per_A": 1000 * float(np.abs(np.concatenate(forces)).mean()), "num_structures": len(energy)}


def run_mace(python: Path, name: str, data: Path, setting: str, budget: float, threads: int, max_radius: float,
             workdir: Path, epochs: Optional[int] = None) -> dict:
    """Train MACE ``setting`` on ``<data>/<name>_train.xyz`` within ``budget`` seconds (or ``epochs``), evaluate it
    on ``_test.xyz``; returns the row of the accuracy table, with the commands that were run."""
    bin_dir = Path(python).parent
    data = Path(data).resolve()  # MACE runs in folders of its own
    train_file, test_file = data / f"{name}_train.xyz", data / f"{name}_test.xyz"
    row: dict = {"molecule": name, "model": f"mace-{setting}", "commands": []}
    if epochs is None:
        folder = workdir / f"{name}-{setting}-calibration"
        folder.mkdir(parents=True, exist_ok=True)
        command = train_command(bin_dir, "calibration", train_file, test_file, setting, 2, max_radius)
        per_epoch = training_seconds(_run(command, folder, threads, until="Training complete")) / 2
        epochs = max(1, int(budget / per_epoch))
        row["calibration_seconds_per_epoch"] = per_epoch
    folder = workdir / f"{name}-{setting}"
    folder.mkdir(parents=True, exist_ok=True)
    command = train_command(bin_dir, "mace", train_file, test_file, setting, epochs, max_radius)
    row["train_seconds"] = training_seconds(_run(command, folder, threads))
    model = folder / "mace_stagetwo.model"
    model = model if model.exists() else folder / "mace.model"
    evaluate = [str(bin_dir / "mace_eval_configs"), "--configs", str(test_file), "--model", str(model),
                "--output", str(folder / "test_prediction.xyz"), "--default_dtype", "float32", "--device", "cpu"]
    _run(evaluate, folder, threads)
    test = test_errors(folder / "test_prediction.xyz")
    count = [str(python), "-c", "import sys, torch; model = torch.load(sys.argv[1], weights_only=False, "
             "map_location='cpu'); print(sum(p.numel() for p in model.parameters()))", str(model)]
    params = int(subprocess.run(count, capture_output=True, text=True, check=True).stdout.split()[-1])
    row.update(epochs=epochs, parameters=params, num_train=None, num_test=test["num_structures"],
               energy_mae_meV_per_atom=test["energy_mae_meV_per_atom"], force_mae_meV_per_A=test["force_mae_meV_per_A"],
               commands=[" ".join(command), " ".join(evaluate)])
    return row

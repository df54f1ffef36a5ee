"""The training command against a careful user's inputs: outputs that would overwrite inputs, labels that cannot
be trained on, runs that diverge, model options that build no model; each stops with one line and exit status 2,
and nothing the user saved is replaced."""
import json

import numpy as np
import pytest
import torch

pytest.importorskip("ase")
from ase import Atoms  # noqa: E402
from ase.io import write  # noqa: E402

from e3attn._files import atomic_write  # noqa: E402
from e3attn.train import build_model, cli  # noqa: E402
from test_train import TINY, frames  # noqa: E402

KEYS = ["--energy-key", "REF_energy", "--forces-key", "REF_forces"]


@pytest.fixture(scope="module")
def train_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("inputs") / "train.xyz"
    write(path, frames(12, 0, ref_keys=True))
    return path


def stops(argv, capsys, fragment):
    """Run the command; it must stop with one line naming ``fragment`` and exit status 2."""
    with pytest.raises(SystemExit) as stop:
        cli.main([str(a) for a in argv] + TINY)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("e3attn-train: error: ") and fragment in err and "Traceback" not in err, err
    return err


def written(path, structures):
    write(path, structures)
    return path


def test_an_output_that_is_an_input_or_the_other_output_is_refused(train_file, tmp_path, capsys):
    before = train_file.read_bytes()
    stops(["--train-file", train_file, "--metrics", train_file] + KEYS, capsys,
          "argument --metrics: '%s' is the file of --train-file: it would be overwritten" % train_file)
    same = tmp_path / "same.pt"
    stops(["--train-file", train_file, "--save", same, "--metrics", same] + KEYS, capsys,
          "argument --metrics: '%s' is the file of --save" % same)
    assert train_file.read_bytes() == before and not same.exists()


def test_a_failed_metrics_write_replaces_neither_file(train_file, tmp_path, monkeypatch, capsys):
    checkpoint, metrics = tmp_path / "keep.pt", tmp_path / "metrics.json"
    checkpoint.write_bytes(b"the user's earlier model")
    metrics.write_text("the user's earlier metrics")

    def broken(*args, **kwargs):  # json.dump on a full disk
        raise OSError(28, "No space left on device", str(metrics))

    monkeypatch.setattr(json, "dump", broken)
    stops(["--train-file", train_file, "--save", checkpoint, "--metrics", metrics] + KEYS, capsys,
          f"cannot write --save '{checkpoint}' and --metrics '{metrics}': No space left on device; neither file was "
          "replaced")
    assert checkpoint.read_bytes() == b"the user's earlier model"
    assert metrics.read_text() == "the user's earlier metrics"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.pt", "metrics.json"]  # no temporary left


@pytest.mark.parametrize("failing", ["keep.pt", "metrics.json"])
def test_a_full_disk_at_either_file_s_last_flush_replaces_neither_file(train_file, tmp_path, monkeypatch, capsys,
                                                                        failing):
    """Both files flushed to disk before either is renamed: whichever flush fails, neither target changes."""
    import os

    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc/self/fd to tell the files apart")
    checkpoint, metrics = tmp_path / "keep.pt", tmp_path / "metrics.json"
    checkpoint.write_bytes(b"the user's earlier model")
    metrics.write_text("the user's earlier metrics")
    fsync = os.fsync

    def full(descriptor):
        if os.path.basename(os.readlink(f"/proc/self/fd/{descriptor}")).startswith(f".{failing}."):
            raise OSError(28, "No space left on device")
        return fsync(descriptor)

    monkeypatch.setattr(os, "fsync", full)
    stops(["--train-file", train_file, "--save", checkpoint, "--metrics", metrics] + KEYS, capsys,
          "No space left on device; neither file was replaced")
    assert checkpoint.read_bytes() == b"the user's earlier model"
    assert metrics.read_text() == "the user's earlier metrics"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.pt", "metrics.json"]


@pytest.mark.parametrize("name", ["x" * 250 + ".json", "\u6a21" * 84])  # 255 and 252 bytes
def test_a_name_of_255_bytes_is_written(tmp_path, name):
    """The temporary file beside it (a dot, a cut of the name's bytes, a random tag) fits in the same folder."""
    path = tmp_path / name
    for text in ("{}", "[]"):  # new, then replaced
        with atomic_write(path, "w") as file:
            file.write(text)
        assert path.read_text() == text
    assert [p.name for p in tmp_path.iterdir()] == [name]


def test_a_diverged_run_writes_nothing(train_file, tmp_path, capsys):
    checkpoint = tmp_path / "good.pt"
    checkpoint.write_bytes(b"a good model")
    stops(["--train-file", train_file, "--save", checkpoint, "--lr", "1e8"] + KEYS, capsys,
          "training diverged: no finite validation loss in 2 epochs")
    assert checkpoint.read_bytes() == b"a good model"


def test_metrics_are_valid_json_without_nan():
    assert cli._finite({"a": [1.0, float("nan")], "b": {"c": float("inf"), "d": 2}}) == {"a": [1.0, None],
                                                                                      "b": {"c": None, "d": 2}}


def labelled(energy, forces, numbers=(29, 28, 29)):
    atoms = Atoms(numbers=list(numbers), positions=np.arange(3.0 * len(numbers)).reshape(-1, 3) * 0.8)
    atoms.info["REF_energy"] = energy
    atoms.arrays["REF_forces"] = np.asarray(forces, dtype=float)
    return atoms


@pytest.mark.parametrize("bad, fragment", [
    (labelled(-1.0, [[0.1, np.nan, 0], [0, 0, 0], [0, 0, 0]]), "the forces 'REF_forces' holds NaN or infinite values"),
    (labelled(np.nan, np.zeros((3, 3)) + 0.1), "the energy 'REF_energy' holds NaN or infinite values"),
    (labelled("abc", np.zeros((3, 3)) + 0.1), "the energy 'REF_energy' is 'abc', not one number"),
    (labelled(np.array([1.0, 2.0]), np.zeros((3, 3)) + 0.1), "not one number"),
])
def test_labels_that_are_no_numbers_are_named(train_file, tmp_path, capsys, bad, fragment):
    from ase.io import read

    path = written(tmp_path / "bad.xyz", read(train_file, index=":5") + [bad])
    err = stops(["--train-file", path, "--valid-fraction", "0"] + KEYS, capsys, fragment)
    assert "structure 5 (from 0)" in err


def test_a_structure_without_atoms_is_named(train_file, tmp_path, capsys):
    from ase.io import read

    empty = Atoms()
    empty.info["REF_energy"] = 0.0
    path = written(tmp_path / "empty.xyz", read(train_file, index=":4") + [empty])
    stops(["--train-file", path] + KEYS, capsys, "structure 4 (from 0) of '%s' has no atoms" % path)


def test_a_zero_energy_scale_is_refused(tmp_path, capsys):
    relaxed = written(tmp_path / "relaxed.xyz", [labelled(-1.0 - i, np.zeros((3, 3))) for i in range(4)])
    stops(["--train-file", relaxed, "--valid-fraction", "0"] + KEYS, capsys,
          "--energy-scale force_rms: the scale is 0: the training forces are all zero; try --energy-scale energy_std")
    one = written(tmp_path / "one.xyz", [labelled(-1.0, np.ones((3, 3)))])
    stops(["--train-file", one, "--valid-fraction", "0", "--energy-scale", "energy_std"] + KEYS, capsys,
          "--energy-scale energy_std: the scale is 0")


def test_an_element_held_out_for_validation_only_is_refused(train_file, tmp_path, capsys):
    """With --seed 0 and a tenth of 12 structures held out, structure 7 is the one validation structure."""
    from ase.io import read

    structures = read(train_file, index=":")
    from e3attn.train.data import split
    held = split(list(range(12)), 0.1, 0)[1]
    structures[held[0]].numbers[0] = 79  # gold, in no training structure
    path = written(tmp_path / "gold.xyz", structures)
    stops(["--train-file", path, "--valid-fraction", "0.1", "--seed", "0"] + KEYS, capsys,
          "the elements ['Au'] are only in structures held out for validation")


@pytest.mark.parametrize("options, fragment", [
    (["--hidden", "8x0e + 4x1o", "--heads", "3"], "cannot be split into 3 heads"),
    (["--hidden", "4x1o"], "even scalars (0e)"),
    (["--density", "0", "--density-lmax", "2"], "density_lmax=2 needs density_channels > 0"),
    (["--lmax", "13"], "lmax must be at most 12"),
    (["--lmax", "100000000"], "lmax must be at most 12"),  # refused before anything is sized by it
    (["--density-lmax", "13"], "density_lmax must be at most 12"),
    (["--density-lmax", "100000000"], "density_lmax must be at most 12"),
    (["--density-lmax", "0", "--density-angular", "5"], "density_angular_channels=5 needs density_lmax > 0"),
    (["--density-lmax", "2", "--density", "0"], "density_lmax=2 needs density_channels > 0"),  # either order
    (["--density", "4", "--density-lmax", "1", "--density-angular", "5"],
     "density_angular_channels must be at most density_channels (4)"),
])
def test_model_options_that_build_no_model_are_one_line(train_file, capsys, options, fragment):
    with pytest.raises(SystemExit) as stop:
        cli.parse_args(["--train-file", str(train_file)] + options)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "the model options (--hidden, --heads, --lmax, --density, ...) do not build a model" in err and fragment in err


def test_no_density_channels_turn_the_default_angular_moments_off(train_file, tmp_path):
    """The command's default angular moments (--density-lmax 3) belong to the density channels: --density 0
    leaves neither (given on the command line or in the config), where an explicit --density-lmax is refused."""
    args = cli.parse_args(["--train-file", str(train_file), "--density", "0"])
    assert args.density == 0 and args.density_lmax == 0
    args.avg_num_neighbors = 1.0  # "auto": the training set's, by now
    model = build_model(args, num_species=2)
    assert model.config["density_channels"] == 0 and model.config["density_lmax"] == 0
    config = tmp_path / "train.yaml"
    config.write_text(f"train_file: {train_file}\ndensity: 0\n")
    assert cli.parse_args(["--config", str(config)]).density_lmax == 0
    # channels again (the command line wins over the config): the default moments again, as plain numbers
    for args in (cli.parse_args(["--config", str(config), "--density", "32"]),
                 cli.parse_args(["--train-file", str(train_file), "--density", "0", "--density", "32"])):
        assert (args.density, args.density_lmax) == (32, 3) and type(args.density_lmax) is int


def test_the_command_line_choice_of_validation_wins_over_the_config(train_file, tmp_path):
    config = tmp_path / "train.yaml"
    config.write_text(f"train_file: {train_file}\nvalid_fraction: 0.1\n")
    args = cli.parse_args(["--config", str(config), "--valid-file", str(train_file)])
    assert args.valid_file == str(train_file) and args.valid_fraction is None
    config.write_text(f"train_file: {train_file}\nvalid_file: {train_file}\n")
    args = cli.parse_args(["--config", str(config), "--valid-fraction", "0.2"])
    assert args.valid_file is None and args.valid_fraction == 0.2


def test_abbreviated_options_are_refused(train_file, tmp_path, capsys):
    """The config's options are merged by their full names: an abbreviation would slip past that."""
    for option in ("--valid-fi", "--stress-k"):
        with pytest.raises(SystemExit) as stop:
            cli.parse_args(["--train-file", str(train_file), option, "x"])
        assert stop.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


def test_a_stress_label_without_a_volume_is_named(tmp_path, capsys):
    atoms = labelled(-1.0, np.ones((3, 3)))
    atoms.set_cell([[4.0, 0, 0], [0, 4.0, 0], [4.0, 4.0, 0]])
    atoms.info["REF_stress"] = np.zeros(6)
    path = written(tmp_path / "flat.xyz", [atoms] * 3)
    stops(["--train-file", path, "--stress-key", "REF_stress", "--valid-fraction", "0"] + KEYS, capsys,
          "has a stress but no cell of three linearly independent lattice vectors (no volume)")


def test_a_stress_key_given_but_found_nowhere_is_refused(train_file, capsys):
    stops(["--train-file", train_file, "--stress-key", "REF_strss"] + KEYS, capsys,
          "no structure has a stress under the key 'REF_strss' (--stress-key)")


def test_the_default_dtype_is_restored_after_a_refusal(train_file, capsys):
    stops(["--train-file", train_file, "--stress-key", "REF_strss", "--dtype", "float64"] + KEYS, capsys, "REF_strss")
    assert torch.get_default_dtype() == torch.float32


def test_density_lmax_reaches_the_model(train_file):
    args = cli.parse_args(["--train-file", str(train_file), "--density-lmax", "2", "--density-angular", "3"])
    args.avg_num_neighbors = 4.0
    config = build_model(args, num_species=2).config
    assert (config["density_lmax"], config["density_angular_channels"], config["density_channels"]) == (2, 3, 32)
    args = cli.parse_args(["--train-file", str(train_file)])
    args.avg_num_neighbors = 4.0
    config = build_model(args, num_species=2).config
    assert config["density_lmax"] == 3 and config["density_angular_channels"] == 16  # the command's defaults

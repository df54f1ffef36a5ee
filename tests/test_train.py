"""The training command e3attn.train on tiny EMT-labelled data: end to end, references, bad input, config, stress."""
import configparser
import json
import pathlib
import re

import numpy as np
import pytest
import torch

pytest.importorskip("ase")
from ase.build import bulk  # noqa: E402
from ase.calculators.emt import EMT  # noqa: E402
from ase.calculators.singlepoint import SinglePointCalculator  # noqa: E402
from ase.cluster import Icosahedron  # noqa: E402
from ase.io import read, write  # noqa: E402

from e3attn.calculator import E3AttnCalculator  # noqa: E402
from e3attn.train import cli, fit, fit_references, to_sample  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = ["--hidden", "8x0e + 4x1o", "--heads", "2", "--density", "4", "--radial-neurons", "8", "--epochs", "2",
        "--batch-size", "4", "--device", "cpu", "--quiet", "--time-budget", "0"]
LINE = r"(valid|test): energy MAE \d+\.\d\d meV/atom, force MAE \d+\.\d\d meV/A(, stress MAE \d+\.\d\d meV/A\^3)?"


def frames(num, seed, periodic=False, elements=("Cu", "Ni"), ref_keys=False):
    """EMT-labelled rattled Cu/Ni icosahedra (or 4-atom fcc cells with stress)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num):
        atoms = bulk("Cu", "fcc", a=3.6, cubic=True) if periodic else Icosahedron("Cu", 2)
        atoms.set_chemical_symbols(rng.choice(elements, len(atoms)))
        atoms.positions += rng.normal(0.0, 0.1, atoms.positions.shape)
        atoms.calc = EMT()
        labels = dict(energy=atoms.get_potential_energy(), forces=atoms.get_forces())
        if periodic:
            labels["stress"] = atoms.get_stress()
        atoms.calc = None
        if ref_keys:  # as extended XYZ files of quantum-chemistry data store them
            atoms.info["REF_energy"], atoms.arrays["REF_forces"] = labels["energy"], labels["forces"]
        else:
            atoms.calc = SinglePointCalculator(atoms, **labels)
        out.append(atoms)
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("train_data")
    paths = {"train": folder / "train.xyz", "test": folder / "test.xyz", "ptrain": folder / "ptrain.xyz",
             "ptest": folder / "ptest.xyz"}
    write(paths["train"], frames(24, 0, ref_keys=True))
    write(paths["test"], frames(6, 1, ref_keys=True))
    write(paths["ptrain"], frames(20, 2, periodic=True))
    write(paths["ptest"], frames(5, 3, periodic=True))
    return paths


def errors_through_the_calculator(checkpoint, path, energy_key="energy", forces_key="forces"):
    """MAE of energy per atom, forces and (periodic) stress of E3AttnCalculator against the labels, in meV."""
    calc = E3AttnCalculator.from_checkpoint(checkpoint)
    energy, forces, stress = [], [], []
    for atoms in read(path, index=":"):
        true_e = atoms.info.get(energy_key) if energy_key in atoms.info else atoms.get_potential_energy()
        true_f = atoms.arrays[forces_key] if forces_key in atoms.arrays else atoms.get_forces()
        true_s = atoms.get_stress(voigt=False) if atoms.pbc.all() else None
        atoms.calc = calc
        energy.append(abs(atoms.get_potential_energy() - true_e) / len(atoms))
        forces.append(np.abs(atoms.get_forces() - true_f).ravel())
        if true_s is not None:
            stress.append(np.abs(atoms.get_stress(voigt=False) - true_s).ravel())
    out = {"energy_mae_meV_per_atom": 1000 * np.mean(energy), "force_mae_meV_per_A": 1000 * np.concatenate(forces).mean()}
    if stress:
        out["stress_mae_meV_per_A3"] = 1000 * np.concatenate(stress).mean()
    return out


def test_end_to_end_checkpoint_reproduces_the_printed_test_errors(data, tmp_path, capsys):
    checkpoint, metrics_path = tmp_path / "model.pt", tmp_path / "metrics.json"
    metrics = cli.main(["--train-file", str(data["train"]), "--test-file", str(data["test"]), "--energy-key",
                        "REF_energy", "--forces-key", "REF_forces", "--valid-fraction", "0.25", "--save",
                        str(checkpoint), "--metrics", str(metrics_path)] + TINY)
    lines = capsys.readouterr().out.strip().splitlines()
    split_lines = [line for line in lines if re.fullmatch(LINE, line)]
    assert [line.split(":")[0] for line in split_lines] == ["valid", "test"] and "stress" not in lines[-1]
    assert json.loads(metrics_path.read_text()) == metrics
    assert metrics["num_train"] == 18 and metrics["valid"]["num_structures"] == 6 and metrics["test"]["num_structures"] == 6
    assert metrics["species"] == ["Ni", "Cu"]  # by atomic number

    through_ase = errors_through_the_calculator(checkpoint, data["test"], "REF_energy", "REF_forces")
    printed = dict(zip(["energy_mae_meV_per_atom", "force_mae_meV_per_A"], map(float, re.findall(r"\d+\.\d\d", split_lines[1]))))
    for key, value in through_ase.items():
        assert value == pytest.approx(metrics["test"][key], rel=1e-4)
        assert abs(printed[key] - value) <= 0.005 + 1e-4


def test_stress_is_trained_and_reported_in_float64(data, tmp_path, capsys):
    checkpoint = tmp_path / "model.pt"
    metrics = cli.main(["--train-file", str(data["ptrain"]), "--test-file", str(data["ptest"]), "--dtype",
                        "float64", "--save", str(checkpoint), "--max-radius", "3.0"] + TINY)
    out = capsys.readouterr().out
    assert re.search(r"^test: .* stress MAE \d+\.\d\d meV/A\^3$", out, re.M)
    assert E3AttnCalculator.from_checkpoint(checkpoint).dtype == torch.float64
    through_ase = errors_through_the_calculator(checkpoint, data["ptest"])
    for key, value in through_ase.items():
        assert value == pytest.approx(metrics["test"][key], rel=1e-8)
    assert torch.get_default_dtype() == torch.float32  # restored


def test_reference_energies_are_recovered_exactly():
    references = {"Cu": -3.25, "Ni": -4.5, "Au": 1.75}
    rng = np.random.default_rng(0)
    samples = []
    for size in (3, 5, 8, 13):
        atoms = Icosahedron("Cu", 2)[:size]
        atoms.set_chemical_symbols(rng.choice(list(references), size))
        energy = sum(references[s] for s in atoms.get_chemical_symbols())
        atoms.calc = SinglePointCalculator(atoms, energy=energy, forces=np.full((size, 3), 0.5))
        samples.append(to_sample(atoms, list(references), 3.0))
    units = fit_references(samples, list(references))
    np.testing.assert_allclose(units["energy_references"], list(references.values()), rtol=0, atol=1e-12)
    assert units["energy_scale"] == pytest.approx(0.5, rel=1e-12)


@pytest.mark.parametrize("ema", ["0", "0.9"])
def test_best_epoch_by_validation_is_the_model_kept(data, ema):
    from e3attn.train import build_model, evaluate, loss_options

    structures = read(data["ptrain"], index=":")
    samples = [to_sample(a, ["Ni", "Cu"], 3.0) for a in structures]
    args = cli.parse_args(["--train-file", "unused"] + TINY + ["--epochs", "4", "--lr", "0.05", "--ema", ema])
    args.avg_num_neighbors, args.max_radius = 10.0, 3.0
    units = fit_references(samples[:15], ["Ni", "Cu"])
    torch.manual_seed(0)
    model = build_model(args, 2)
    result = fit(model, samples[:15], units, args, "cpu", valid_set=samples[15:])
    assert len(result.valid_losses) == 4 and result.best_epoch == 1 + int(np.argmin(result.valid_losses))
    kept = evaluate(model, samples[15:], units, "cpu", weights=loss_options(args))["loss"]
    assert kept == pytest.approx(min(result.valid_losses), rel=1e-5)


def test_the_moving_average_is_what_is_validated_and_kept(data):
    """With --ema the model returned holds the average of the weights after every step, not the last weights."""
    from e3attn.train import WeightAverage, build_model

    samples = [to_sample(a, ["Ni", "Cu"], 3.0) for a in read(data["ptrain"], index=":")]
    args = cli.parse_args(["--train-file", "unused"] + TINY + ["--epochs", "1", "--ema", "0.5", "--batch-size", "5"])
    args.avg_num_neighbors, args.max_radius = 10.0, 3.0
    units = fit_references(samples[:15], ["Ni", "Cu"])
    torch.manual_seed(0)
    model = build_model(args, 2)
    steps = []  # the weights after each of the 3 steps, recorded by the average's update
    update = WeightAverage.update

    def record(self):
        steps.append([p.detach().clone() for p in self.params])
        update(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(WeightAverage, "update", record)
        initial = [p.detach().clone() for p in model.parameters()]
        fit(model, samples[:15], units, args, "cpu")
    assert len(steps) == 3
    for i, p in enumerate(model.parameters()):
        average = initial[i]
        for step in steps:
            average = 0.5 * average + 0.5 * step[i]
        torch.testing.assert_close(p.detach(), average, rtol=1e-6, atol=1e-7)
        assert i > 0 or not torch.allclose(p.detach(), steps[-1][i])


def test_the_command_has_its_own_defaults_and_the_emt_example_keeps_its(monkeypatch):
    from e3attn.train import options

    args = cli.parse_args(["--train-file", "unused"])
    for key, value in {**options.MODEL_DEFAULTS, **cli.MODEL_DEFAULTS, **options.TRAINING_DEFAULTS,
                       **cli.TRAINING_DEFAULTS}.items():
        assert getattr(args, key) == value, key
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    import molecules

    example = molecules.parse_args([])
    for key, value in {**options.MODEL_DEFAULTS, **options.TRAINING_DEFAULTS}.items():
        assert getattr(example, key) == value, key
    assert (example.max_radius, example.layers, example.hidden, example.heads) == (4.0, 1, "16x0e + 8x1o", 4)
    # the command's defaults as docs/guide/training.rst states them
    assert (args.max_radius, args.layers, args.heads, args.batch_size, args.force_weight) == (5.0, 2, 1, 8, 10.0)
    assert (args.hidden, args.lmax, args.density_lmax) == ("16x0e + 8x1o + 4x2e", 2, 3)
    assert (args.loss, args.huber_delta, example.loss) == ("huber", 0.01, "mse")
    with pytest.raises(ValueError, match="unknown option.*layerz"):
        options.add_model_options(options.ArgumentParser("x"), defaults={"layerz": 2})


def bad_inputs(data, tmp_path):
    """``(argv, fragment of the error)`` for every kind of bad input."""
    no_forces = tmp_path / "no_forces.xyz"
    atoms = frames(2, 4)
    for a in atoms:
        a.calc = SinglePointCalculator(a, energy=a.get_potential_energy())
    write(no_forces, atoms)
    gold = tmp_path / "gold.xyz"
    write(gold, frames(2, 5, elements=("Cu", "Au")))
    empty = tmp_path / "empty.xyz"
    empty.write_text("")
    one = tmp_path / "one.xyz"
    write(one, frames(1, 6))
    bad_key = tmp_path / "bad_key.yaml"
    bad_key.write_text(f"train_file: {data['train']}\nepochz: 3\n")
    partial = tmp_path / "partial.xyz"
    write(partial, frames(1, 7, periodic=True) + frames(1, 8))
    train = ["--train-file", str(data["train"]), "--energy-key", "REF_energy", "--forces-key", "REF_forces"]
    return [
        (["--train-file", str(data["train"])], "has no energy under the key 'energy' (--energy-key)"),
        (train[:4] + ["--forces-key", "F"], "has no forces under the key 'F' (--forces-key): training needs forces"),
        (["--train-file", str(no_forces)], "has no forces under the key 'forces'"),
        (train + ["--test-file", str(gold)], "--test-file: structure 0 (from 0)"),
        (train + ["--valid-file", str(empty)], f"--valid-file: {str(empty)!r} holds no structures"),
        (["--train-file", str(one), "--valid-fraction", "0.5"], "--valid-fraction 0.5 leaves no training structures"),
        (["--train-file", str(tmp_path / "absent.xyz")], "--train-file: no such file"),
        (["--config", str(bad_key)], "has the key 'epochz', which is not an option"),
        (["--config", str(tmp_path / "absent.yaml")], "--config: cannot read"),
        (["--train-file", str(partial)], "1 of 2 structures have a stress under 'stress'"),
        (train + ["--valid-file", str(data["test"]), "--valid-fraction", "0.1"], "--valid-file or --valid-fraction"),
        (train + ["--save", str(tmp_path / "absent" / "model.pt")], "argument --save: the folder"),
        (train + ["--lr", "-1"], "argument --lr: expected a positive number, got '-1'"),
        (train + ["--loss", "l1"], "argument --loss: invalid choice: 'l1'"),
        (train + ["--loss", "huber", "--huber-delta", "0"], "argument --huber-delta: expected a positive number"),
        (train + ["--compile", "--ddp"], "argument --compile: not with --ddp"),
        (train + ["--compile", "maybe"], "argument --compile: expected auto, on or off, got 'maybe'"),
        (["--train-file", str(data["ptrain"]), "--compile"], "--compile: the structures of --train-file have stress"),
    ]


def test_bad_input_is_one_line_and_exit_status_2(data, tmp_path, capsys):
    for argv, fragment in bad_inputs(data, tmp_path):
        with pytest.raises(SystemExit) as stop:
            cli.main(argv + TINY)
        err = capsys.readouterr().err
        assert stop.value.code == 2 and len(err.strip().splitlines()) == 1, (argv, err)
        assert err.startswith("e3attn-train: error: ") and fragment in err and "Traceback" not in err, (fragment, err)
    assert torch.get_default_dtype() == torch.float32


def test_the_unknown_element_is_named(data, tmp_path, capsys):
    gold = tmp_path / "gold.xyz"
    write(gold, frames(1, 5, elements=("Au",)))
    with pytest.raises(SystemExit):
        cli.main(["--train-file", str(data["ptrain"]), "--test-file", str(gold)] + TINY)
    assert "holds the elements ['Au'], which the training set (and so the model) does not have; it knows ['Ni', 'Cu']" \
        in capsys.readouterr().err


def test_yaml_config_equals_the_flags_and_flags_win(tmp_path):
    flags = ["--train-file", "a.xyz", "--test-file", "b.xyz", "--energy-key", "REF_energy", "--hidden", "8x0e + 4x1o",
             "--epochs", "7", "--lr", "0.002", "--amp", "--stress-key", "none", "--valid-fraction", "0.1"]
    config = tmp_path / "train.yaml"
    config.write_text("train_file: a.xyz\ntest-file: b.xyz\nenergy_key: REF_energy\nhidden: 8x0e + 4x1o\nepochs: 7\n"
                      "lr: 0.002\namp: true\nstress_key: none\nvalid_fraction: 0.1\nquiet: false\nsave: null\n")
    with pytest.warns(UserWarning, match="--amp needs a CUDA"):
        from_flags = vars(cli.parse_args(flags + ["--device", "cpu"]))
    with pytest.warns(UserWarning, match="--amp needs a CUDA"):
        from_config = vars(cli.parse_args(["--config", str(config), "--device", "cpu"]))
    assert from_config.pop("config") == str(config) and from_flags.pop("config") is None
    assert from_config == from_flags
    with pytest.warns(UserWarning):
        assert cli.parse_args(["--config", str(config), "--epochs", "3", "--device", "cpu"]).epochs == 3


def test_an_existing_checkpoint_survives_a_failed_save(data, tmp_path, monkeypatch, capsys):
    checkpoint = tmp_path / "model.pt"
    checkpoint.write_bytes(b"the user's earlier model")

    def broken(obj, file, *args, **kwargs):  # torch.save that fills the disk midway
        file.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken)
    with pytest.raises(SystemExit) as stop:
        cli.main(["--train-file", str(data["ptrain"]), "--save", str(checkpoint)] + TINY + ["--epochs", "1"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.strip().splitlines()) == 1
    assert f"cannot write --save '{checkpoint}': disk full; neither file was replaced" in err
    assert checkpoint.read_bytes() == b"the user's earlier model"
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]


def test_console_script_and_module_entry_point():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    scripts = config["options.entry_points"]["console_scripts"].strip().splitlines()
    assert "e3attn-train = e3attn.train.cli:main" in [s.strip() for s in scripts]
    import e3attn.train.__main__ as module_main

    assert module_main.main is cli.main


def test_the_huber_loss_against_its_definition():
    from e3attn.train import loss_fn

    batch = {"energy": torch.tensor([0.0, 1.0]), "forces": torch.zeros(3, 3), "num_atoms": torch.tensor([1, 2])}
    forces = torch.tensor([[0.05, -0.3, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 2.0]])
    prediction = (torch.tensor([0.04, 1.2]), forces, None)
    units = {"energy_scale": 0.5}

    def huber(x, delta):  # x^2 / 2 delta within delta, |x| - delta / 2 beyond
        return torch.where(x.abs() <= delta, x**2 / (2 * delta), x.abs() - delta / 2)

    energy_errors, force_errors = torch.tensor([0.08, 0.2]), forces.flatten() / 0.5  # per atom, over the scale
    for delta in (0.1, 0.5, 10.0):
        expected = 2.0 * huber(energy_errors, delta).mean() + 3.0 * huber(force_errors, delta).mean()
        got = loss_fn(prediction, batch, units, force_weight=3.0, energy_weight=2.0, loss="huber", huber_delta=delta)
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
    squares = 2.0 * energy_errors.pow(2).mean() + 3.0 * force_errors.pow(2).mean()
    torch.testing.assert_close(loss_fn(prediction, batch, units, force_weight=3.0, energy_weight=2.0), squares)
    with pytest.raises(ValueError, match="loss must be 'mse' or 'huber', got 'l1'"):
        loss_fn(prediction, batch, units, force_weight=3.0, loss="l1")
    for bad in (0, True):
        with pytest.raises(ValueError, match=f"huber_delta must be a positive number, got {bad}"):
            loss_fn(prediction, batch, units, force_weight=3.0, loss="huber", huber_delta=bad)


def test_the_loss_options_reach_training_and_validation(data, monkeypatch):
    import e3attn.train.loop as loop
    from e3attn.train import build_model

    samples = [to_sample(a, ["Ni", "Cu"], 3.0) for a in read(data["ptrain"], index=":")]
    args = cli.parse_args(["--train-file", "unused"] + TINY + ["--epochs", "1", "--loss", "huber",
                                                               "--huber-delta", "0.3", "--batch-size", "5"])
    args.avg_num_neighbors, args.max_radius = 10.0, 3.0
    seen = []
    for module in (loop, __import__("e3attn.train.model", fromlist=["loss_fn"])):
        original = module.loss_fn
        monkeypatch.setattr(module, "loss_fn", lambda *a, _f=original, **k: seen.append(k) or _f(*a, **k))
    torch.manual_seed(0)
    fit(build_model(args, 2), samples[:15], fit_references(samples[:15], ["Ni", "Cu"]), args, "cpu",
        valid_set=samples[15:])
    assert len(seen) == 3 + 1  # three training steps, one validation batch
    assert all(k["loss"] == "huber" and k["huber_delta"] == 0.3 for k in seen)


def test_the_compiled_step_s_first_call_is_not_taken_for_an_epoch_s_time(data, monkeypatch):
    """The budget's estimate of the next epoch leaves out the first call's tracing and compiling: with a first call
    of 1 s and a budget of 1.8 s, training goes on after the first epoch (it stopped there when the estimate of
    the second epoch included the first call)."""
    import time

    import e3attn.train.loop as loop
    from e3attn.train import build_model, loss_fn, predict

    class SlowFirstCall:  # the eager step, its first call as long as a compile
        def __init__(self, module, units, weights):
            self.module, self.units, self.weights, self.calls = module, units, weights, 0

        def __call__(self, batch):
            if not self.calls:
                time.sleep(1.0)
            self.calls += 1
            loss = loss_fn(predict(self.module, batch, self.units, create_graph=True), batch, self.units,
                           **self.weights)
            loss.backward()
            return loss.detach()

    monkeypatch.setattr(loop, "CompiledStep", SlowFirstCall)
    samples = [to_sample(a, ["Ni", "Cu"], 3.0) for a in read(data["ptrain"], index=":")]
    args = cli.parse_args(["--train-file", "unused"] + TINY + ["--compile", "--time-budget", "1.8", "--epochs", "40",
                                                               "--batch-size", "5", "--lmax", "1"])  # fast epochs
    args.avg_num_neighbors, args.max_radius = 10.0, 3.0
    torch.manual_seed(0)
    result = fit(build_model(args, 2), samples[:15], fit_references(samples[:15], ["Ni", "Cu"]), args, "cpu",
                 valid_set=samples[15:])
    assert len(result.train_losses) >= 3, result


def test_validation_loss_refuses_an_empty_set():
    from e3attn.models import EquivariantTransformer
    from e3attn.train import validation_loss

    model = EquivariantTransformer("1x0e", "8x0e + 4x1o", "0e", 2.0, irreps_node_attr="2x0e", reduce="sum")
    with pytest.raises(ValueError, match="samples: no structures"):
        validation_loss(model, [], {"species": ["H", "O"], "energy_references": [0.0, 0.0], "energy_scale": 1.0}, "cpu")

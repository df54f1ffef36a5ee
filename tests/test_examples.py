import argparse
import importlib
import itertools
import pathlib

import numpy as np
import pytest
import torch

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def examples(monkeypatch):
    """The examples folder on sys.path, as when a script is run from it."""
    monkeypatch.syspath_prepend(str(EXAMPLES))


def test_tetris_smoke(examples, tmp_path):
    import tetris

    result = tetris.main(["--smoke", "--device", "cpu", "--out", str(tmp_path / "curve.png")])
    assert (tmp_path / "curve.png").read_bytes()[:8] == PNG
    assert result["num_test"] == 8 * 4 and 0.0 <= result["test_accuracy"] <= 1.0
    assert result["equivariance_error"]["float64"] < 1e-10
    assert result["equivariance_error"]["float32"] < 1e-3


def test_figures_and_json_are_replaced_only_when_complete(examples, tmp_path):
    """A figure (or JSON report) that fails midway (an interrupt here) leaves the file already there and no
    temporary file; a complete one replaces it."""
    import json

    import _common

    plt = _common.pyplot()
    fig, _ = plt.subplots()
    path, report = tmp_path / "figure.png", tmp_path / "report.json"
    path.write_bytes(b"previous figure")
    report.write_text('{"previous": 1}')

    def interrupted(file, **kwargs):
        file.write(PNG)
        raise KeyboardInterrupt

    original, fig.savefig = fig.savefig, interrupted
    with pytest.raises(KeyboardInterrupt):
        _common.save_figure(fig, path)
    with pytest.raises(TypeError):  # not JSON: fails after the file was opened
        _common.write_json({"bad": object()}, report)
    assert path.read_bytes() == b"previous figure" and report.read_text() == '{"previous": 1}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["figure.png", "report.json"]
    fig.savefig = original
    _common.save_figure(fig, path)
    _common.write_json({"new": [1, 2]}, report)
    plt.close(fig)
    assert path.read_bytes()[:8] == PNG and json.loads(report.read_text()) == {"new": [1, 2]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["figure.png", "report.json"]


def test_tetris_logits_swap_only_the_chiral_pair_under_a_mirror(examples):
    import tetris

    out = torch.randn(5, 8)
    mirrored = out.clone()
    mirrored[:, 7] *= -1  # the odd scalar flips sign
    logits, flipped = tetris.logits_from(out), tetris.logits_from(mirrored)
    torch.testing.assert_close(flipped[:, :6], logits[:, :6])
    torch.testing.assert_close(flipped[:, [6, 7]], logits[:, [7, 6]])


def test_tetris_shapes_are_the_eight_free_tetracubes(examples):
    import tetris

    def canonical(cubes, improper):
        """Sorted coordinates, minimised over the 24 (or 48 with reflections) cube symmetries and translations."""
        forms = []
        for perm in itertools.permutations(range(3)):
            for signs in itertools.product([1, -1], repeat=3):
                m = torch.zeros(3, 3, dtype=torch.long)
                m[range(3), perm] = torch.tensor(signs)
                if improper or torch.det(m.double()) > 0:
                    p = torch.tensor(cubes) @ m.T
                    forms.append(tuple(sorted(map(tuple, (p - p.min(0).values).tolist()))))
        return min(forms)

    shapes = list(tetris.SHAPES.values())
    for cubes in shapes:  # connected face to face, 4 distinct cubes
        assert len(set(cubes)) == 4
        assert all(any(sum(abs(a - b) for a, b in zip(c, d)) == 1 for d in cubes if d != c) for c in cubes)
    assert len({canonical(s, improper=False) for s in shapes}) == 8  # distinct under rotations
    assert len({canonical(s, improper=True) for s in shapes}) == 7  # one mirror pair


def test_molecules_smoke_train_save_predict(examples, tmp_path):
    import molecules
    from ase.io import write

    from e3attn.models.checkpoint import load_checkpoint

    checkpoint, figure = tmp_path / "model.pt", tmp_path / "parity.png"
    args = molecules.parse_args(["--smoke", "--device", "cpu", "--quiet", "--save", str(checkpoint), "--out", str(figure)])
    model, metrics = molecules.train(args)
    assert figure.read_bytes()[:8] == PNG
    assert metrics["num_test"] == 4 and len(metrics["train_losses"]) == 2
    assert metrics["energy_mae_meV_per_atom"] > 0 and metrics["force_mae_meV_per_A"] > 0

    loaded, extra = load_checkpoint(checkpoint)  # what E3AttnCalculator.from_checkpoint reads
    assert extra["species"] == list(molecules.SPECIES)
    assert len(extra["energy_references"]) == len(molecules.SPECIES) and extra["energy_scale"] > 0

    structures = molecules.make_structures(3, seed=123)
    write(tmp_path / "structures.xyz", structures)
    predicted = molecules.main(["--predict", str(checkpoint), "--structures", str(tmp_path / "structures.xyz"),
                                "--device", "cpu"])
    samples = [molecules.to_sample(a, model.max_radius) for a in structures]
    expected = molecules.predict(model.eval(), molecules.collate(samples), extra)[0]  # batched, without ASE
    torch.testing.assert_close(torch.tensor(predicted["energies"], dtype=torch.float64), expected.detach().double(), atol=1e-4, rtol=0)
    assert predicted["force_mae_meV_per_A"] > 0  # the xyz file carries the EMT labels


def test_molecules_labels_are_emt(examples):
    import molecules
    from ase.calculators.emt import EMT

    atoms = molecules.make_structures(1, seed=7)[0]
    energy, forces = atoms.get_potential_energy(), atoms.get_forces()
    fresh = atoms.copy()
    fresh.calc = EMT()
    assert abs(fresh.get_potential_energy() - energy) < 1e-10
    assert abs(fresh.get_forces() - forces).max() < 1e-10
    assert abs(forces.sum(0)).max() < 1e-8  # no net force


def test_molecules_batches_equal_single_structures(examples):
    import molecules

    samples = [molecules.to_sample(a, 4.0) for a in molecules.make_structures(3, seed=5)]
    units = molecules.fit_references(samples)
    torch.manual_seed(0)
    model = molecules.build_model(molecules.parse_args([])).eval()
    energy, forces, _ = molecules.predict(model, molecules.collate(samples), units)
    for i, s in enumerate(samples):
        e, f, _ = molecules.predict(model, molecules.collate([s]), units)
        torch.testing.assert_close(e, energy[i : i + 1], atol=1e-4, rtol=1e-6)
        n0 = sum(t["pos"].shape[0] for t in samples[:i])
        torch.testing.assert_close(f, forces[n0 : n0 + s["pos"].shape[0]], atol=1e-4, rtol=1e-5)


def test_molecules_energy_scales(examples):
    import molecules

    samples = [molecules.to_sample(a, 4.0) for a in molecules.make_structures(6, seed=3)]
    counts = np.array([[(s["species"] == k).sum().item() for k in range(len(molecules.SPECIES))] for s in samples])
    energies = np.array([s["energy"].item() for s in samples])
    refs = np.linalg.lstsq(counts, energies, rcond=None)[0]
    per_atom = (energies - counts @ refs) / counts.sum(1)
    forces = np.concatenate([s["forces"].double().numpy() for s in samples])

    units = molecules.fit_references(samples)  # the default: RMS force component
    np.testing.assert_allclose(units["energy_references"], refs, rtol=1e-8, atol=1e-8)
    np.testing.assert_allclose(units["energy_scale"], np.sqrt(np.mean(forces**2)), rtol=1e-10)
    units = molecules.fit_references(samples, "energy_std")
    np.testing.assert_allclose(units["energy_scale"], np.std(per_atom), rtol=1e-8)
    assert molecules.parse_args(["--energy-scale", "energy_std"]).energy_scale == "energy_std"
    with pytest.raises(ValueError, match="energy_scale: expected one of"):
        molecules.fit_references(samples, "energy_rms")


def test_molecules_amp_on_cpu_warns_and_runs_in_float32(examples):
    import molecules

    with pytest.warns(UserWarning, match="--amp needs a CUDA device"):
        args = molecules.parse_args(["--smoke", "--device", "cpu", "--amp"])
    assert args.amp is False


# ----------------------------------------------------------------------------- the command lines

SCRIPTS = ["quickstart", "tetris", "molecules", "attention_graph", "md"]


def run_main(name, argv, capsys):
    """``(exit status, stdout, stderr)`` of ``examples/<name>.py argv`` when it stops during argument handling."""
    module = importlib.import_module(name)
    with pytest.raises(SystemExit) as info:
        module.main(argv)
    out, err = capsys.readouterr()
    return info.value.code, out, err


def unavailable_device():
    return f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_is_plain_text_and_every_option_explained(examples, monkeypatch, capsys, name):
    import _common

    code, out, _ = run_main(name, ["--help"], capsys)
    assert code == 0 and "usage:" in out
    for markup in (":class:", ":math:", ":func:", ":mod:", "``", "\\"):
        assert markup not in out, markup
    parsers = []

    def capture(self, args=None, namespace=None):
        parsers.append(self)
        raise SystemExit(0)

    monkeypatch.setattr(_common.ArgumentParser, "parse_args", capture)
    run_main(name, [], capsys)
    options = [a for a in parsers[0]._actions if not isinstance(a, argparse._HelpAction)]
    assert options and all(a.help for a in options), [a.dest for a in options if not a.help]


@pytest.mark.parametrize("name", SCRIPTS)
@pytest.mark.parametrize("device", ["unavailable", "nonsense"])
def test_unusable_device_is_one_line_and_exit_status_2(examples, capsys, name, device):
    device = unavailable_device() if device == "unavailable" else device
    code, _, err = run_main(name, ["--device", device], capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "error: argument --device" in err and "--device cpu" in err


@pytest.mark.parametrize(
    "name, argv, match",
    [
        ("tetris", ["--steps", "-5"], "argument --steps: expected a non-negative integer, got '-5'"),
        ("tetris", ["--copies", "0"], "argument --copies: expected a positive integer"),
        ("tetris", ["--lr", "nan"], "argument --lr: expected a positive number"),
        ("molecules", ["--epochs", "0"], "argument --epochs: expected a positive integer"),
        ("molecules", ["--hidden", "16 scalars"], "argument --hidden: expected e3nn irreps"),
        ("attention_graph", ["--heads", "3"], "--heads 3 must divide 4"),
        ("quickstart", ["--seed", "x"], "argument --seed: expected a non-negative integer"),
        ("md", ["--dt", "1", "-0.5"], "argument --dt: expected a positive number, got '-0.5'"),
    ],
)
def test_bad_numbers_are_one_line_and_exit_status_2(examples, capsys, name, argv, match):
    code, _, err = run_main(name, argv, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and match in err


def test_predict_with_a_file_that_is_not_a_checkpoint(examples, capsys, tmp_path):
    from e3attn.models import EquivariantTransformer, save_checkpoint

    not_a_checkpoint = tmp_path / "notes.txt"
    not_a_checkpoint.write_text("not a model")
    no_units = tmp_path / "other.pt"
    save_checkpoint(EquivariantTransformer("1x0e", "4x0e", "0e", 1.5, num_layers=1), no_units)
    for path, match in [(not_a_checkpoint, "is not a checkpoint"), (tmp_path / "absent.pt", "argument --predict: no such file"),
                        (no_units, "species")]:
        code, _, err = run_main("molecules", ["--predict", str(path), "--device", "cpu"], capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1 and match in err
        assert "weights_only=False" not in err and "Traceback" not in err


def test_md_smoke_trains_then_loads_the_same_potential(examples, tmp_path):
    import json

    import md

    checkpoint = tmp_path / "cu.pt"
    options = ["--smoke", "--device", "cpu", "--quiet", "--checkpoint", str(checkpoint), "--dt", "1", "0.5"]
    trained = md.main(options + ["--out", str(tmp_path / "md.png"), "--json", str(tmp_path / "md.json")])
    assert (tmp_path / "md.png").read_bytes()[:8] == PNG and checkpoint.exists()
    assert trained.pop("figure") == str(tmp_path / "md.png")
    assert json.loads((tmp_path / "md.json").read_text()) == trained
    labels = ["model, dt = 1 fs", "model, dt = 0.5 fs", "EMT, dt = 1 fs"]
    assert list(trained["deviation_meV_per_atom"]) == labels and trained["num_atoms"] == 4
    assert all(0 < d < float("inf") for d in trained["deviation_meV_per_atom"].values())
    loaded = md.main(options + ["--out", str(tmp_path / "again.png")])  # the checkpoint exists now: no training
    for label in labels:
        assert loaded["deviation_meV_per_atom"][label] == pytest.approx(trained["deviation_meV_per_atom"][label],
                                                                        rel=1e-4)


def test_md_starts_from_a_crystal_at_rest_at_the_temperature(examples):
    import md
    from ase.units import kB

    atoms = md.copper(100)
    assert len(atoms) == 108 and atoms.pbc.all()
    md.thermalize(atoms, 300.0, seed=0)
    assert abs(atoms.get_momenta().sum(0)).max() < 1e-12
    assert atoms.get_kinetic_energy() / (1.5 * kB * len(atoms)) == pytest.approx(300.0, rel=0.2)

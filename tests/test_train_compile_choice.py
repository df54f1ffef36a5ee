"""``--compile auto|on|off`` of the training loop: auto compiles after the first epoch where it pays, never where a
compiled step cannot train, and falls back to eager steps where compiling fails."""
import argparse

import numpy as np
import pytest
import torch

pytest.importorskip("ase")
from ase.calculators.emt import EMT  # noqa: E402
from ase.calculators.singlepoint import SinglePointCalculator  # noqa: E402
from ase.cluster import Icosahedron  # noqa: E402

import e3attn.train.compiled as compiled_module  # noqa: E402
import e3attn.train.loop as loop  # noqa: E402
from e3attn.train import build_model, cli, fit, fit_references, loss_fn, predict, to_sample  # noqa: E402
from e3attn.train.compiled import auto_compile, compile_setting  # noqa: E402
from e3attn.train.config import config_arguments  # noqa: E402

TINY = ["--train-file", "unused", "--hidden", "8x0e + 4x1o", "--heads", "2", "--density", "4", "--radial-neurons",
        "8", "--batch-size", "4", "--device", "cpu", "--quiet", "--time-budget", "0", "--max-radius", "3"]


def samples(num=15):
    rng = np.random.default_rng(0)
    out = []
    for _ in range(num):
        atoms = Icosahedron("Cu", 2)
        atoms.rattle(0.05, seed=int(rng.integers(1 << 30)))
        atoms.calc = EMT()
        atoms.calc = SinglePointCalculator(atoms, energy=atoms.get_potential_energy(), forces=atoms.get_forces())
        out.append(to_sample(atoms, ["Cu"], 3.0))
    return out


class EagerInDisguise:
    """Stands for CompiledStep: the eager step, its calls counted (a real compile takes minutes)."""

    made = []

    def __init__(self, module, units, weights, fail=False):
        self.module, self.units, self.weights, self.fail, self.batches = module, units, weights, fail, []
        EagerInDisguise.made.append(self)

    def __call__(self, batch):
        if self.fail:
            raise RuntimeError("cannot trace a data-dependent branch\nsecond line")
        self.batches.append(batch["num_atoms"].numel())
        loss = loss_fn(predict(self.module, batch, self.units, create_graph=True), batch, self.units, **self.weights)
        loss.backward()
        return loss.detach()


@pytest.fixture
def fake(monkeypatch):
    EagerInDisguise.made = []
    monkeypatch.setattr(loop, "CompiledStep", EagerInDisguise)
    return EagerInDisguise


def train(argv, data, threshold=None, monkeypatch=None, quiet=True):
    args = cli.parse_args(TINY + argv)
    args.avg_num_neighbors, args.quiet = 10.0, quiet
    if threshold is not None:
        monkeypatch.setattr(compiled_module, "AUTO_COMPILE_SECONDS", threshold)
    torch.manual_seed(0)
    return fit(build_model(args, 1), data, fit_references(data, ["Cu"]), args, "cpu")


def test_the_option_reads_auto_on_and_off(tmp_path):
    assert cli.parse_args(TINY).compile == "auto"  # the default
    assert cli.parse_args(TINY + ["--compile"]).compile == "on"  # the flag alone, as before
    assert cli.parse_args(["--compile", "--epochs", "1"] + TINY).compile == "on"
    assert cli.parse_args(TINY + ["--compile", "OFF"]).compile == "off"
    config = tmp_path / "train.yaml"
    for value, expected in (("true", "on"), ("false", "off"), ("auto", "auto")):
        config.write_text(f"compile: {value}\n")
        assert cli.parse_args(["--config", str(config)] + TINY).compile == expected
    assert config_arguments(cli._parser(), str(config)) == ["--compile", "auto"]
    assert compile_setting(argparse.Namespace(compile=False)) == "off"
    with pytest.raises(ValueError, match="args.compile must be 'auto', 'on', 'off' or a bool, got 'yes'"):
        compile_setting(argparse.Namespace(compile="yes"))


def test_auto_compiles_the_steps_after_the_first_epoch_where_the_training_left_is_long(fake, monkeypatch, capfd):
    data = samples()
    result = train(["--epochs", "3"], data, threshold=0.0, monkeypatch=monkeypatch, quiet=False)
    assert len(fake.made) == 1 and result.compiled
    # epoch 1 eager (4 batches of 4, 4, 4, 3), epochs 2 and 3 compiled without the last, smaller batch
    assert fake.made[0].batches == [4, 4, 4] * 2
    assert "--compile auto: compiling the training step" in capfd.readouterr().err


def test_auto_leaves_the_steps_eager_where_compiling_does_not_pay(fake, monkeypatch):
    data = samples()
    result = train(["--epochs", "3"], data)  # seconds of training left, far from AUTO_COMPILE_SECONDS
    assert not fake.made and not result.compiled
    result = train(["--epochs", "3", "--compile", "off"], data, threshold=0.0, monkeypatch=monkeypatch)
    assert not fake.made and not result.compiled
    with_stress = [dict(s, stress=torch.zeros(1, 3, 3)) for s in data]
    assert auto_compile(argparse.Namespace(ddp=False, amp=False), "cpu", with_stress, 1e9) is None
    for device, ddp, amp in (("cuda", False, False), ("cpu", True, False), ("cpu", False, True)):
        assert auto_compile(argparse.Namespace(ddp=ddp, amp=amp), device, data, 1e9) is None
    assert auto_compile(argparse.Namespace(ddp=False, amp=False), "cpu", data, 1e9) is not None


def test_on_compiles_from_the_first_step(fake):
    result = train(["--epochs", "2", "--compile"], samples())
    assert len(fake.made) == 1 and fake.made[0].batches == [4, 4, 4] * 2 and result.compiled


def test_the_schedule_goes_on_across_a_compile_in_the_second_epoch(monkeypatch):
    """The cosine schedule's progress does not go back at the first compiled call (here 0.5 s) in the middle of the
    time budget (it went back to nearly 0 when the second epoch's times left that call out)."""
    import time

    class SlowFirstCall(EagerInDisguise):
        def __call__(self, batch):
            if not self.batches:
                time.sleep(0.5)
            return super().__call__(batch)

    EagerInDisguise.made = []
    monkeypatch.setattr(loop, "CompiledStep", SlowFirstCall)
    done, original = [], loop.progress
    monkeypatch.setattr(loop, "progress", lambda *a: done.append(original(*a)) or done[-1])
    result = train(["--epochs", "1000", "--time-budget", "6"], samples(), threshold=0.0, monkeypatch=monkeypatch)
    assert result.compiled and len(result.train_losses) >= 3
    # epoch 1 (4 batches), then epoch 2: the compiling first call, then two more (the last batch left out); within
    # an epoch the time is extrapolated from the one before, so only the compile's own jump is tested
    assert done[4] <= done[5] <= done[6], done[:8]


def test_auto_falls_back_to_eager_steps_where_compiling_fails_and_on_does_not(monkeypatch, capfd):
    data = samples()
    monkeypatch.setattr(loop, "CompiledStep", lambda *a: EagerInDisguise(*a, fail=True))
    eager, step = [], loop._eager_step
    monkeypatch.setattr(loop, "_eager_step", lambda m, batch, *a: eager.append(batch["num_atoms"].numel())
                        or step(m, batch, *a))
    result = train(["--epochs", "3"], data, threshold=0.0, monkeypatch=monkeypatch)
    assert not result.compiled and len(result.train_losses) == 3 and np.isfinite(result.train_losses).all()
    # epoch 2's batches without the last (the compiled step's loader), its first one eager after the failure;
    # epoch 3 every batch again
    assert eager == [4, 4, 4, 3] + [4, 4, 4] + [4, 4, 4, 3]
    err = capfd.readouterr().err
    assert ("--compile auto: compiling the training step failed (RuntimeError: cannot trace a data-dependent "
            "branch); eager steps instead") in err
    with pytest.raises(RuntimeError, match="cannot trace a data-dependent branch"):
        train(["--epochs", "3", "--compile", "on"], data)

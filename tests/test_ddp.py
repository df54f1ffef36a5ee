import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, args, seconds: float = 300.0) -> None:
    """``mp.spawn`` of two replicas that fails, instead of hanging the test run, if they have not both finished
    within ``seconds``."""
    context = mp.spawn(fn, args=args, nprocs=2, join=False)
    deadline = time.monotonic() + seconds
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{fn.__name__}: the replicas did not finish within {seconds:.0f} s")


def count_wrappers_at_teardown() -> list:
    """Patch ``dist.destroy_process_group`` to note, at each call, how many DDP wrappers are alive; returns the
    notes. A wrapper holds the process group: one freed after the teardown (as its function returns, the other
    processes maybe gone) tears the group down outside ``destroy_process_group``, where gloo can wait for ever."""
    import gc

    notes, destroy = [], dist.destroy_process_group

    def counted(*args, **kwargs):
        gc.collect()
        notes.append(sum(isinstance(o, torch.nn.parallel.DistributedDataParallel) for o in gc.get_objects()))
        return destroy(*args, **kwargs)

    dist.destroy_process_group = counted
    return notes


def train_replica(rank: int, world_size: int, port: int, folder: str) -> None:
    """One torchrun-like process: the example's --ddp training, then its weights written to ``folder``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    sys.path.insert(0, str(EXAMPLES))
    import molecules

    args = molecules.parse_args(["--ddp", "--smoke", "--device", "cpu", "--quiet", "--out", f"{folder}/parity.png"])
    wrappers = count_wrappers_at_teardown()
    model, metrics = molecules.train(args)
    torch.save({"state_dict": model.state_dict(), "metrics": metrics, "wrappers": wrappers}, f"{folder}/rank{rank}.pt")


@pytest.mark.slow
def test_ddp_replicas_hold_identical_weights(tmp_path):
    spawn(train_replica, (2, free_port(), str(tmp_path)))
    replicas = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    assert all(r["metrics"]["world_size"] == 2 for r in replicas)
    assert [r["wrappers"] for r in replicas] == [[0], [0]]  # the group torn down once, no DDP wrapper left

    sys.path.insert(0, str(EXAMPLES))
    import molecules

    torch.manual_seed(0)  # the example's seed: the weights every replica started from
    initial = molecules.build_model(molecules.parse_args(["--smoke"])).state_dict()
    first, second = replicas[0]["state_dict"], replicas[1]["state_dict"]
    assert first.keys() == second.keys() == initial.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name
    assert any(not torch.equal(first[name], initial[name]) for name in first)  # they did train


def test_ddp_shards_differ():
    from torch.utils.data import DistributedSampler

    data = list(range(8))
    shards = [list(DistributedSampler(data, 2, rank, shuffle=True, seed=0)) for rank in range(2)]
    assert sorted(shards[0] + shards[1]) == data  # every structure once per epoch, each on one replica


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not on PATH")
def test_torchrun_launch(tmp_path):
    # the e3attn of this checkout, not whichever one is installed (torchrun's workers start in tmp_path)
    path = [str(EXAMPLES.parent)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(path))
    command = ["torchrun", "--nproc_per_node", "2", "--master_port", str(free_port()), str(EXAMPLES / "molecules.py"),
               "--ddp", "--smoke", "--device", "cpu", "--quiet", "--out", str(tmp_path / "parity.png")]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "held-out" in done.stdout and (tmp_path / "parity.png").exists()


def train_command_replica(rank: int, world_size: int, port: int, folder: str, data: str) -> None:
    """One torchrun-like process of ``e3attn-train --ddp``; its metrics written to ``folder``."""
    import json

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from e3attn.train import cli

    wrappers = count_wrappers_at_teardown()
    metrics = cli.main(["--train-file", data, "--test-file", data, "--ddp", "--save", f"{folder}/model.pt",
                        "--hidden", "8x0e + 4x1o", "--heads", "2", "--epochs", "2", "--batch-size", "2",
                        "--device", "cpu", "--quiet", "--valid-fraction", "0.25"])
    with open(f"{folder}/rank{rank}.json", "w") as file:
        json.dump(dict(metrics, wrappers=wrappers), file)


@pytest.mark.slow
def test_training_command_under_ddp(tmp_path):
    import json

    from ase.calculators.emt import EMT
    from ase.calculators.singlepoint import SinglePointCalculator
    from ase.cluster import Icosahedron
    from ase.io import write

    from e3attn.calculator import E3AttnCalculator

    frames = []
    for seed in range(8):
        atoms = Icosahedron("Cu", 2)
        atoms.rattle(0.1, seed=seed)
        atoms.calc = EMT()
        atoms.calc = SinglePointCalculator(atoms, energy=atoms.get_potential_energy(), forces=atoms.get_forces())
        frames.append(atoms)
    write(tmp_path / "data.xyz", frames)
    spawn(train_command_replica, (2, free_port(), str(tmp_path), str(tmp_path / "data.xyz")))
    first, second = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert first["world_size"] == second["world_size"] == 2 and first["epochs"] == second["epochs"] == 2
    assert first["best_epoch"] == second["best_epoch"]  # the validation losses are synchronised
    assert "test" in first and "test" not in second  # rank 0 evaluates and writes
    assert first["wrappers"] == second["wrappers"] == [0]  # the group torn down once, no DDP wrapper left
    assert E3AttnCalculator.from_checkpoint(tmp_path / "model.pt").species == ["Cu"]


def _water_samples(count: int, seed: int):
    """``count`` displaced water molecules with random labels, float64."""
    from ase.build import molecule
    from ase.calculators.singlepoint import SinglePointCalculator

    from e3attn.train import to_sample

    gen = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(count):
        atoms = molecule("H2O")
        atoms.positions += 0.1 * torch.randn(3, 3, generator=gen, dtype=torch.float64).numpy()
        atoms.calc = SinglePointCalculator(atoms, energy=float(torch.randn(1, generator=gen, dtype=torch.float64)),
                                           forces=torch.randn(3, 3, generator=gen, dtype=torch.float64).numpy())
        samples.append(to_sample(atoms, ["H", "O"], 2.0))
    return samples


def validation_replica(rank: int, world_size: int, port: int, folder: str) -> None:
    """One process of a sharded validation: the loss of several validation sets, with and without ``ddp``."""
    import json

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.set_default_dtype(torch.float64)
    from e3attn.models import EquivariantTransformer
    from e3attn.train import fit_references
    from e3attn.train.loop import validation_loss

    torch.manual_seed(0)
    model = EquivariantTransformer("1x0e", "8x0e + 4x1o", "0e", 2.0, irreps_node_attr="2x0e", reduce="sum")
    losses = {}
    for count in (5, 37):  # one batch of 16 or fewer (the second process evaluates nothing); batches 16, 16, 5
        samples = _water_samples(count, seed=count)
        units = fit_references(samples, ["H", "O"])
        weights = {"force_weight": 10.0, "loss": "huber", "huber_delta": 0.5}
        losses[count] = [validation_loss(model, samples, units, "cpu", weights=weights, ddp=ddp) for ddp in (True, False)]
    dist.destroy_process_group()
    with open(f"{folder}/rank{rank}.json", "w") as file:
        json.dump(losses, file)


@pytest.mark.slow
def test_validation_shared_out_over_processes(tmp_path):
    import json

    spawn(validation_replica, (2, free_port(), str(tmp_path)))
    first, second = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    for count in ("5", "37"):
        sharded, whole = first[count]
        assert second[count][0] == sharded  # every process gets the same value (the best epoch alike)
        assert second[count][1] == whole
        assert whole > 0 and abs(sharded - whole) <= 1e-12 * whole

r"""The training loop: Adam, a learning-rate schedule over the epochs or the time budget, the best model by
validation loss, bfloat16 autocast, DistributedDataParallel under ``torchrun``, and a progress bar."""
from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
from typing import List, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from .compiled import CompiledStep, auto_compile, compile_setting
from .data import collate
from .model import evaluate, loss_fn, loss_options, predict, to_device

__all__ = ["FitResult", "WeightAverage", "adam", "fit", "init_distributed", "synced_max", "progress", "validation_loss"]


class _Fit(NamedTuple):
    train_losses: List[float]
    valid_losses: List[float]
    seconds: float
    best_epoch: int


class FitResult(_Fit):
    """What :func:`fit` did: the mean training loss and validation loss of every epoch (no validation: an empty
    list), the seconds taken, and the epoch (from 1) whose weights the model holds now; and, as an attribute (the
    tuple has the four fields above), ``compiled``: whether the steps ended compiled
    (:class:`~e3attn.train.compiled.CompiledStep`)."""

    compiled = False  # where a tuple method (_replace, _make) made the result

    def __new__(cls, train_losses: List[float], valid_losses: List[float], seconds: float, best_epoch: int,
                compiled: bool = False) -> "FitResult":
        result = super().__new__(cls, train_losses, valid_losses, seconds, best_epoch)
        result.compiled = compiled
        return result


def init_distributed(args: argparse.Namespace):
    """``(rank, world_size, device)``; with ``args.ddp``, joins the process group torchrun set up (nccl on GPUs,
    gloo on CPUs) and takes the GPU of ``LOCAL_RANK``."""
    device = torch.device(args.device)
    if not args.ddp:
        return 0, 1, device
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend)
    if device.type == "cuda":
        device = torch.device("cuda", dist.get_node_local_rank(fallback_rank=0))  # torchrun's LOCAL_RANK
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device


def synced_max(value: float, ddp: bool, device) -> float:
    """``value``, the largest over the processes with ``ddp`` (so that every replica takes the same decisions).

    Example::

        >>> synced_max(2.5, ddp=False, device="cpu")
        2.5
    """
    if not ddp:
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item()


def validation_loss(model: torch.nn.Module, samples: Sequence[dict], units: dict, device, amp: bool = False,
                    weights: Optional[dict] = None, ddp: bool = False, batch_size: int = 16) -> float:
    r"""The mean loss of :func:`~e3attn.train.evaluate` on ``samples`` (its batches of ``batch_size``), shared out
    with ``ddp``: process :math:`r` of :math:`W` evaluates the batches :math:`r, r + W, \dots` and the sums
    :math:`\sum_b n_b L_b` over the batches (:math:`n_b` structures, mean loss :math:`L_b`) are added up over
    the processes, so every process returns the same :math:`\sum_b n_b L_b / \sum_b n_b`, the value of one process
    evaluating them all (to the rounding of the sums), in :math:`1/W` of its time. Without ``ddp``, that value
    itself.

    Example::

        >>> from ase.build import molecule
        >>> from ase.calculators.singlepoint import SinglePointCalculator
        >>> from e3attn.models import EquivariantTransformer
        >>> from e3attn.train import evaluate, fit_references, to_sample
        >>> atoms = molecule("H2O")
        >>> atoms.calc = SinglePointCalculator(atoms, energy=-14.0, forces=torch.ones(3, 3).numpy())
        >>> samples = [to_sample(atoms, ["H", "O"], 2.0)] * 3
        >>> model = EquivariantTransformer("1x0e", "8x0e + 4x1o", "0e", 2.0, irreps_node_attr="2x0e", reduce="sum")
        >>> units = fit_references(samples, ["H", "O"])
        >>> validation_loss(model, samples, units, "cpu") == evaluate(model, samples, units, "cpu")["loss"]
        True
    """
    if len(samples) == 0:
        raise ValueError("samples: no structures to validate on (an empty validation set)")
    if not ddp:
        return evaluate(model, samples, units, device, amp, batch_size, weights)["loss"]
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = [samples[start : start + batch_size] for start in range(0, len(samples), batch_size)]
    # this process's batches, whole and in order: evaluate makes the same batches of them again
    mine = [sample for batch in batches[rank::world] for sample in batch]
    total = evaluate(model, mine, units, device, amp, batch_size, weights)["loss"] * len(mine) if mine else 0.0
    summed = torch.tensor([total], dtype=torch.float64, device=device)
    dist.all_reduce(summed)
    return summed.item() / len(samples)


def progress(args: argparse.Namespace, epochs_done: float, seconds: float, warmup: float = 0.0) -> float:
    """Fraction of the training done: of ``args.epochs``, or of ``args.time_budget`` when that runs out first; the
    first ``warmup`` seconds of the budget (a compiled step's tracing and compiling) count for neither.

    Example::

        >>> progress(argparse.Namespace(epochs=10, time_budget=100.0), epochs_done=2, seconds=50.0)
        0.5
        >>> progress(argparse.Namespace(epochs=10, time_budget=100.0), epochs_done=2, seconds=60.0, warmup=20.0)
        0.5
    """
    done = epochs_done / args.epochs
    if args.time_budget:
        done = max(done, (seconds - warmup) / max(args.time_budget - warmup, 1e-9))
    return min(done, 1.0)


class WeightAverage:
    r"""An exponential moving average of the parameters of ``module``: after every optimiser step
    :math:`\bar\theta \leftarrow d\,\bar\theta + (1 - d)\,\theta` (:meth:`update`); ``decay`` :math:`d = 0`
    keeps nothing and every method does nothing (the model's own weights are used).

    Example::

        >>> layer = torch.nn.Linear(1, 1, bias=False)
        >>> average = WeightAverage(layer, decay=0.5)
        >>> with torch.no_grad():
        ...     _ = layer.weight.fill_(1.0)
        >>> before = average.shadow[0].item()
        >>> average.update()
        >>> with average.swapped_in():
        ...     round(layer.weight.item(), 6) == round(0.5 * before + 0.5, 6)
        True
        >>> layer.weight.item()
        1.0
    """

    def __init__(self, module: torch.nn.Module, decay: float) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay!r}")
        self.decay = decay
        self.params = [p for p in module.parameters() if p.requires_grad] if decay else []
        self.shadow = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def update(self) -> None:
        """Move the average towards the current weights."""
        if self.params:
            torch._foreach_lerp_(self.shadow, [p.detach() for p in self.params], 1.0 - self.decay)

    @contextlib.contextmanager
    def swapped_in(self):
        """The module holds the averaged weights inside the ``with`` block, its own weights again after it."""
        saved = [p.detach().clone() for p in self.params]
        self.copy_to_model()
        try:
            yield
        finally:
            with torch.no_grad():
                for p, s in zip(self.params, saved):
                    p.copy_(s)

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Give the module the averaged weights."""
        for p, s in zip(self.params, self.shadow):
            p.copy_(s)


def _bar(epochs: int, disable: bool):
    try:
        from tqdm import tqdm
    except ImportError:  # the progress bar is optional
        return None
    return tqdm(total=epochs, desc="training", disable=disable)


def adam(model: torch.nn.Module, lr: float) -> torch.optim.Adam:
    """Adam over the trainable parameters of ``model``, fused into one kernel per step where PyTorch has one (all
    of them CPU or CUDA tensors): a few times faster than its loop over the parameters, a few percent of a CPU
    training step of a small model.

    Example::

        >>> adam(torch.nn.Linear(3, 2), 1e-2).defaults["fused"]
        True
    """
    params = [p for p in model.parameters() if p.requires_grad]
    fused = bool(params) and all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    return torch.optim.Adam(params, lr=lr, fused=fused)


def fit(model: torch.nn.Module, train_set: Sequence[dict], units: dict, args: argparse.Namespace, device,
        rank: int = 0, world: int = 1, valid_set: Optional[Sequence[dict]] = None) -> FitResult:
    r"""Train ``model`` (DDP-wrapped with ``args.ddp``) on ``train_set``; with ``valid_set``, it ends with the
    weights of the epoch of least validation loss.

    Adam (fused into one kernel per step for CPU and CUDA parameters, :func:`adam`) with the learning rate
    ``args.lr`` and the schedule ``args.schedule`` (cosine: :math:`\eta = \eta_0 (1 + \cos \pi t) / 2` with
    :math:`t` the fraction done of the epochs or of the time budget), batches of ``args.batch_size`` shuffled
    with ``args.seed``, the loss :func:`~e3attn.train.loss_fn` with the options that
    :func:`~e3attn.train.loss_options` reads from ``args`` (``args.force_weight``, ``args.energy_weight``, and where
    ``args`` has them ``args.stress_weight``, ``args.loss``, ``args.huber_delta``), for validation too. With
    ``args.time_budget`` no epoch starts that would not end within it (validation included). With ``args.ddp`` the
    processes share out the validation set (:func:`validation_loss`). With ``args.compile`` ``"on"`` (or ``True``)
    every step is one traced and compiled graph (:class:`~e3attn.train.compiled.CompiledStep`: the same loss and
    gradients, its first call of a batch shape tracing and compiling, within the budget; the cosine schedule runs
    over the rest of the budget), and the last, smaller batch of every epoch is left out (another shape, another
    compilation). With ``"auto"`` the first epoch runs eager steps, and the steps after it are compiled where
    :func:`~e3attn.train.compiled.auto_compile` finds that it pays (a CPU, at least
    :data:`~e3attn.train.compiled.AUTO_COMPILE_SECONDS` of training left in whole epochs); a step that cannot be
    traced then leaves the eager steps, with a line on standard error (a compiler that fails leaves the traced
    graph uncompiled, with a warning). ``"off"``, ``False`` or no
    ``args.compile``: eager steps. With ``args.ema``
    :math:`> 0` the validation, the model kept and the model returned are those of the moving average of the
    weights (:class:`WeightAverage`).

    Example::

        >>> from ase.build import molecule
        >>> from ase.calculators.singlepoint import SinglePointCalculator
        >>> from e3attn.models import EquivariantTransformer
        >>> from e3attn.train import fit_references, to_sample
        >>> atoms = molecule("H2O")
        >>> atoms.calc = SinglePointCalculator(atoms, energy=-14.0, forces=torch.ones(3, 3).numpy())
        >>> samples = [to_sample(atoms, ["H", "O"], 2.0)] * 4
        >>> model = EquivariantTransformer("1x0e", "8x0e + 4x1o", "0e", 2.0, irreps_node_attr="2x0e", reduce="sum")
        >>> args = argparse.Namespace(epochs=2, time_budget=0, batch_size=2, seed=0, lr=1e-2, schedule="cosine",
        ...     force_weight=3.0, energy_weight=1.0, amp=False, ddp=False, quiet=True)
        >>> result = fit(model, samples, fit_references(samples, ["H", "O"]), args, "cpu", valid_set=samples[:1])
        >>> len(result.train_losses), len(result.valid_losses), result.best_epoch in (1, 2)
        (2, 2, True)
    """
    sampler = DistributedSampler(train_set, world, rank, shuffle=True, seed=args.seed) if args.ddp else None
    module = getattr(model, "module", model)
    weights = loss_options(args)
    choice = compile_setting(args)
    generator = torch.Generator().manual_seed(args.seed)  # a new loader (compiled steps) continues its stream

    def batches(compiled: bool) -> DataLoader:
        # compiled: one graph per shape of batch, so the last, smaller batch of an epoch is left out
        return DataLoader(train_set, args.batch_size, shuffle=sampler is None, sampler=sampler, collate_fn=collate,
                          generator=generator, drop_last=compiled and len(train_set) > args.batch_size)

    compiled = CompiledStep(module, units, weights) if choice == "on" else None
    loader = batches(compiled is not None)
    optimizer = adam(model, args.lr)
    average = WeightAverage(module, getattr(args, "ema", 0.0))
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=3) \
        if args.schedule == "plateau" else None
    bar = _bar(args.epochs, disable=rank != 0 or args.quiet)
    losses, valid_losses, best = [], [], (math.inf, 0, None)
    start, epoch_time = time.perf_counter(), 0.0
    warmup = 0.0  # the compiled step's first call (tracing, compiling): the schedule runs over the rest of the budget
    traced = False
    for epoch in range(args.epochs):
        elapsed = synced_max(time.perf_counter() - start, args.ddp, device)
        if args.time_budget and epoch > 0 and elapsed + epoch_time > args.time_budget:
            break  # the next epoch would not finish within the budget
        if choice == "auto" and epoch == 1:  # decided on the first epoch's pace: the whole epochs left
            epochs_left = args.epochs - 1
            if args.time_budget:
                epochs_left = min(epochs_left, math.floor((args.time_budget - elapsed) / max(epoch_time, 1e-9)))
            reason = auto_compile(args, device, train_set, epochs_left * epoch_time)
            if reason is not None:
                _log(reason, bar, rank == 0 and not args.quiet)
                compiled, loader = CompiledStep(module, units, weights), batches(True)
        if compiled is None and loader.drop_last:  # compiling failed: every batch again
            loader = batches(False)
        if sampler is not None:
            sampler.set_epoch(epoch)
        model.train()
        total, first_call = 0.0, 0.0
        for step, batch in enumerate(loader):
            if args.schedule == "cosine":
                seconds = elapsed + first_call + step / len(loader) * epoch_time  # first_call: this epoch's compile
                done = progress(args, epoch + step / len(loader), seconds, warmup)
                for group in optimizer.param_groups:
                    group["lr"] = args.lr * 0.5 * (1.0 + math.cos(math.pi * done))
            batch = to_device(batch, device)
            optimizer.zero_grad()
            if compiled is not None and not traced:  # the first call traces and compiles
                first = time.perf_counter()
                try:
                    loss = compiled(batch)  # the gradients in the weights' .grad
                except Exception as err:
                    if choice == "on":
                        raise
                    # auto: a step that cannot be traced trains eagerly (a compiler's failure does not get here:
                    # the traced graph then runs uncompiled, e3attn._tracing.TracedGraphs)
                    first_call = time.perf_counter() - first  # not an epoch's time
                    message = (str(err).strip() or "no message").splitlines()[0]
                    _log(f"--compile auto: compiling the training step failed ({type(err).__name__}: {message}); "
                         "eager steps instead", bar, rank == 0)
                    compiled = None
                    optimizer.zero_grad()
                    loss = _eager_step(model, batch, units, args.amp, weights)
                else:
                    first_call = warmup = synced_max(time.perf_counter() - first, args.ddp, device)
                    traced = True
            elif compiled is not None:
                loss = compiled(batch)
            else:
                loss = _eager_step(model, batch, units, args.amp, weights)
            optimizer.step()
            average.update()
            total += loss.item()
        losses.append(total / len(loader))
        if plateau is not None:
            plateau.step(synced_max(losses[-1], args.ddp, device))
        if valid_set:
            with average.swapped_in():
                valid_losses.append(validation_loss(module, valid_set, units, device, args.amp, weights, args.ddp))
                if valid_losses[-1] < best[0]:
                    best = (valid_losses[-1], epoch + 1, {k: v.detach().clone() for k, v in module.state_dict().items()})
        # the next epoch's time, as this one's without the compiled step's first call (tracing, compiling)
        epoch_time = synced_max(time.perf_counter() - start, args.ddp, device) - elapsed - first_call
        if bar is not None:
            bar.update()
            bar.set_postfix(loss=f"{losses[-1]:.3e}", **({"valid": f"{valid_losses[-1]:.3e}"} if valid_set else {}))
    if bar is not None:
        bar.close()
    if best[2] is not None:
        module.load_state_dict(best[2])
    else:
        average.copy_to_model()
    return FitResult(losses, valid_losses, time.perf_counter() - start, best[1] if best[2] is not None else len(losses),
                     compiled is not None)


def _eager_step(model: torch.nn.Module, batch: dict, units: dict, amp: bool, weights: dict) -> torch.Tensor:
    """The loss of ``batch``, its gradients in the weights' ``.grad`` (autograd, forces' second derivative included)."""
    loss = loss_fn(predict(model, batch, units, amp, create_graph=True), batch, units, **weights)
    loss.backward()
    return loss


def _log(line: str, bar, show: bool) -> None:
    """``line`` on standard error (above the progress bar where there is one), where ``show``."""
    if show:
        (bar.write if bar is not None else print)(line, file=sys.stderr)

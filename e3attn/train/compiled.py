r"""A force-training step traced into one graph and compiled: the loss and its weight gradients in one call."""
from __future__ import annotations

import argparse
import contextlib
from typing import List, Optional, Sequence, Tuple

import torch

from .._checks import check_batch, check_edge_index, check_pos
from .._tracing import TracedGraphs, edges_sorted_by_caller, sorted_by_destination, weights_as_inputs
from ..kernels.segment_checks import arguments_checked_by_caller
from .model import loss_fn, predict

__all__ = ["CompiledStep", "AUTO_COMPILE_SECONDS", "compile_setting", "auto_compile"]

AUTO_COMPILE_SECONDS = 400.0
"""``--compile auto`` compiles the steps where the training left after the first epoch would take at least this
many seconds in eager steps. The first compiled call takes 160 to 190 s with an empty inductor cache (the training
command's model, a 2-core AMD EPYC, Zen 3) and the steps after it are 1.8 to 1.9 times as fast (its model of degree
1: 2.1 to 2.3 times), so compiling pays from about 340 s (a first call of 160 s, steps 1.9 times as fast) to 430 s
(190 s, 1.8 times) of training on; near 400 s, compiling or not makes little difference."""


class CompiledStep:
    r"""The loss of a force-training step and its gradients in the weights, traced and compiled as one graph.

    For a batch, :func:`~e3attn.train.loss_fn` of :func:`~e3attn.train.predict` with the forces
    :math:`F = -\partial E / \partial x` (``create_graph``: the loss depends on them) and the gradients
    :math:`\partial L / \partial \theta` of the loss in every trainable weight :math:`\theta`: the same values as
    ``loss.backward()`` after :func:`~e3attn.train.predict` (to rounding), which a call of the step writes into the
    weights' ``.grad``, for an optimiser to step.

    ``torch.compile`` of a model stops at the second derivative that training on forces needs (aot_autograd has
    no double backward). Here ``make_fx`` records the whole step instead, autograd's engine running the forces'
    derivative and the loss's backward on its proxies, so that one graph holds the forward pass, the forces and
    the weight gradients; ``torch.compile`` (``backend``, default inductor) then compiles it as a plain function,
    with symbolic sizes. e3attn traces its value-free branches meanwhile
    (:func:`~e3attn._tracing.traced_step`), and the layer's node kernels stay in the graph as its operators.
    One graph serves every batch of the same number of structures whose sizes (atoms, edges) meet the guards of
    its trace (:class:`~e3attn._tracing.TracedGraphs`): batches of one molecule with varying numbers of edges
    share it. A batch of another number of structures is traced and compiled anew (tens of seconds to minutes on
    a CPU), so the training command drops the last, smaller batch of each epoch. A call checks the batch's values
    as the model does in eager mode (finite positions, the edges' node indices in range), and the graph's node
    kernels then take their arguments as checked
    (:func:`~e3attn.kernels.segment_checks.arguments_checked_by_caller`). It also tests whether a CPU batch's edges
    are sorted by destination (:func:`~e3attn._tracing.sorted_by_destination`), as :func:`~e3attn.train.collate`
    gives them: those of sorted batches run a graph traced without the layers' sort of the edges
    (:func:`~e3attn._tracing.edges_sorted_by_caller`), other batches a graph of their own that sorts them.
    Float32 and float64; no stress, no autocast.

    Args:
        model: the energy model (an :class:`~e3attn.models.EquivariantTransformer`, not DDP-wrapped).
        units: the energy units of :func:`~e3attn.train.fit_references`.
        weights: the keyword arguments of :func:`~e3attn.train.loss_fn` (:func:`~e3attn.train.loss_options`).
        backend: the ``torch.compile`` backend, or ``None`` to run the traced graph as it is.

    Example::

        >>> from ase.build import molecule
        >>> from ase.calculators.singlepoint import SinglePointCalculator
        >>> from e3attn.models import EquivariantTransformer
        >>> from e3attn.train import collate, fit_references, to_sample
        >>> atoms = molecule("H2O")
        >>> atoms.calc = SinglePointCalculator(atoms, energy=-14.0, forces=torch.ones(3, 3).numpy())
        >>> batch = collate([to_sample(atoms, ["H", "O"], 2.0)] * 2)
        >>> model = EquivariantTransformer("1x0e", "4x0e + 2x1o", "0e", 2.0, irreps_node_attr="2x0e", reduce="sum")
        >>> step = CompiledStep(model, fit_references([to_sample(atoms, ["H", "O"], 2.0)], ["H", "O"]),
        ...                     {"force_weight": 10.0}, backend=None)
        >>> loss = step(batch)
        >>> loss.shape, model.output.weight.grad is not None
        (torch.Size([]), True)
    """

    def __init__(self, model: torch.nn.Module, units: dict, weights: dict, backend: "str | None" = "inductor") -> None:
        self.params, self._loss = weights_as_inputs(
            model, lambda m, batch: loss_fn(predict(m, batch, units, create_graph=True), batch, units, **weights),
            trainable_only=True)
        self.backend = backend
        self._sorted_edges = True  # whether sorted batches run without the layers' sort (False: a benchmark's)
        self.graphs = TracedGraphs(self._step, num_graphs=lambda params, batch: batch["num_atoms"].numel(),
                                   backend=backend)

    def _step(self, params: List[torch.Tensor], batch: dict) -> Tuple[torch.Tensor, ...]:
        with torch.enable_grad():  # traced with the derivatives; the graph runs without autograd
            loss = self._loss(params, batch)
            return (loss.detach(), *torch.autograd.grad(loss, params, allow_unused=True))

    def __call__(self, batch: dict) -> torch.Tensor:
        """The loss of ``batch`` (detached); the gradients go to the weights' ``.grad`` (``None`` for weights the
        batch does not reach, e.g. the attention's without edges, as after ``loss.backward()``)."""
        if "stress" in batch:
            raise ValueError("batch: a compiled step trains on energies and forces, not stress")
        # the graph checks no values (traced without them): the batch's here, once, and its operators none
        check_pos(batch["pos"])
        check_edge_index(batch["edge_index"], batch["pos"].shape[0])
        check_batch(batch["batch"], batch["pos"].shape[0])
        ordered = self._sorted_edges and sorted_by_destination(batch["edge_index"][1])
        params = [p.detach().requires_grad_(True) for p in self.params]
        with torch.no_grad(), arguments_checked_by_caller(), (
                edges_sorted_by_caller() if ordered else contextlib.nullcontext()):
            loss, *grads = self.graphs(params, batch)
        for p, g in zip(self.params, grads):
            p.grad = g
        return loss


def compile_setting(args: argparse.Namespace) -> str:
    """``"on"``, ``"off"`` or ``"auto"``: ``args.compile`` (``True``/``False`` read as on/off; absent: off).

    Example::

        >>> compile_setting(argparse.Namespace(compile=True)), compile_setting(argparse.Namespace())
        ('on', 'off')
    """
    choice = getattr(args, "compile", False)
    if isinstance(choice, bool):
        choice = "on" if choice else "off"
    if choice not in ("on", "off", "auto"):
        raise ValueError(f"args.compile must be 'auto', 'on', 'off' or a bool, got {choice!r}")
    return choice


def auto_compile(args: argparse.Namespace, device, train_set: Sequence[dict], seconds_left: float) -> Optional[str]:
    """Why ``--compile auto`` compiles the steps from now on (a line for the log), or ``None`` where it does not:
    it compiles on a CPU, without DDP nor autocast, on energies and forces (no stress), where the training left,
    ``seconds_left`` of eager steps, is at least :data:`AUTO_COMPILE_SECONDS`. Not on CUDA, where the compiled
    step has not been measured against the eager kernels.

    Example::

        >>> args = argparse.Namespace(ddp=False, amp=False)
        >>> auto_compile(args, "cpu", [{}], seconds_left=60.0) is None
        True
        >>> auto_compile(args, "cpu", [{}], seconds_left=600.0)
        '--compile auto: compiling the training step (600 s of eager steps left; the first compiled one takes minutes)'
    """
    if torch.device(device).type != "cpu" or getattr(args, "ddp", False) or getattr(args, "amp", False):
        return None
    if any("stress" in sample for sample in train_set) or not seconds_left >= AUTO_COMPILE_SECONDS:
        return None
    return (f"--compile auto: compiling the training step ({seconds_left:.0f} s of eager steps left; the first "
            "compiled one takes minutes)")

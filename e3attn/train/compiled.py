r"""A force-training step traced into one graph and compiled: the loss and its weight gradients in one call."""
from __future__ import annotations

from typing import Callable, Dict, Tuple

import torch

from .._tracing import traced_step
from .model import loss_fn, predict

__all__ = ["CompiledStep"]


class _Loss(torch.nn.Module):
    """The loss of a batch as a module of the model's parameters (for ``torch.func.functional_call``)."""

    def __init__(self, model: torch.nn.Module, units: dict, weights: dict) -> None:
        super().__init__()
        self.model, self.units, self.weights = model, units, weights

    def forward(self, batch: dict) -> torch.Tensor:
        return loss_fn(predict(self.model, batch, self.units, create_graph=True), batch, self.units, **self.weights)


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
    One graph per number of structures per batch and per set of shapes (atoms, edges): a batch of another shape
    is traced and compiled anew (tens of seconds to minutes on a CPU), so the sizes of a data set's batches should
    repeat (e.g. molecules of one kind, the last, smaller batch of an epoch dropped). Float32 and float64; no
    stress, no autocast.

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
        self.loss = _Loss(model, units, weights)
        self.params = {f"model.{name}": p for name, p in model.named_parameters() if p.requires_grad}
        self.backend = backend
        self._graphs: Dict[Tuple, Callable] = {}

    def _trace(self, batch: dict) -> Callable:
        from torch.fx.experimental.proxy_tensor import make_fx

        names = list(self.params)

        def step(params, batch):
            loss = torch.func.functional_call(self.loss, dict(zip(names, params)), (batch,))
            return (loss.detach(), *torch.autograd.grad(loss, params))

        with traced_step(int(batch["num_atoms"].numel())):
            graph = make_fx(step, tracing_mode="symbolic", _allow_non_fake_inputs=True)(
                [p.detach().requires_grad_(True) for p in self.params.values()], batch)
        return graph if self.backend is None else torch.compile(graph, backend=self.backend, dynamic=True)

    def __call__(self, batch: dict) -> torch.Tensor:
        """The loss of ``batch`` (detached); the gradients go to the weights' ``.grad``."""
        if "stress" in batch:
            raise ValueError("batch: a compiled step trains on energies and forces, not stress")
        key = tuple(sorted((k, tuple(v.shape), v.dtype) for k, v in batch.items()))
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = self._trace(batch)
        with torch.no_grad():
            loss, *grads = graph([p.detach() for p in self.params.values()], batch)
        for p, g in zip(self.params.values(), grads):
            p.grad = g
        return loss

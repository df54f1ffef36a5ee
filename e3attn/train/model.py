r"""The energy model of the training command, its predictions in eV, the loss, and the errors on a data set."""
from __future__ import annotations

import argparse
import functools
import warnings
from typing import Optional, Sequence, Tuple

import torch

from ..models import EquivariantTransformer, energy_and_forces, energy_forces_stress
from .data import collate

__all__ = ["build_model", "check_model_options", "predict", "loss_fn", "loss_options", "evaluate", "to_device"]


def build_model(args: argparse.Namespace, num_species: int) -> EquivariantTransformer:
    """One energy per structure from one-hot elements (and ones) on the atoms, with the options of
    :func:`~e3attn.train.options.add_model_options` (``avg_num_neighbors`` a number by now).

    Example::

        >>> from e3attn.train.options import ArgumentParser, add_model_options
        >>> p = ArgumentParser("Train.")
        >>> add_model_options(p, avg_num_neighbors=10.0)
        >>> build_model(p.parse_args([]), num_species=3).irreps_node_attr
        3x0e
    """
    return EquivariantTransformer(
        "1x0e", args.hidden, "0e", args.max_radius, num_layers=args.layers, num_heads=args.heads, lmax=args.lmax,
        number_of_basis=args.basis_size, irreps_node_attr=f"{num_species}x0e", reduce="sum",
        radial_neurons=args.radial_neurons, density_channels=args.density, density_lmax=args.density_lmax,
        density_angular_channels=args.density_angular, avg_num_neighbors=args.avg_num_neighbors,
        layer_norm=args.layer_norm, basis=args.basis, self_connection=args.self_connection,
    )


def check_model_options(p: argparse.ArgumentParser, args: argparse.Namespace,
                        what: str = "the model options") -> None:
    """Stop with one line (``p.error``) when the options of :func:`build_model` in ``args`` build no model (e.g.
    ``--heads`` not a divisor of ``--hidden``'s multiplicities): a trial build before any data, warning nothing."""
    trial = argparse.Namespace(**{**vars(args), "avg_num_neighbors": 1.0})
    try:
        with warnings.catch_warnings():  # a trial: the run itself warns
            warnings.simplefilter("ignore")
            build_model(trial, num_species=1)
    except ValueError as err:
        p.error(f"{what} do not build a model: {err}")


def to_device(batch: dict, device) -> dict:
    """Every tensor of ``batch`` on ``device``."""
    return {k: v.to(device) for k, v in batch.items()}


def predict(model: torch.nn.Module, batch: dict, units: dict, amp: bool = False, create_graph: bool = False
            ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    r"""Energies (eV), forces (eV/Å) and, when the batch has a ``stress``, the stress (eV/Å³) of a batch.

    .. math:: E = s\,\hat E + \sum_i e_{z_i}, \qquad F = -\partial E / \partial x, \qquad
        \sigma = \frac{1}{V} \frac{\partial E}{\partial \varepsilon}

    with the scale :math:`s` and the references :math:`e_z` of ``units`` (:func:`~e3attn.train.fit_references`).

    Returns:
        ``(energy [B], forces [N, 3], stress [B, 3, 3] or None)``.

    Example::

        >>> from ase.build import molecule
        >>> from e3attn.train import collate, to_sample
        >>> model = EquivariantTransformer("1x0e", "8x0e + 4x1o", "0e", 2.0, irreps_node_attr="2x0e", reduce="sum")
        >>> batch = collate([to_sample(molecule("H2O"), ["H", "O"], 2.0, keys=None)])
        >>> units = {"species": ["H", "O"], "energy_references": [-1.0, -4.0], "energy_scale": 0.5}
        >>> energy, forces, stress = predict(model, batch, units)
        >>> energy.shape, forces.shape, stress
        (torch.Size([1]), torch.Size([3, 3]), None)
    """
    node_attr = torch.nn.functional.one_hot(batch["species"], len(units["species"])).to(batch["pos"].dtype)
    graph = dict(batch=batch["batch"], node_attr=node_attr, edge_index=batch["edge_index"], shifts=batch["shifts"],
                 cell=batch["cell"], create_graph=create_graph)
    stress = None
    with torch.autocast(batch["pos"].device.type, dtype=torch.bfloat16, enabled=amp):
        if "stress" in batch:
            energy, forces, stress = energy_forces_stress(model, batch["pos"], **graph)
        else:
            energy, forces = energy_and_forces(model, batch["pos"], **graph)
    dtype = batch["pos"].dtype  # that of the data, also when autocast computed in bfloat16
    refs = torch.tensor(units["energy_references"], dtype=dtype, device=energy.device)
    reference = torch.zeros_like(energy, dtype=dtype).index_add_(0, batch["batch"], refs[batch["species"]])
    scale = units["energy_scale"]
    stress = None if stress is None else scale * stress.to(dtype)
    return scale * energy.to(dtype) + reference, scale * forces.to(dtype), stress


def loss_fn(prediction: Tuple, batch: dict, units: dict, force_weight: float, energy_weight: float = 1.0,
            stress_weight: float = 1.0, loss: str = "mse", huber_delta: float = 0.01) -> torch.Tensor:
    r"""The mean penalty :math:`\rho` of the errors of the energy per atom, the force components and the virial
    per atom (with stress), all in units of the energy scale :math:`s`:

    .. math:: L = w_E \Big\langle \rho\Big(\frac{\Delta E}{n s}\Big) \Big\rangle
        + w_F \Big\langle \rho\Big(\frac{\Delta F}{s}\Big) \Big\rangle
        + w_\sigma \Big\langle \rho\Big(\frac{V \Delta\sigma}{n s}\Big) \Big\rangle

    with ``loss="mse"`` the square, :math:`\rho(x) = x^2`, and with ``loss="huber"`` the Huber penalty divided by
    :math:`\delta` (``huber_delta``): :math:`\rho(x) = x^2 / 2\delta` for :math:`|x| \le \delta`, else
    :math:`|x| - \delta / 2`, the absolute error smoothed within :math:`\delta`. The squares put the weight on
    the largest errors; the Huber penalty weighs every error beyond :math:`\delta` alike, as the mean absolute
    errors that the command reports do.

    Example::

        >>> batch = {"energy": torch.tensor([1.0]), "forces": torch.zeros(2, 3), "num_atoms": torch.tensor([2])}
        >>> loss_fn((torch.tensor([2.0]), torch.zeros(2, 3), None), batch, {"energy_scale": 0.5}, force_weight=3.0)
        tensor(1.)
        >>> loss_fn((torch.tensor([2.0]), torch.zeros(2, 3), None), batch, {"energy_scale": 0.5}, force_weight=3.0,
        ...         loss="huber", huber_delta=0.5)  # 1 - 0.5 / 2
        tensor(0.7500)
    """
    if loss == "mse":
        penalty = torch.square
    elif loss == "huber":
        if isinstance(huber_delta, bool) or not (isinstance(huber_delta, (int, float)) and huber_delta > 0):
            raise ValueError(f"huber_delta must be a positive number, got {huber_delta!r}")
        penalty = functools.partial(_huber, delta=float(huber_delta))
    else:
        raise ValueError(f"loss must be 'mse' or 'huber', got {loss!r}")
    energy, forces, stress = prediction
    scale = units["energy_scale"]
    atoms = batch["num_atoms"].to(energy.dtype)
    total = energy_weight * penalty((energy - batch["energy"]) / atoms / scale).mean()
    total = total + force_weight * penalty((forces - batch["forces"]) / scale).mean()
    if stress is not None:
        volume = torch.linalg.det(batch["cell"]).abs().to(stress.dtype)
        virial = (stress - batch["stress"]) * (volume / atoms)[:, None, None] / scale
        total = total + stress_weight * penalty(virial).mean()
    return total


def loss_options(args: argparse.Namespace) -> dict:
    """The keyword arguments of :func:`loss_fn` that the training options ``args`` set (the weights, the loss and
    its delta; the defaults of :func:`loss_fn` where ``args`` has none): what the training loop trains and
    validates with, and what the command reports as each split's loss.

    Example::

        >>> loss_options(argparse.Namespace(force_weight=10.0, energy_weight=1.0, loss="huber", huber_delta=0.01))
        {'force_weight': 10.0, 'energy_weight': 1.0, 'stress_weight': 1.0, 'loss': 'huber', 'huber_delta': 0.01}
    """
    return dict(force_weight=args.force_weight, energy_weight=args.energy_weight,
                stress_weight=getattr(args, "stress_weight", 1.0), loss=getattr(args, "loss", "mse"),
                huber_delta=getattr(args, "huber_delta", 0.01))


def _huber(x: torch.Tensor, delta: float) -> torch.Tensor:
    """The Huber penalty of ``x`` divided by ``delta``, elementwise."""
    return torch.nn.functional.huber_loss(x, torch.zeros_like(x), reduction="none", delta=delta) / delta


def evaluate(model: torch.nn.Module, samples: Sequence[dict], units: dict, device, amp: bool = False,
             batch_size: int = 16, weights: Optional[dict] = None) -> dict:
    """Mean absolute errors on ``samples``: energy per atom (meV/atom), force components (meV/Å) and, when the
    samples have stress, stress components (meV/Å³), with the predictions (``true_*``, ``pred_*``) and the
    mean loss (``loss``, :func:`loss_fn` with the keyword arguments ``weights``, default a force weight of 3).

    Example::

        >>> from ase.build import molecule
        >>> from ase.calculators.singlepoint import SinglePointCalculator
        >>> from e3attn.train import to_sample
        >>> atoms = molecule("H2O")
        >>> atoms.calc = SinglePointCalculator(atoms, energy=-10.0, forces=torch.zeros(3, 3).numpy())
        >>> model = EquivariantTransformer("1x0e", "8x0e + 4x1o", "0e", 2.0, irreps_node_attr="2x0e", reduce="sum")
        >>> units = {"species": ["H", "O"], "energy_references": [-2.0, -6.0], "energy_scale": 1e-9}
        >>> round(evaluate(model, [to_sample(atoms, ["H", "O"], 2.0)], units, "cpu")["energy_mae_meV_per_atom"], 3)
        0.0
    """
    model.eval()
    pairs = {"energy": ([], []), "forces": ([], []), "stress": ([], [])}
    total = 0.0
    for start in range(0, len(samples), batch_size):
        batch = to_device(collate(samples[start : start + batch_size]), device)
        prediction = predict(model, batch, units, amp)
        total += loss_fn(prediction, batch, units, **(weights or {"force_weight": 3.0})).item() * batch["num_atoms"].numel()
        n = batch["num_atoms"].to(prediction[0].dtype)
        for (key, (true, pred)), value in zip(pairs.items(), prediction):
            if value is not None:
                true.append((batch[key] / n if key == "energy" else batch[key]).flatten())
                pred.append((value.detach() / n if key == "energy" else value.detach()).flatten())
    out = {"loss": total / len(samples), "num_structures": len(samples)}
    units_of = {"energy": "meV_per_atom", "forces": "meV_per_A", "stress": "meV_per_A3"}
    for key, (true, pred) in pairs.items():
        if true:
            out[f"true_{key}"], out[f"pred_{key}"] = torch.cat(true).double().cpu(), torch.cat(pred).double().cpu()
            name = "force" if key == "forces" else key
            out[f"{name}_mae_{units_of[key]}"] = 1000 * (out[f"pred_{key}"] - out[f"true_{key}"]).abs().mean().item()
    return out


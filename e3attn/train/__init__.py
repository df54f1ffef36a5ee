r"""Train an :class:`~e3attn.models.EquivariantTransformer` potential on energies, forces and stress from files.

The command ``e3attn-train`` (``python -m e3attn.train``, :mod:`e3attn.train.cli`) reads any files ASE reads,
fits a reference energy per element, trains within a number of epochs or a time budget, keeps the model of least
validation loss and writes a checkpoint that :meth:`e3attn.calculator.E3AttnCalculator.from_checkpoint` reads.
Its parts are importable for your own scripts (``examples/molecules.py`` uses them):

* ``e3attn.train.data``: structures as tensors with their graphs, batches, reference energies;
* ``e3attn.train.model``: the energy model, predictions in eV, the loss, errors on a data set;
* ``e3attn.train.loop``: the training loop (schedule, budget, best model, AMP, DDP, progress bar);
* :mod:`e3attn.train.options`: the command-line options shared with the examples.

Reading files needs ASE (``pip install 'e3attn[train]'``: ASE, tqdm for the progress bar, PyYAML for ``--config``).
"""
from .data import DataError, LabelKeys, collate, fit_references, read_structures, to_sample
from .loop import FitResult, WeightAverage, adam, fit, init_distributed, validation_loss
from .model import build_model, check_model_options, evaluate, loss_fn, loss_options, predict

__all__ = [
    "DataError", "LabelKeys", "collate", "fit_references", "read_structures", "to_sample",
    "FitResult", "WeightAverage", "adam", "fit", "init_distributed", "build_model", "check_model_options", "evaluate",
    "loss_fn", "loss_options", "predict", "validation_loss",
]

r"""Save and load models with their configuration: a checkpoint rebuilds the model on its own."""
from __future__ import annotations

import os
from typing import Any, Dict, Tuple, Union

import torch

from .transformer import EquivariantTransformer

__all__ = ["save_checkpoint", "load_checkpoint"]

_MODELS = {"EquivariantTransformer": EquivariantTransformer}
_FORMAT = "e3attn.models.checkpoint/1"
PathLike = Union[str, "os.PathLike[str]"]


def save_checkpoint(model: torch.nn.Module, path: PathLike, **extra: Any) -> None:
    r"""Write the model's class, configuration, dtype and ``state_dict`` (and ``extra``) to ``path``.

    A ``DistributedDataParallel`` (or any wrapper with ``.module``) is unwrapped. ``extra``
    holds whatever else prediction needs (normalisation constants, species, metrics):
    tensors, numbers, strings, and lists/dicts of them, since :func:`load_checkpoint`
    reads with ``torch.load(weights_only=True)``.

    .. math:: \text{checkpoint} = (\text{class}, \text{config}, \text{dtype}, \theta, \text{extra})

    Example::

        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "model.pt")
        >>> model = EquivariantTransformer("1x0e", "8x0e + 2x1o", "0e", 1.5, reduce="sum")
        >>> save_checkpoint(model, path, energy_scale=0.3)
        >>> loaded, extra = load_checkpoint(path)
        >>> extra
        {'energy_scale': 0.3}
    """
    model = getattr(model, "module", model)
    name = type(model).__name__
    if name not in _MODELS or not hasattr(model, "config"):
        raise ValueError(f"model must be one of {sorted(_MODELS)} (possibly wrapped), got {name}")
    dtype = next(model.parameters()).dtype
    torch.save(
        {
            "format": _FORMAT,
            "class": name,
            "config": dict(model.config),
            "dtype": str(dtype).replace("torch.", ""),
            "state_dict": model.state_dict(),
            "extra": extra,
        },
        path,
    )


def load_checkpoint(path: PathLike, map_location: Union[str, torch.device] = "cpu") -> Tuple[torch.nn.Module, Dict[str, Any]]:
    r"""Rebuild the model saved by :func:`save_checkpoint`, in its saved dtype, and return it with the extras.

    The model is returned in evaluation mode on ``map_location``.

    .. math:: \text{model} = \text{class}(\text{config}).\mathrm{load\_state\_dict}(\theta)

    Returns:
        ``(model, extra)``.

    Raises:
        ValueError: when ``path`` is not such a checkpoint.

    Example::

        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "model.pt")
        >>> save_checkpoint(EquivariantTransformer("1x0e", "8x0e + 2x1o", "0e", 1.5), path)
        >>> model, extra = load_checkpoint(path)
        >>> model.training, extra
        (False, {})
    """
    checkpoint = torch.load(path, map_location=map_location, weights_only=True)
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != _FORMAT:
        raise ValueError(f"path {os.fspath(path)!r} is not a checkpoint written by e3attn.models.save_checkpoint")
    model = _MODELS[checkpoint["class"]](**checkpoint["config"])
    model = model.to(device=map_location, dtype=getattr(torch, checkpoint["dtype"]))
    model.load_state_dict(checkpoint["state_dict"])
    return model.eval(), checkpoint["extra"]

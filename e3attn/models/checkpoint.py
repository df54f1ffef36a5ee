r"""Save and load models with their configuration: a checkpoint rebuilds the model on its own.

A checkpoint holds plain data only (tensors, numbers, strings, and lists, tuples and dicts of
them), so :func:`load_checkpoint` reads it with ``torch.load(weights_only=True)``; whatever
:func:`save_checkpoint` accepts, :func:`load_checkpoint` loads. SHA-256 digests of the weights and of
everything else (the model's class, configuration and dtype, and the extras) are stored with them and
checked at load, so a corrupted file is refused instead of predicting differently.
"""
from __future__ import annotations

import hashlib
import io
import os
import warnings
from typing import Any, Dict, Mapping, Tuple, Union

import numpy as np
import torch

from .._files import atomic_write
from .transformer import EquivariantTransformer

__all__ = ["save_checkpoint", "load_checkpoint"]

_MODELS = {"EquivariantTransformer": EquivariantTransformer}
_FORMAT = "e3attn.models.checkpoint/3"
_FORMAT_2 = "e3attn.models.checkpoint/2"  # the weights' digest only: still read, the rest unverified
_FORMAT_1 = "e3attn.models.checkpoint/1"  # before the digests: still read, nothing verified
_DIGESTS = {_FORMAT: ("weights_sha256", "content_sha256"), _FORMAT_2: ("weights_sha256",), _FORMAT_1: ()}
_KEYS = ("class", "config", "dtype", "state_dict", "extra")
_SCALARS = (type(None), bool, int, float, complex, str, bytes, torch.dtype)
_ACCEPTED = (
    "tensors, NumPy arrays and scalars, Python numbers, strings, bytes, None, torch dtypes, "
    "and lists, tuples and dicts (with str or int keys) of them"
)
PathLike = Union[str, "os.PathLike[str]"]


def _plain(value: Any, where: str) -> Any:
    """``value`` as data that ``torch.load(weights_only=True)`` reads back (NumPy converted), or a ValueError."""
    if isinstance(value, np.generic):  # before the Python types: np.float64 is a float subclass
        item = value.item()
        return _plain(item, where) if not isinstance(item, np.generic) else _long_double(value, where)
    if isinstance(value, np.ndarray):  # in native byte order, 0-d arrays staying 0-d
        native = np.array(value, dtype=value.dtype.newbyteorder("="), order="C")
        try:
            return torch.from_numpy(native)
        except TypeError:
            raise ValueError(f"{where} is a NumPy array of dtype {value.dtype}, which torch cannot hold") from None
    if type(value) in _SCALARS:
        return value
    if isinstance(value, torch.Tensor):
        return _tensor(value, where)
    if type(value) in (list, tuple):
        return type(value)(_plain(item, f"{where}[{i}]") for i, item in enumerate(value))
    if isinstance(value, dict):
        bad = [key for key in value if type(key) not in (str, int)]
        if bad:
            raise ValueError(f"{where} has a key {bad[0]!r} of type {type(bad[0]).__name__}: keys must be str or int")
        return {key: _plain(item, f"{where}[{key!r}]") for key, item in value.items()}
    raise ValueError(f"{where} is a {type(value).__module__}.{type(value).__qualname__}; checkpoints hold {_ACCEPTED}")


def _long_double(value: np.generic, where: str) -> Union[float, complex]:
    """A NumPy long double (whose ``item()`` is itself) as the Python number equal to it, or a ValueError."""
    number = complex(value) if np.iscomplexobj(value) else float(value)
    if not np.array_equal(value, number, equal_nan=True):
        raise ValueError(f"{where} is a NumPy {value.dtype} scalar that a Python {type(number).__name__} cannot "
                         f"hold exactly; convert it ({type(number).__name__}(value)) if the rounding is acceptable")
    return number


def _tensor(value: torch.Tensor, where: str) -> torch.Tensor:
    """``value`` detached, a subclass (``nn.Parameter`` too) as a plain tensor, or a ValueError when torch cannot
    store a subclass's data and read it back."""
    if type(value) is torch.Tensor:
        return value.detach()
    try:
        plain = value.as_subclass(torch.Tensor).detach()
        buffer = io.BytesIO()
        torch.save(plain, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception as err:  # wrapper subclasses without data of their own fail in many ways
        raise ValueError(f"{where} is a {type(value).__module__}.{type(value).__qualname__} (a tensor subclass) "
                         f"whose data cannot be stored as a plain tensor: {err}") from None
    return plain


def _weights_digest(state_dict: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 of every tensor's name, dtype, shape and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(state_dict):
        tensor = state_dict[name].detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{list(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def _content_digest(checkpoint: Mapping[str, Any]) -> str:
    """SHA-256 of the class, configuration, dtype and extras: each value with its type, in a fixed order (dict
    entries by key), tensors by dtype, shape and bytes."""
    digest = hashlib.sha256()

    def add(value: Any) -> None:
        digest.update(f"<{type(value).__name__}>".encode())
        if isinstance(value, torch.Tensor):
            tensor = value.detach()
            digest.update(f"{tensor.dtype}|{list(tensor.shape)}|{tensor.layout}|".encode())
            if tensor.device.type == "meta":  # no data
                return
            tensor = tensor.to_dense() if tensor.layout != torch.strided else tensor
            if tensor.is_quantized:  # its integers, and the parameters that map them to numbers
                per_tensor = tensor.qscheme() in (torch.per_tensor_affine, torch.per_tensor_symmetric)
                for item in ([tensor.q_scale(), tensor.q_zero_point()] if per_tensor else
                             [tensor.q_per_channel_scales(), tensor.q_per_channel_zero_points()]):
                    add(item)
                tensor = tensor.int_repr()
            flat = torch.empty(tensor.numel(), dtype=tensor.dtype)  # a plain copy, whatever the view's strides
            flat.copy_(tensor.resolve_conj().resolve_neg().reshape(-1))
            digest.update(flat.view(torch.uint8).numpy())
        elif isinstance(value, (list, tuple)):
            digest.update(f"{len(value)}|".encode())
            for item in value:
                add(item)
        elif isinstance(value, dict):
            digest.update(f"{len(value)}|".encode())
            for key in sorted(value, key=lambda k: (type(k).__name__, repr(k))):
                add(key)
                add(value[key])
        elif isinstance(value, float):
            digest.update(value.hex().encode())
        else:  # None, bool, int, complex, str, bytes, torch.dtype
            digest.update(repr(value).encode())

    for key in ("class", "config", "dtype", "extra"):
        add(checkpoint[key])
    return digest.hexdigest()


def _digest_or_none(checkpoint: Mapping[str, Any]):
    """The content digest of a loaded checkpoint, or None where its entries cannot be digested (damaged)."""
    try:
        return _content_digest(checkpoint)
    except Exception:  # a foreign or damaged file's entries: any failure means they are not what was saved
        return None


def save_checkpoint(model: torch.nn.Module, path: PathLike, **extra: Any) -> None:
    r"""Write the model's class, configuration, dtype, ``state_dict``, its digest (and ``extra``) to ``path``.

    A ``DistributedDataParallel`` (or any wrapper with ``.module``) is unwrapped. ``extra``
    holds whatever else prediction needs (normalisation constants, species, metrics):
    tensors, numbers, strings, ``None``, and lists, tuples and dicts of them. NumPy
    scalars become Python numbers (a long double only when a float holds it exactly),
    NumPy arrays tensors of the same shape (0-d included), and tensor subclasses
    (``nn.Parameter`` too) plain tensors; anything else is refused here, with the key
    named, before anything is written.

    The file is written atomically: to a new file in the same folder, flushed to disk,
    then renamed onto ``path``; if writing fails (a full disk, an interrupt), the new
    file is removed and a checkpoint already at ``path`` is left as it was. ``path`` may
    also be a binary file object, which is written directly.

    .. math:: \text{checkpoint} = (\text{class}, \text{config}, \text{dtype}, \theta, \text{extra},
        \mathrm{SHA256}(\theta), \mathrm{SHA256}(\text{class}, \text{config}, \text{dtype}, \text{extra}))

    Raises:
        ValueError: when the model is not one that checkpoints rebuild, or an
            entry of ``extra`` cannot be stored (naming it).

    Example::

        >>> import os, tempfile
        >>> import numpy as np
        >>> path = os.path.join(tempfile.mkdtemp(), "model.pt")
        >>> model = EquivariantTransformer("1x0e", "8x0e + 2x1o", "0e", 1.5, reduce="sum")
        >>> save_checkpoint(model, path, energy_scale=0.3, mae=np.float64(0.12))
        >>> loaded, extra = load_checkpoint(path)
        >>> extra
        {'energy_scale': 0.3, 'mae': 0.12}
    """
    model = getattr(model, "module", model)
    name = type(model).__name__
    if name not in _MODELS or not hasattr(model, "config"):
        raise ValueError(f"model must be one of {sorted(_MODELS)} (possibly wrapped), got {name}")
    state_dict = model.state_dict()
    checkpoint = {
        "format": _FORMAT,
        "class": name,
        "config": _plain(dict(model.config), "model.config"),
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "state_dict": state_dict,
        "weights_sha256": _weights_digest(state_dict),
        "extra": {key: _plain(value, f"extra {key!r}") for key, value in extra.items()},
    }
    checkpoint["content_sha256"] = _content_digest(checkpoint)
    if isinstance(path, (str, os.PathLike)):
        with atomic_write(path) as file:
            torch.save(checkpoint, file)
    else:  # a file object
        torch.save(checkpoint, path)


def load_checkpoint(path: PathLike, map_location: Union[str, torch.device] = "cpu") -> Tuple[torch.nn.Module, Dict[str, Any]]:
    r"""Rebuild the model saved by :func:`save_checkpoint`, in its saved dtype, and return it with the extras.

    The model is returned in evaluation mode on ``map_location``. ``path`` is a file's path or a
    binary file object (as :func:`save_checkpoint` writes to either). The file is read with
    ``torch.load(weights_only=True)`` (no code from the file runs), and the weights and the rest
    must match the digests stored with them (files of earlier versions: what they hold a digest of).

    .. math:: \text{model} = \text{class}(\text{config}).\mathrm{load\_state\_dict}(\theta),
        \qquad \mathrm{SHA256}(\theta) = \text{digest}

    Returns:
        ``(model, extra)``.

    Raises:
        ValueError: saying what is wrong when ``path`` is not such a checkpoint (not a
            torch file, another format, unknown class or dtype, missing entries,
            weights or other entries that do not match their digest, weights that do not fit
            the configuration).
        TypeError: when ``path`` is neither a path nor a readable file object.
        OSError: when the file cannot be opened.

    Example::

        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "model.pt")
        >>> save_checkpoint(EquivariantTransformer("1x0e", "8x0e + 2x1o", "0e", 1.5), path)
        >>> model, extra = load_checkpoint(path)
        >>> model.training, extra
        (False, {})
    """
    try:
        device = torch.device(map_location)
    except (RuntimeError, TypeError):
        raise ValueError(f"map_location must be a torch device such as 'cpu' or 'cuda:0', got {map_location!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"map_location is {device} but CUDA is not available")
    if isinstance(path, (str, os.PathLike)):
        where = f"{os.fspath(path)!r}"
        with open(path, "rb") as file:  # a missing or unreadable file raises its OSError here
            checkpoint = _read(file, where, device)
    elif callable(getattr(path, "read", None)):
        where = f"the file object {getattr(path, 'name', type(path).__name__)!r}"
        checkpoint = _read(path, where, device)
    else:
        raise TypeError(f"path must be a file path or a binary file object, got {type(path).__name__}")
    return _rebuild(checkpoint, where, device)


def _read(file: Any, where: str, device: torch.device) -> Any:
    try:
        return torch.load(file, map_location=device, weights_only=True)
    except Exception:  # torch raises many types for a file that is not a torch.save archive of plain data
        raise ValueError(
            f"{where} is not a checkpoint written by e3attn.models.save_checkpoint: "
            "torch.load(weights_only=True) cannot read it (not a torch file, truncated, or holding objects "
            "other than tensors and plain data)"
        ) from None


def _rebuild(checkpoint: Any, where: str, device: torch.device) -> Tuple[torch.nn.Module, Dict[str, Any]]:
    """The model and extras of a loaded checkpoint, or a ValueError saying what is wrong with it."""
    found = checkpoint.get("format") if isinstance(checkpoint, dict) else None
    if found not in _DIGESTS:
        detail = f"its format is {found!r}" if isinstance(found, str) else "it has no e3attn format tag"
        raise ValueError(f"{where} is not a checkpoint written by e3attn.models.save_checkpoint ({_FORMAT}): {detail}")
    if found == _FORMAT_1:
        warnings.warn(f"{where} was written by an older e3attn ({_FORMAT_1}) without a digest of its weights: "
                      "they are loaded unverified; save it again to add one", stacklevel=3)
    missing = [key for key in _KEYS + _DIGESTS[found] if key not in checkpoint]
    if missing:
        raise ValueError(f"{where} is a damaged checkpoint: it has no {', '.join(map(repr, missing))}")
    name, config, state_dict = checkpoint["class"], checkpoint["config"], checkpoint["state_dict"]
    if name not in _MODELS:
        raise ValueError(f"{where} holds a model of unknown class {name!r} (known: {sorted(_MODELS)})")
    dtype = getattr(torch, checkpoint["dtype"], None) if isinstance(checkpoint["dtype"], str) else None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{where} has an invalid dtype {checkpoint['dtype']!r} (expected e.g. 'float32')")
    if not isinstance(config, dict) or not isinstance(checkpoint["extra"], dict):
        raise ValueError(f"{where} is a damaged checkpoint: its config and extra must be dicts")
    if not isinstance(state_dict, dict) or not all(isinstance(t, torch.Tensor) for t in state_dict.values()):
        raise ValueError(f"{where} is a damaged checkpoint: its state_dict must map names to tensors")
    if "weights_sha256" in _DIGESTS[found] and _weights_digest(state_dict) != checkpoint["weights_sha256"]:
        raise ValueError(f"{where} is corrupted: its weights do not match the SHA-256 digest stored with them")
    if "content_sha256" in _DIGESTS[found] and _digest_or_none(checkpoint) != checkpoint["content_sha256"]:
        raise ValueError(f"{where} is corrupted: its class, config, dtype or extras do not match the SHA-256 "
                         "digest stored with them")
    try:
        model = _MODELS[name](**config)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where} has a config that does not build a {name}: {err}") from None
    model = model.to(device=device, dtype=dtype)
    try:
        model.load_state_dict(state_dict)
    except RuntimeError as err:
        raise ValueError(f"{where} has weights that do not fit its config: {err}") from None
    return model.eval(), checkpoint["extra"]

r"""``--config file.yaml``: a YAML mapping of option names (``train_file`` or ``train-file``) to values, read as
the same command-line options; options given on the command line win."""
from __future__ import annotations

import argparse
from typing import List

__all__ = ["config_arguments"]


def _options(parser: argparse.ArgumentParser) -> dict:
    """``{dest: action}`` of the parser's long options, without --help and --config."""
    return {a.dest: a for a in parser._actions
            if a.option_strings and a.dest not in ("help", "config") and a.option_strings[0].startswith("--")}


def config_arguments(parser: argparse.ArgumentParser, path: str) -> List[str]:
    r"""The command-line arguments equivalent to the YAML file ``path`` (a mapping of option names to values).

    ``true``/``false`` switch a flag (``amp: true`` is ``--amp``); ``null`` leaves the default. Raises
    :class:`ValueError` naming the file and the key that is not an option, or a malformed file.

    Example::

        >>> import os, tempfile
        >>> from e3attn.train.options import ArgumentParser, positive_int
        >>> p = ArgumentParser("Train.")
        >>> _ = p.add_argument("--batch-size", type=positive_int, default=8, help="structures per batch")
        >>> _ = p.add_argument("--amp", action="store_true", help="bfloat16")
        >>> path = os.path.join(tempfile.mkdtemp(), "train.yaml")
        >>> with open(path, "w") as f:
        ...     _ = f.write("batch_size: 4\namp: true\n")
        >>> config_arguments(p, path)
        ['--batch-size', '4', '--amp']
    """
    try:
        import yaml
    except ImportError:  # pragma: no cover - PyYAML is in the train extra
        raise ValueError("--config needs PyYAML: pip install pyyaml (or pip install 'e3attn[train]')") from None
    try:
        with open(path) as file:
            config = yaml.safe_load(file)
    except OSError as err:
        raise ValueError(f"--config: cannot read {path!r}: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise ValueError(f"--config: {path!r} is not YAML: {' '.join(str(err).split())}") from None
    if config is None:
        return []
    if not isinstance(config, dict):
        raise ValueError(f"--config: {path!r} must hold a mapping of option names to values, got {type(config).__name__}")
    options = _options(parser)
    argv: List[str] = []
    for key, value in config.items():
        dest = str(key).replace("-", "_")
        if dest not in options:
            raise ValueError(f"--config: {path!r} has the key {key!r}, which is not an option "
                             f"(options: {', '.join(sorted(options))})")
        action, flag = options[dest], options[dest].option_strings[0]
        if value is None:
            continue
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            if not isinstance(value, bool):
                raise ValueError(f"--config: {path!r}: {key} must be true or false, got {value!r}")
            argv += [flag] if value == isinstance(action, argparse._StoreTrueAction) else []
        elif isinstance(value, (list, dict)):
            raise ValueError(f"--config: {path!r}: {key} must be a single value, got {value!r}")
        else:
            argv += [flag, str(value).lower() if isinstance(value, bool) else str(value)]
    return argv

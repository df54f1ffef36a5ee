r"""Peers of the layer benchmark (``benchmarks/layer.py --peer NAME``): the e3nn guide's attention with its tensor
products on another library's kernels, what a user who wants speed builds today.

* ``oeq``: :class:`guide.GuideAttention` with its two tensor products (keys and values, per-edge weights from the
  radial networks) on OpenEquivariance's CUDA kernels (``openequivariance.TensorProduct`` of the same
  ``TPProblem``: irreps, instructions and path weights of e3nn's product, ``shared_weights=False``), the rest of the
  module unchanged. OpenEquivariance takes e3nn's weight layout, so the peer keeps the baseline's weights and its
  output is compared with the baseline's before timing (``peer_rel_diff``). e3nn's instructions hold the final
  coefficient :math:`c` of each path, normalisation included, while ``TPProblem`` normalises the path weights it is
  given and takes their square root: so it gets :math:`c^2` without normalisation (until 2026-11-29 it got
  :math:`c` with its default normalisation, which changed the output by 41-88 % at the same cost). On the large
  configuration of ``layer.py`` the output still differs (0.80 on an H200, 2026-11-29), not yet understood.

OpenEquivariance is not a dependency of e3attn: install it (``pip install openequivariance``, or its source
distribution unpacked on ``PYTHONPATH``); its extension compiles on the first import (about 2 minutes).
"""
from __future__ import annotations

import copy

import torch

PEERS = ("oeq",)


def oeq_instructions(tp: torch.nn.Module) -> list:
    """The instructions of the e3nn product ``tp`` for ``openequivariance.TPProblem`` without normalisation: each
    path's coefficient :math:`c` (e3nn's ``path_weight``, normalisation included) as :math:`c^2`, whose square root
    ``TPProblem`` takes."""
    return [(i.i_in1, i.i_in2, i.i_out, i.connection_mode, i.has_weight, i.path_weight ** 2) for i in tp.instructions]


def oeq_guide(baseline: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``baseline`` (a ``GuideAttention``) whose ``tp_k`` and ``tp_v`` run on OpenEquivariance."""
    import openequivariance as oeq

    peer = copy.deepcopy(baseline)
    for name in ("tp_k", "tp_v"):
        tp = getattr(peer, name)
        problem = oeq.TPProblem(tp.irreps_in1, tp.irreps_in2, tp.irreps_out, oeq_instructions(tp), shared_weights=False,
                                internal_weights=False, irrep_normalization="none", path_normalization="none")
        setattr(peer, name, oeq.TensorProduct(problem, torch_op=True))
    return peer


def build_peer(name: str, baseline: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """The peer ``name`` (one of :data:`PEERS`) of ``baseline``, on ``device``."""
    if name not in PEERS:
        raise ValueError(f"peer must be one of {', '.join(PEERS)}, got {name!r}")
    if device.type != "cuda":
        raise ValueError(f"the {name} peer runs on CUDA only, got --device {device.type}")
    return oeq_guide(baseline).to(device)

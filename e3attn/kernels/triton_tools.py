"""What the Triton kernels share (:mod:`e3attn.kernels.segments_triton`, :mod:`e3attn.kernels.nodes_triton`,
:mod:`e3attn.kernels.paths_triton`): tile sizes, the products' precision, the interpreter, and the choice of
tiles and warps by timing on the GPU (:func:`tuned`)."""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch
import triton

from .._env import env_flag

__all__ = ["AUTOTUNE", "tuned"]

#: whether the kernels' tiles and warps are chosen by timing on the GPU (``E3ATTN_TRITON_AUTOTUNE``, see :func:`tuned`)
AUTOTUNE = env_flag("E3ATTN_TRITON_AUTOTUNE", True)
_TUNE_IN_INTERPRETER = False  # the tests set it to run every choice in the interpreter


def tuned(key: List[str], sizes: Dict[str, str], choices: Sequence[Tuple[int, ...]]):
    """Decorate a Triton kernel so that its tile sizes (the constexprs named in ``sizes``, each bounded by the size
    argument it names) and its number of warps are chosen among ``choices`` (tuples of the tile sizes in the order
    of ``sizes``, then the warps) by timing them on the GPU, once per value of the ``key`` arguments and dtypes
    (``triton.autotune``: the first call with a new key runs each choice a few times). Tiles larger than their
    size are cut to it (at least 16). The choices tile the output only: each output's sum runs in the same order
    whichever is chosen. In Triton's interpreter, or with ``E3ATTN_TRITON_AUTOTUNE=0``, the first choice alone."""
    names = list(sizes)
    configs = [triton.Config(dict(zip(names, c[:-1])), num_warps=c[-1]) for c in choices]

    def fitted(configs, named_args, **kwargs):
        seen, out = set(), []
        single = not AUTOTUNE or (_interpreting() and not _TUNE_IN_INTERPRETER)
        for config in configs[: 1 if single else None]:
            blocks = {n: min(config.kwargs[n], _block(named_args[sizes[n]], 16, 1 << 30)) for n in names}
            if (tuple(blocks.values()), config.num_warps) not in seen:
                seen.add((tuple(blocks.values()), config.num_warps))
                out.append(triton.Config(blocks, num_warps=config.num_warps))
        return out

    def bench(fn, quantiles):  # a short timing: these kernels take microseconds to milliseconds
        import triton.testing

        return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)

    return triton.autotune(configs, key=key, prune_configs_by={"early_config_prune": fitted}, do_bench=bench)


def _precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision: IEEE unless float32 products may use TF32 (PyTorch's own switch)."""
    return "tf32" if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 else "ieee"


def _block(n: int, least: int, most: int) -> int:
    return max(least, min(most, triton.next_power_of_2(max(n, 1))))


def _interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1`` when it was imported)."""
    knobs = getattr(triton, "knobs", None)  # Triton >= 3.4
    return bool(knobs.runtime.interpret) if knobs is not None else env_flag("TRITON_INTERPRET", False)


def _check_interpretable(t: torch.Tensor) -> None:
    if t.device.type == "cpu" and not _interpreting():
        raise RuntimeError("the Triton kernels run CPU tensors only in Triton's interpreter: set TRITON_INTERPRET=1 "
                           "before importing e3attn (E3ATTN_KERNEL_BACKEND=triton does so where there is no GPU)")

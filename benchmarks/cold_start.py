r"""Cold and warm start of the layer's kernels: the first force-training step of a new process.

The layer's numba kernels on the CPU (:mod:`e3attn.kernels.segments`: ``node_pass`` and ``path_features``;
:mod:`e3attn.kernels.geometry`; the softmax of :mod:`e3attn.kernels.softmax_ops`) are compiled on first use, once
per dtype, and cached on disk. For each dtype this script runs three fresh processes that share an empty numba
cache directory (``NUMBA_CACHE_DIR``, a temporary folder, so the cache of the installed package is neither used
nor touched):

* ``cold``: the first process compiles the kernels (which serve the forward and every derivative)
  during its first force-training step of a small layer;
* ``warm``: the second process loads them from the cache;
* ``plain``: a third process runs the same step with the kernels off (``E3ATTN_FUSED_KERNELS=0``): its start-up
  cost is what the layer pays without them (PyTorch's first calls, and numba's set-up for the radius graph's
  cell list, which also runs on numba), so ``warm`` minus ``plain`` is the kernels' own share.

Each process reports the time of ``import e3attn``, of its first step and of a second step; the
start-up cost is the first step minus the second.

Usage::

    python benchmarks/cold_start.py                     # float32 and float64
    python benchmarks/cold_start.py --dtypes float32
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # this checkout's e3attn, for the options (the measured processes import their own)
    sys.path.insert(0, str(ROOT))

from e3attn._files import atomic_write  # noqa: E402
from e3attn.train import options as opt  # noqa: E402

CHILD = r"""
import json, sys, time
start = time.perf_counter()
import torch
import e3attn
imported = time.perf_counter() - start
torch.set_default_dtype(getattr(torch, sys.argv[1]))
torch.manual_seed(0)
layer = e3attn.EquivariantAttention("4x0e + 2x1o", "3x0e + 1x1o", "3x0e + 1x1o", "2x0e + 2x1o", max_radius=1.5)
pos, f = torch.randn(20, 3), layer.irreps_input.randn(20, -1)

def step():
    p = pos.clone().requires_grad_()
    energy = layer(f, p).pow(2).sum()
    forces = -torch.autograd.grad(energy, p, create_graph=True)[0]
    (energy ** 2 + forces.pow(2).sum()).backward()

times = []
for _ in range(2):
    start = time.perf_counter()
    step()
    times.append(time.perf_counter() - start)
print(json.dumps({"import_s": imported, "first_step_s": times[0], "second_step_s": times[1]}))
"""


def run_process(dtype: str, cache_dir: str, kernels: bool = True) -> dict:
    """One fresh process: its import and step times."""
    env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir, E3ATTN_FUSED_KERNELS="1" if kernels else "0",
               PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    done = subprocess.run([sys.executable, "-c", CHILD, dtype], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: Optional[Sequence[str]] = None) -> List[dict]:
    """Measure, print a line per (dtype, start), write the JSON."""
    p = opt.ArgumentParser(__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", nargs="+", choices=("float32", "float64"), default=["float32", "float64"])
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cold_start.json")
    args = p.parse_args(argv)
    opt.check_files(p, results={"--out": args.out})
    rows = []
    with tempfile.TemporaryDirectory(prefix="e3attn-numba-cache-") as cache_dir:
        for dtype in args.dtypes:
            for start in ("cold", "warm", "plain"):
                row = dict(run_process(dtype, cache_dir, kernels=start != "plain"), dtype=dtype, start=start)
                row["startup_s"] = row["first_step_s"] - row["second_step_s"]
                print(f"{dtype:>8} {start}: import {row['import_s']:.2f} s, first step {row['first_step_s']:.2f} s, "
                      f"second {1e3 * row['second_step_s']:.1f} ms, start-up cost {row['startup_s']:.2f} s", flush=True)
                rows.append(row)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(args.out, "w") as file:  # the old file whole or the new one
        json.dump(rows, file, indent=1)
    print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    main()

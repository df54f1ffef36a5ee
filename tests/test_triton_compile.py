"""The Triton kernels compile for a GPU (NVIDIA sm_90, the H100 and H200) without one.

Triton's interpreter (tests/test_triton.py) runs the kernels' arithmetic on CPU tensors, but it is not Triton's
compiler: code that the interpreter runs can still fail to compile for a GPU. Triton's wheel carries its own
``ptxas``, so every kernel of the Triton modules is compiled here to a GPU binary, in a process without the
interpreter, with the tiles it launches: each tuned choice as its sizes cut it (``tuned``), for small and large
sizes, each dtype and each product precision.
"""
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

_COMPILE_ALL = textwrap.dedent("""
    import os
    os.environ.pop("TRITON_INTERPRET", None)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction
    from e3attn.kernels import paths_triton, segments_triton

    # pointer arguments that are not of the data's dtype (the others are); every other argument is an int32
    INDEX = {"rowptr_ptr": "*i64", "index_ptr": "*i64", "start_ptr": "*i32", "a_cols_ptr": "*i32",
             "b_cols_ptr": "*i32"}
    # the constexprs that no tuned choice sets: each value the kernels' callers can pass
    FIXED = {
        "_segment_rows_kernel": [{"BLOCK_E": 16, "BLOCK_K": k} for k in (16, 32, 64)],
        "_segment_outer_kernel": [{"BLOCK_E": 16}],
        "_node_sum_kernel": [{"BLOCK_N": 32, "BLOCK_R": r, "BLOCK_C": c} for r in (16, 32) for c in (16, 32, 64)],
        "_coefficients_kernel": [{"GATHER": g, "BLOCK_C": c} for g in (True, False) for c in (8, 16, 32)],
    }
    SIZES = (1, 5, 20, 40, 100, 5000)  # what the tuned tiles are cut to: 16, 32, 64 and uncut
    target = GPUTarget("cuda", 90, 32)
    kernels = [k for module in (segments_triton, paths_triton) for k in vars(module).values()
               if isinstance(k, (Autotuner, JITFunction))]
    count = 0
    for kernel in kernels:
        fn = kernel.fn if isinstance(kernel, Autotuner) else kernel
        name = fn.fn.__name__
        if isinstance(kernel, Autotuner):  # the tiles launched: each choice as the sizes cut it
            cut = [kernel.early_config_prune(kernel.configs, dict.fromkeys(fn.arg_names, n)) for n in SIZES]
            launched = {(tuple(sorted(c.kwargs.items())), c.num_warps) for configs in cut for c in configs}
        else:
            launched = {((), 4)}
        for dtype in ("fp32", "fp64"):
            precisions = ([{"PRECISION": p} for p in (["ieee", "tf32"] if dtype == "fp32" else ["ieee"])]
                          if "PRECISION" in fn.arg_names else [{}])
            for fixed in FIXED[name]:
                for precision in precisions:
                    for tiles, warps in sorted(launched):
                        constants = {**fixed, **precision, **dict(tiles)}
                        signature = {a: "constexpr" if a in constants else INDEX.get(a, "*" + dtype)
                                     if a.endswith("_ptr") else "i32" for a in fn.arg_names}
                        source = ASTSource(fn, signature,
                                           constexprs={(fn.arg_names.index(k),): v for k, v in constants.items()})
                        try:
                            compiled = triton.compile(source, target=target, options={"num_warps": warps})
                        except Exception as error:
                            raise SystemExit(f"{name} {dtype} {constants} warps {warps}: {error}")
                        assert compiled.asm.get("cubin"), name
                        count += 1
    print(len(kernels), count)
""")


@pytest.mark.slow
def test_every_triton_kernel_compiles_for_sm90_with_the_tiles_it_launches():
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("this Triton has no NVIDIA backend")
    done = subprocess.run([sys.executable, "-c", _COMPILE_ALL], capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-3000:]
    kernels, compiled = map(int, done.stdout.split()[-2:])
    assert kernels == 4 and compiled > 200, done.stdout  # every kernel, many tiles each

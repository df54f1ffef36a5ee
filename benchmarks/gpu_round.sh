#!/usr/bin/env bash
# One round on a lent GPU machine (the device tool), prepared here so that it runs at once there.
#
#   bash benchmarks/gpu_round.sh prepare   # here: wheels the GPU machine lacks (vesin, ase) and OpenEquivariance's
#                                          # source distribution, into .whl/ (ignored by git; carry it)
#   bash benchmarks/gpu_round.sh run       # there (carry .whl): CUDA tests, examples on cuda, the layer benchmark
#                                          # with the guide, plain, Triton and OpenEquivariance rows, MD speed
#
# Results and logs go to $OUT (the device tool's folder) or benchmarks/results/gpu/.
set -uo pipefail
cd "$(dirname "$0")/.."
step="${1:-run}"

if [ "$step" = prepare ]; then
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
    mkdir -p .whl
    platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d .whl "vesin>=0.6.2,<0.7"
    python3 -m pip download -q --no-deps --only-binary=:all: -d .whl ase
    python3 -m pip download -q --no-deps --no-binary=:all: -d .whl/oeq openequivariance==0.7.0
    (cd .whl/oeq && for f in *.tar.gz; do tar xzf "$f"; done)
    ls -la .whl .whl/oeq
    exit 0
fi

out="${OUT:-benchmarks/results/gpu}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
oeq_src="$(ls -d .whl/oeq/openequivariance-*/ 2>/dev/null | head -1)"
export PYTHONPATH="/tmp/site:$PWD:${oeq_src}"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"

# OpenEquivariance compiles its extension on first import (under 2 minutes): in the background, meanwhile the tests
python3 -c "import openequivariance" > "$out/oeq_import.log" 2>&1 &
oeq_pid=$!

timeout 100 python3 -m pytest -q -x tests/test_triton.py tests/test_heads.py -m "cuda or not cuda" 2>&1 \
    | tee "$out/tests_triton.log" | tail -3
timeout 120 python3 -m pytest -q tests -m cuda 2>&1 | tee "$out/tests_cuda.log" | tail -3

wait "$oeq_pid"; tail -2 "$out/oeq_import.log"
peer=(--peer oeq)
python3 -c "import openequivariance" 2>/dev/null || peer=()
timeout 150 python3 benchmarks/layer.py --device cuda --forces --plain --cuda-kernels "${peer[@]}" --configs guide \
    --sizes 1000 10000 100000 --repeats 5 --max-gb 60 --out "$out/layer_guide.json" 2>&1 | tee "$out/layer_guide.log"
timeout 120 python3 benchmarks/layer.py --device cuda --forces --plain --cuda-kernels "${peer[@]}" --configs large \
    --sizes 1000 10000 --repeats 5 --max-gb 60 --out "$out/layer_large.json" 2>&1 | tee "$out/layer_large.log"
timeout 80 python3 benchmarks/md_speed.py --device cuda --calls 5 --repeats 3 --out "$out/md_speed.json" 2>&1 \
    | tee "$out/md_speed.log"
E3ATTN_CUDA_KERNELS=1 timeout 50 python3 examples/tetris.py --device cuda 2>&1 | tee "$out/tetris.log" | tail -3
E3ATTN_CUDA_KERNELS=1 timeout 70 python3 examples/molecules.py --device cuda --time-budget 30 2>&1 \
    | tee "$out/molecules.log" | tail -4

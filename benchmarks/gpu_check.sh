#!/usr/bin/env bash
# A short check on a lent GPU (the device tool) after changes, in about 5 minutes: the CUDA tests (the Triton
# kernels, the calculator's CUDA graphs; failures in tests.log), MD speed (the calculator's default: CUDA graphs on
# the Triton kernels; eager on the plain formulation; eager on the Triton kernels), the layer benchmark (guide and
# large, with the plain, Triton and OpenEquivariance rows) and the layer's force step by GPU time and host time per
# operation (profile.log). Parts can be named to run only those, in this order: tests md layer profile.
#
#   bash benchmarks/gpu_round.sh prepare    # here: the wheels the GPU machine lacks, into .whl/ (carry it)
#   bash benchmarks/gpu_check.sh            # there; logs and JSON in $OUT (or benchmarks/results/gpu/)
#   bash benchmarks/gpu_check.sh tests md   # there: only those parts
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results/gpu}"
mkdir -p "$out"
exec > >(tee "$out/log.txt") 2>&1
export PYTHONUNBUFFERED=1
start=$(date +%s)
step() { echo "== $(( $(date +%s) - start )) s: $*"; }
parts=" ${*:-tests md layer profile} "
part() { [[ "$parts" == *" $1 "* ]]; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
oeq_src="$(ls -d .whl/oeq/openequivariance-*/ 2>/dev/null | head -1)"
export PYTHONPATH="/tmp/site:$PWD:$PWD/${oeq_src}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
# OpenEquivariance compiles its extension on first import (under 2 minutes): in the background, meanwhile the rest
(python3 -c "import openequivariance" > /tmp/oeq_import.log 2>&1; echo "oeq import rc $?" >> /tmp/oeq_import.log) &
oeq_pid=$!

if part tests; then
step tests
# the first calls of the Triton kernels time their choices of tiles (E3ATTN_TRITON_AUTOTUNE): compiles, once per shape
timeout 240 python3 -m pytest -q -rf --tb=short tests/test_triton.py tests/test_neighbour_list.py \
    tests/test_shared_geometry.py -m "cuda or not cuda" -p no:cacheprovider > "$out/tests.log" 2>&1
tail -4 "$out/tests.log"
timeout 120 python3 -m pytest -q -rf --tb=short tests -m cuda -p no:cacheprovider >> "$out/tests.log" 2>&1
tail -3 "$out/tests.log"
fi

if part md; then
step md
md=(benchmarks/md_speed.py --device cuda --calls 5 --repeats 3)
timeout 50 python3 "${md[@]}" --out "$out/md_default.json" 2>&1 | tail -7  # cuda_graphs auto: Triton in graphs
timeout 50 python3 "${md[@]}" --cuda-graphs off --out /tmp/md_eager.json 2>&1 | tail -7
E3ATTN_CUDA_KERNELS=1 timeout 50 python3 "${md[@]}" --cuda-graphs off --out /tmp/md_kernels.json 2>&1 | tail -7
fi

if part layer; then
step layer; wait "$oeq_pid"; tail -1 /tmp/oeq_import.log
peer=(--peer oeq)
python3 -c "import openequivariance" 2>/dev/null || peer=()
layer=(benchmarks/layer.py --device cuda --forces --plain --cuda-kernels "${peer[@]}" --repeats 5 --max-gb 60)
timeout 110 python3 "${layer[@]}" --configs guide --sizes 1000 10000 100000 --out "$out/layer_guide.json" 2>&1 \
    | grep -v -i "warn\|JIT\|TensorProduct\|^$"
timeout 100 python3 "${layer[@]}" --configs large --sizes 1000 10000 --out "$out/layer_large.json" 2>&1 \
    | grep -v -i "warn\|JIT\|TensorProduct\|^$"
fi

if part profile; then
step profile
timeout 60 python3 benchmarks/cuda_profile.py --atoms --layer guide:1000 guide:10000 large:10000 > "$out/profile.log" 2>&1
grep -E "^(layer|md) " "$out/profile.log"
fi
step done

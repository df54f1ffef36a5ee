#!/usr/bin/env bash
# A short check on a lent GPU (the device tool) after changes: the CUDA tests, MD speed with and without the
# Triton kernels, CUDA launches and synchronisations per MD call, the layer's force step by GPU time per operation
# (benchmarks/results/gpu/layer_profile.log), and the training command on CUDA.
#
#   bash benchmarks/gpu_check.sh            # there (carry .whl, prepared by benchmarks/gpu_round.sh prepare;
#                                           # a small extended-XYZ file .whl/train.xyz for the training command)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results/gpu}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1 || exit 1
export PYTHONPATH="/tmp/site:$PWD"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/gpu.txt"
timeout 100 python3 -m pytest -q -x tests/test_triton.py tests/test_heads.py -m "cuda or not cuda" 2>&1 | tail -2
timeout 100 python3 -m pytest -q tests -m cuda 2>&1 | tail -2
timeout 80 python3 benchmarks/md_speed.py --device cuda --calls 5 --repeats 3 --out "$out/md_speed.json" 2>&1 | tail -6
E3ATTN_CUDA_KERNELS=1 timeout 80 python3 benchmarks/md_speed.py --device cuda --calls 5 --repeats 3 \
    --out "$out/md_speed_kernels.json" 2>&1 | tail -6
timeout 80 python3 benchmarks/cuda_profile.py --atoms 108 864 > "$out/cuda_profile.log" 2>&1
grep -E "^md " "$out/cuda_profile.log"
timeout 100 python3 benchmarks/cuda_profile.py --atoms --layer guide:10000 large:10000 > "$out/layer_profile.log" 2>&1
grep -E "^layer " "$out/layer_profile.log"
if [ -f .whl/train.xyz ]; then
    timeout 90 python3 -m e3attn.train --train-file .whl/train.xyz --energy-key REF_energy --forces-key REF_forces \
        --valid-fraction 0.1 --time-budget 20 --device cuda --metrics "$out/train.json" --quiet 2>&1 | tail -3
fi

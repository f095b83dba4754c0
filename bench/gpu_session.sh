#!/usr/bin/env bash
# Everything this project runs on a lent GPU machine, in one call:
#   here:   pip download the cp312 wheels of megatron-core and libcst into .whl/ (see
#           ../shared/gpu.md) and `pip wheel --no-deps --no-build-isolation . -w .whl`
#   there:  bash bench/gpu_session.sh [tests] [dump] [step] [routing]   (default: all; results under $OUT)
# (each part fits one 10-minute device call; call it with fewer parts to split)
# The project's wheel goes into the interpreter's own environment, so its .pth start
# hook runs and SOURCE_PATCH works in child processes as it does for users.
set -uo pipefail
OUT=${OUT:-/tmp/sp-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import sys, torch, megatron.core, libcst, source_patch.patcher; print(sys.version.split()[0], torch.__version__)" | tee -a "$OUT/gpu.txt"

parts=${*:-tests dump step routing}
want() { [[ " $parts " == *" $1 "* ]]; }

if want tests; then
echo "== test suite, Python 3.12, GPUs hidden (CPU semantics)"
CUDA_VISIBLE_DEVICES= timeout 330 python3 -m pytest tests -q -p no:cacheprovider -m "not gpu" 2>&1 \
  | tee "$OUT/pytest_cpu.log" | tail -6
echo "== gpu-marked tests"
timeout 120 python3 -m pytest tests -q -p no:cacheprovider -m gpu -rs 2>&1 | tee "$OUT/pytest_gpu.log" | tail -6
fi
if want dump; then
echo "== dump bench"
timeout 240 python3 bench/dump_bench.py 2>&1 | tee "$OUT/dump_bench.txt" | tail -25
fi
if want step; then
echo "== training step bench"
timeout 360 python3 bench/dump_step_bench.py 2>&1 | tee "$OUT/dump_step_bench.txt" | tail -10
fi
if want routing; then
echo "== routing capture/replay step bench"
timeout 560 python3 bench/routing_bench.py --rounds 5 --steps 25 --warmup 8 2>&1 | tee "$OUT/routing_bench.txt" | tail -10
fi

#!/usr/bin/env bash
# A/B of code versions on one machine: run a bench under each project wheel in turn,
# in the order given (repeat a label to alternate: drift then hits each version).
#   bash bench/ab_wheels.sh OUT_PREFIX "COMMAND" LABEL=WHEEL [LABEL=WHEEL ...]
# e.g. bash bench/ab_wheels.sh "$OUT/wsb" "python3 bench/weight_sync_bench.py --gb 4 --rounds 7" \
#        new=.whl/source_patch-0.1.0-py3-none-any.whl old=.whl/ab/source_patch-0.1.0-py3-none-any.whl new=...
# Each run's output goes to OUT_PREFIX-<n>-<label>.txt; its table's tail is printed.
# (bash bench/gpu_session.sh none installs the other wheels first.)
set -uo pipefail
prefix=$1 command=$2
shift 2
n=0
for pair in "$@"; do
  label=${pair%%=*} wheel=${pair#*=}
  n=$((n + 1))
  python3 -m pip install -q --no-index --no-deps --no-compile --force-reinstall "$wheel" 2>&1 | tail -1
  echo "== run $n: $label ($wheel)"
  bash -c "$command" > "$prefix-$n-$label.txt" 2>&1
  echo "exit $?"
  grep -v "Warning\|warnings.warn\|^USDT\|profiler" "$prefix-$n-$label.txt" | tail -${AB_TAIL:-14}
done

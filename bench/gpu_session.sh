#!/usr/bin/env bash
# Everything this project runs on a lent GPU machine, in one call:
#   here:   pip download the cp312 wheels of megatron-core, libcst, packaging and websockets into
#           .whl/ (see ../shared/gpu.md) and `rm -rf build; pip wheel --no-deps --no-build-isolation . -w .whl` (a stale build/ ships deleted files)
#           and for `newest`: the cp312 wheel of megatron-core 0.19.2 into .whl/next/
#           and for `upstream`: pydantic, pydantic-core, annotated-types, typing-inspection and
#           typing-extensions (megatron.training needs them) into .whl/, and the upstream test
#           folders copied into .upstream/ (git-ignored): mkdir -p .upstream && cp -r ../shared/upstream/megatron-lm .upstream/
#   there:  bash bench/gpu_session.sh [tests] [dump] [step] [routing] [graphs] [trace] [launch] [duecall] [native] [native_training] [bias] [overhead] [overhead_processes] [hostbound] [swap] [costs] [weights] [pushx2] [backends] [wirespeed] [phases] [push] [newest] [upstream] [verdict] [sentinels]
#           (default: all; `overhead_processes` first on a fresh machine to see the first-run cliff; results under $OUT; `newest` installs 0.19.2 over 0.16.1, so it runs last;
#            `upstream` installs each release of $UPSTREAM_RELEASES, default "0.16.1 0.19.2", in turn)
# (each part fits one 10-minute device call; call it with fewer parts to split;
#  `costs`, `weights`, `pushx2`, `backends` and `wirespeed` need two GPUs: the nvidia-h100-x2 kind; `phases` runs on one)
# The project's wheel goes into the interpreter's own environment, so its .pth start
# hook runs and SOURCE_PATCH works in child processes as it does for users.
set -uo pipefail
OUT=${OUT:-/tmp/sp-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl 2>&1 | tail -2
# the project's wheel keeps its version across edits: on a warm machine pip would keep the old code
python3 -m pip install -q --no-index --no-deps --no-compile --force-reinstall .whl/source_patch-*.whl 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import sys, torch, megatron.core, libcst, source_patch.patcher; print(sys.version.split()[0], torch.__version__)" | tee -a "$OUT/gpu.txt"

parts=${*:-tests dump step routing graphs trace launch bias weights pushx2 backends wirespeed phases push newest upstream}
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
if want graphs; then
echo "== graph-safe call sites (issue 31): dump, trace and routing staged under torch.cuda.graph, drained after"
echo "   each replay; dumps under Megatron's own CUDA graphs (cuda_graph_impl=local, moe_router scope) vs eager"
timeout ${GRAPH_TEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider -rs --durations=8 tests/test_graph_stage.py \
  tests/test_graph_stage_sites.py tests/test_sglang_graphs.py tests/test_megatron_graphs.py -k "not capture_and_replay" 2>&1 \
  | tee "$OUT/pytest_graph_stage.log" | tail -30
echo "== routing capture / replay under Megatron's own CUDA graphs"
timeout ${GRAPH_TEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider -rs --durations=3 \
  tests/test_megatron_graphs.py -k capture_and_replay 2>&1 | tee "$OUT/pytest_megatron_graphs.log" | tail -12
if [ "${GRAPH_BENCH:-1}" != 0 ]; then  # GRAPH_BENCH=0: the tests only
echo "== routing capture on vs off in a graphed Megatron step (bench/graph_bench.py)"
timeout ${GRAPH_BENCH_TIMEOUT:-280} python3 bench/graph_bench.py ${GRAPH_BENCH_ARGS:---hidden 2048 --seq-len 1024 --cycles 20} 2>&1 | grep -v "Warning\|warnings.warn" \
  | tee "$OUT/graph_bench.txt" | tail -12
fi
fi
if want trace; then
echo "== trace: forwarder and compressor tests (Triton's interpreter too), gpu-marked hub tests, then the benches"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/test_trace_forwarder.py tests/test_trace_compress.py \
  2>&1 | tee "$OUT/pytest_trace.log" | tail -4
timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_trace_hub.py 2>&1 \
  | tee "$OUT/pytest_trace_gpu.log" | tail -4
timeout 80 python3 bench/compressor_bench.py 2>&1 | tee "$OUT/compressor_bench.txt" | grep -v "^source-patch"
# traced vs not-traced steps in one process, on the GPU-bound step (hidden 2048: step noise ~1.3%, where
# hidden 1024 is host-bound and spreads 14-20%), and an A/A process: the protocol's own effect
# (300 steps a process: ~+-0.2% at the 90% interval, and the part fits one 10-minute call)
timeout 330 python3 bench/trace_bench.py --resolve --aa --hidden 2048 --settings device_timing=0 --rounds 1 \
  --toggle-steps 300 --phase 4 --warmup 8 --save "$OUT/trace_run.json" 2>&1 | tee "$OUT/trace_bench.txt" | tail -14
fi
if want launch; then
echo "== trace launches: direct (triton_launch: direct) vs Triton's dispatch each call; gpu tests, host time, training"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/test_trace_forwarder.py tests/test_trace_compress.py \
  2>&1 | tee "$OUT/pytest_launch.log" | tail -4
timeout 90 python3 bench/compressor_bench.py --profile 2>&1 | tee "$OUT/compressor_bench_launch.txt" | grep -v "^source-patch"
timeout 330 python3 bench/trace_bench.py --resolve --before --before-settings device_timing=1,triton_launch=triton \
  --rounds 1 --toggle-steps 700 --phase 4 --warmup 8 --save "$OUT/launch_run.json" 2>&1 | tee "$OUT/trace_bench_launch.txt" | tail -14
fi
if want duecall; then
echo "== the due trace() call (issue 34 item 3): after other work, and cut after each part, cold"
timeout 120 python3 bench/compressor_bench.py --hub process --rounds 40 2>&1 | tee "$OUT/compressor_bench_due.txt" \
  | grep -A 11 "^-- due trace"
timeout 200 python3 bench/due_call_bench.py --cuts --gpu 2>&1 | tee "$OUT/due_call_cuts.txt" | tail -17
fi
if want native; then
echo "== the native launch (triton_launch: native, issue 34 item 3): built here, its gpu tests, the call cold, cut"
python3 -m source_patch.patcher build-native 2>&1 | tail -3
timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/test_trace_native.py tests/test_trace_compress.py \
  -k "native or planned" 2>&1 | tee "$OUT/pytest_native.log" | tail -4
timeout 200 python3 bench/due_call_bench.py --cuts --gpu 2>&1 | tee "$OUT/due_call_native.txt" | tail -22
timeout 200 python3 bench/due_call_bench.py --cuts --gpu --native 2>&1 | tee "$OUT/due_call_native_cuts.txt" | tail -20
timeout 150 python3 bench/due_call_bench.py --gpu --compiled --cold-rounds 300 2>&1 | tee "$OUT/due_call_compiled.txt" | tail -5
if [ -n "${AGAINST:-}" ]; then  # AGAINST=an api.py of another version (here: git show REV:runtime/trace/api.py > FILE)
  timeout 200 python3 bench/due_call_bench.py --gpu --against "$AGAINST" --cold-rounds 300 2>&1 \
    | tee "$OUT/due_call_against.txt" | tail -5
fi
fi
if want native_training; then
echo "== the due call in training, direct (before) and native launches alternated (issue 34 item 3)"
python3 -m source_patch.patcher build-native 2>&1 | tail -1
timeout 560 python3 bench/trace_bench.py --resolve --before --hidden 1024 --rounds 2 --toggle-steps 300 --phase 40 \
  --warmup 8 --settings device_timing=0,triton_launch=native --before-settings device_timing=0,triton_launch=direct \
  --save "$OUT/native_run.json" 2>&1 | tee "$OUT/trace_bench_native.txt" | tail -16
fi
if want bias; then
echo "== trace bench bias: the toggling process and an A/A process (same requests, nothing traced), GC time per step"
timeout 420 python3 bench/trace_bench.py --resolve --aa --gc --settings device_timing=0 --rounds 1 \
  --toggle-steps 650 --phase 4 --warmup 8 --save "$OUT/bias_run.json" 2>&1 | tee "$OUT/trace_bench_bias.txt" | tail -16
fi
if want overhead_processes; then
echo "== what each capability costs in the Megatron example's step, a process per round (first: a fresh machine's first-run cliff)"
(cd bench && timeout 450 python3 overhead_bench.py --steps 30 --warmup 6 --save "$OUT/overhead.json" 2>&1 \
  | tee "$OUT/overhead_bench.txt")
fi
if want overhead; then
echo "== what each capability costs (issue 34); first: routing capture's host time per router call (before / after)"
(cd bench && timeout 25 python3 routing_call_bench.py --rounds 9 --steps 5 2>&1 | grep -v "Warning\|warnings.warn" \
  | tee "$OUT/routing_call_bench.txt")
echo "== due trace() calls"
timeout 50 python3 bench/compressor_bench.py 2>&1 | tee "$OUT/compressor_bench.txt" | grep -v "^source-patch" | tail -14
echo "== a C extension built at install time: does this machine have a compiler and Python's headers?"
(command -v gcc cc g++ || echo "no C compiler on PATH"; python3 -c "import sysconfig, os; \
p = sysconfig.get_paths()['include']; print('Python.h', os.path.exists(os.path.join(p, 'Python.h')), p)"; \
python3 -c "import triton; print('triton', triton.__version__)") 2>&1 | tee "$OUT/toolchain.txt"
echo "== a larger, GPU-bound model (hidden 2048, 4 layers), the same way: two groups, 10 rounds (~90 s each)"
for group in "plain;plain again;every spec inert;routing capture" "plain;trace, 1 client;everything at once;dump 1 layer / 10"; do
  (cd bench && timeout ${OVERHEAD_LARGE_S:-130} python3 overhead_bench.py --resident 5 --rounds ${OVERHEAD_LARGE_ROUNDS:-10} \
    --no-probes --hidden 2048 --layers 4 --variants "$group" 2>&1 | grep -v "Warning\|warnings.warn" \
    | tee -a "$OUT/overhead_large.txt" | tail -7)
done
fi
if want hostbound; then
echo "== one resident process per variant, blocks of steps alternated; the issue's model (hidden 1024, 8 layers)"
# four processes of this model (~14.4 GiB each) at a time; four sets of them in turn, since two identical
# processes differ by ~1% for their whole lives (the intervals resample the sets; ~9 min: a call of its own)
(cd bench && timeout ${OVERHEAD_S:-560} python3 overhead_bench.py --resident 10 --rounds ${OVERHEAD_ROUNDS:-12} \
  --sessions ${OVERHEAD_SETS:-4} --no-probes --variants "plain;plain again;every spec inert;everything at once" \
  --save "$OUT/overhead_resident.json" 2>&1 | grep -v "Warning\|warnings.warn" | tee "$OUT/overhead_resident.txt" | tail -7)
fi
if want swap; then
echo "== the issue's model (hidden 1024, 8 layers), each process against itself: its blocks alternated between its"
echo "   patched code and the code megatron_cpu alone makes step by step (overhead_bench.py --swap, code_swap.py; ~6 min a variant)"
(cd bench && timeout ${SWAP_S:-560} python3 overhead_bench.py --resident 1 --rounds ${SWAP_ROUNDS:-600} --swap --no-probes \
  --variants "${SWAP_VARIANTS:-every spec inert}" --save "$OUT/overhead_swap.json" 2>&1 \
  | grep -v "Warning\|warnings.warn" | tee "$OUT/overhead_swap.txt" | tail -12)
fi
if want costs; then
echo "== what weight sync every step and Megatron's router CUDA graphs cost (issue 34), GPU-bound model, resident"
echo "   processes: the trainer on GPU 0 pushes after every step to bench/sync_receiver.py on GPU 1 (NCCL);"
echo "   the graphs group is compared with plain under the same graphs"
# one weight-sync variant a group: the receivers of two would share GPU 1, one of them
# waiting in a posted broadcast while the other receives (+13.3..13.8% against +6.4%)
for group in "plain;plain again;weight sync every step" "plain;everything + weight sync" \
    "plain, graphs;routing capture, graphs;everything at once, graphs"; do
  (cd bench && timeout ${COSTS_S:-180} python3 overhead_bench.py --resident 5 --rounds ${COSTS_ROUNDS:-8} \
    --no-probes --hidden 2048 --layers 4 --variants "$group" 2>&1 | grep -v "Warning\|warnings.warn" \
    | tee -a "$OUT/overhead_costs.txt" | tail -9)
done
fi
if want weights; then
echo "== weight sync: bucketed vs per-tensor vs raw broadcast, 2 GPUs over NCCL"
nvidia-smi topo -m 2>&1 | head -4 | tee "$OUT/topo.txt"
timeout 240 python3 bench/weight_sync_bench.py --gb 4 --rounds 9 --timeline 4 2>&1 \
  | grep -v "^USDT\|profiler" | tee "$OUT/weight_sync_bench.txt" | tail -50
timeout 240 python3 bench/weight_sync_bench.py --gb 4 --small-frac 0.5 --rounds 9 2>&1 \
  | tee "$OUT/weight_sync_bench_small.txt" | tail -24
fi
if want pushx2; then
echo "== weight sync, whole push(): a real Megatron MoE on GPU 0 pushed to a receiver on GPU 1 over NCCL"
# hidden 512: 48 x 128 experts of 256 KiB tensors, 4.6 GiB; hidden 64: 74 MiB, the host's share
for hidden in 512 64; do
  timeout 240 python3 bench/push_bench.py --engine --hidden $hidden --rounds 9 2>&1 \
    | grep -v "Warning\|warnings.warn" | tee "$OUT/push_engine_$hidden.txt" | tail -9
done
fi
if want backends; then
echo "== weight sync backends (issue 32): colocated TP 2 / EP 2 trainers feeding a CUDA IPC engine on each GPU (bitwise), ipc vs a raw copy, nccl from buffers / packed"
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_weight_sync_request_backends.py \
  tests/test_weight_sync.py 2>&1 | tee "$OUT/pytest_backends_gpu.log" | tail -4
timeout 90 python3 bench/weight_sync_backends_bench.py --ipc --gb 4 --rounds 9 2>&1 | tee "$OUT/backends_ipc.txt" | tail -12
timeout 120 python3 bench/weight_sync_bench.py --gb 4 --rounds 7 2>&1 | grep -v "^USDT\|profiler" \
  | tee "$OUT/weight_sync_bench_split.txt" | tail -30
fi
if want wirespeed; then
echo "== weight sync at wire speed (issue 32, item 2): gpu-marked tests (colocated TP 2 / EP 2 trainers over ipc, bitwise;"
echo "   the NCCL transport), then the table in one run: nccl from buffers / packed at 7k tensors, the whole packed push, ipc,"
echo "   and what the sender's kernels cost a broadcast beside them"
nvidia-smi topo -m 2>&1 | head -4 | tee "$OUT/topo.txt"
timeout 170 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_weight_sync_request_backends.py \
  tests/test_weight_sync.py 2>&1 | tee "$OUT/pytest_wirespeed_gpu.log" | tail -4
timeout 150 python3 bench/weight_sync_bench.py --gb 4 --rounds 9 2>&1 | grep -v "^USDT\|profiler" \
  | tee "$OUT/weight_sync_bench_wirespeed.txt" | tail -34
timeout 130 python3 bench/push_bench.py --engine --hidden 512 --rounds 9 2>&1 | grep -v "Warning\|warnings.warn" \
  | tee "$OUT/push_engine_512_wirespeed.txt" | tail -16
echo "== 36,169 tensors (issue 58 item 1): the planned packed push beside raw, and the sender's host time per push"
timeout 150 python3 bench/weight_sync_bench.py --gb 4 --small-frac 0.5 --rounds 9 --events 3 2>&1 | grep -v "^USDT\|profiler" \
  | tee "$OUT/weight_sync_bench_36k.txt" | tail -34
timeout 120 python3 bench/weight_sync_host_bench.py --rounds 21 2>&1 | tee "$OUT/weight_sync_host_bench.txt" | tail -14
timeout 70 python3 bench/weight_sync_backends_bench.py --ipc --gb 4 --rounds 9 2>&1 | tee "$OUT/backends_ipc_wirespeed.txt" | tail -12
echo "== the sender's kernels beside a broadcast (bench/contention_bench.py)"
timeout 60 python3 bench/contention_bench.py --rounds 16 2>&1 | grep -v "Warning\|warnings.warn" \
  | tee "$OUT/contention_bench.txt" | tail -14
fi
if want phases; then
echo "== weight sync phases (one GPU, one process): pack, checksum, receivers, load, d2d copy"
timeout 200 python3 bench/weight_sync_bench.py --phases 2>&1 | tee "$OUT/weight_sync_phases.txt" | tail -60
fi
if want push; then
echo "== weight sync, trainer side: push() host time on a real Megatron MoE (48 layers x 128 experts)"
timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_weight_sync.py 2>&1 | tail -3
timeout 200 python3 bench/push_bench.py --profile 2>&1 | grep -v "Warning\|warnings.warn" | tee "$OUT/push_bench.txt" | tail -40
fi
# `wholecost` (issue 59, by name only): bash bench/gpu_session.sh wholecost, one 10-minute call a model:
#   WHOLECOST_MODEL=hostbound (default) or gpubound; WHOLECOST_BUDGET seconds for the bench (default 520);
#   WHOLECOST_VARIANTS "a;b;..." (default all); WHOLECOST_ARGS more flags; WHOLECOST_TAG names the files
#   ($OUT/whole_cost_<model><tag>.txt and .json: the run, to pool later with --pool)
if want wholecost; then
wc_model=${WHOLECOST_MODEL:-hostbound}
wc_out="$OUT/whole_cost_${wc_model}${WHOLECOST_TAG:-}"
echo "== the whole cost of each capability (issue 59): one training process, each capability started and stopped"
echo "   through its public configure/close between blocks, plain and an A/A row; model $wc_model"
(cd bench && timeout $(( ${WHOLECOST_BUDGET:-520} + 60 )) python3 whole_cost_bench.py --model "$wc_model" \
  --budget-s ${WHOLECOST_BUDGET:-520} ${WHOLECOST_VARIANTS:+--variants "$WHOLECOST_VARIANTS"} ${WHOLECOST_ARGS:-} \
  --save "$wc_out.json" 2>&1 | grep -v "Warning\|warnings.warn" | tee "$wc_out.txt" | tail -70)
fi
if want newest; then
echo "== megatron-core 0.19.2 (the newest release): the demo under the shipped specs"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade .whl/next/megatron_core-0.19.2-*.whl 2>&1 | tail -2
python3 -c "import importlib.metadata as m; print('megatron-core', m.version('megatron-core'))" | tee "$OUT/newest.txt"
SOURCE_PATCH_STRICT=1 python3 -m source_patch.patcher check routing dump megatron_cpu 2>&1 | grep -v "^       " | tee -a "$OUT/newest.txt"
echo "-- GPU, SOURCE_PATCH=routing,dump (no megatron_cpu: 0.19 binds the router gemm itself)" | tee -a "$OUT/newest.txt"
SOURCE_PATCH=routing,dump SOURCE_PATCH_DUMP_DIR=/tmp/sp-dumps-gpu SOURCE_PATCH_REPORT=1 \
  timeout 240 python3 examples/train_moe.py --steps 5 > "$OUT/newest-gpu.log" 2>&1; echo "exit $?"
grep -v "Warning\|warnings.warn\|^ *\"\"\"" "$OUT/newest-gpu.log" | tail -45 | tee -a "$OUT/newest.txt"
echo "-- CPU (GPUs hidden), SOURCE_PATCH=megatron_cpu,routing,dump" | tee -a "$OUT/newest.txt"
CUDA_VISIBLE_DEVICES= SOURCE_PATCH=megatron_cpu,routing,dump SOURCE_PATCH_DUMP_DIR=/tmp/sp-dumps-cpu SOURCE_PATCH_REPORT=1 \
  timeout 240 python3 examples/train_moe.py --steps 5 > "$OUT/newest-cpu.log" 2>&1; echo "exit $?"
grep -v "Warning\|warnings.warn\|^ *\"\"\"" "$OUT/newest-cpu.log" | tail -45 | tee -a "$OUT/newest.txt"
fi
if want upstream; then
echo "== upstream's own tests (bench/upstream_tests.py): plain and under every configuration, per release"
for v in ${UPSTREAM_RELEASES:-0.16.1 0.19.2}; do
  if [ "$(python3 -c "import importlib.metadata as m; print(m.version('megatron-core'))")" != "$v" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --force-reinstall \
      $(ls .whl/megatron_core-$v-*.whl .whl/next/megatron_core-$v-*.whl 2>/dev/null | head -1) 2>&1 | tail -2
  fi
  work=/tmp/sp-upstream-$v
  # the configurations run 6 at once (replay after capture): both releases fit one 10-minute call
  deadline=${UPSTREAM_DEADLINE:-270}
  timeout $((deadline + 40)) python3 bench/upstream_tests.py --tests "${SOURCE_PATCH_UPSTREAM_TESTS:-.upstream}" \
    --work $work --jobs 6 --timeout 240 --deadline $deadline --out "$OUT/upstream-$v.md" --json "$OUT/upstream-$v.json" \
    > $work.log 2>&1; echo "exit $?"
  tail -60 $work.log
  (cd /tmp && tar -czf "$OUT/upstream-$v.tgz" sp-upstream-$v.log sp-upstream-$v/*.xml)
done
fi
if want sentinels; then
echo "== the sentinels armed (issue 54 item 5): non-finite provenance, routing health and the mismatch watch without a"
echo "   trigger, each process against itself (the swap bench), the host-bound model, then the GPU-bound one eager and"
echo "   under Megatron's router CUDA graphs; then the gpu-marked sentinel tests"
(cd bench && timeout ${SENTINELS_SWAP_S:-200} python3 overhead_bench.py --resident 1 --rounds ${SENTINELS_ROUNDS:-300} --swap \
  --no-probes --variants "sentinels armed" --save "$OUT/overhead_sentinels_swap.json" 2>&1 \
  | grep -v "Warning\|warnings.warn" | tee "$OUT/overhead_sentinels_swap.txt" | tail -12)
if [ "${SENTINELS_LARGE:-1}" != 0 ]; then  # SENTINELS_LARGE=0: the host-bound rows and the profile only
(cd bench && timeout ${SENTINELS_LARGE_S:-150} python3 overhead_bench.py --resident 5 --rounds ${SENTINELS_LARGE_ROUNDS:-8} \
  --no-probes --hidden 2048 --layers 4 --variants "plain;sentinels armed;plain, graphs;sentinels armed, graphs" 2>&1 \
  | grep -v "Warning\|warnings.warn" | tee "$OUT/overhead_sentinels_large.txt" | tail -10)
fi
timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_sentinels_nonfinite.py tests/test_sentinels_routing.py \
  2>&1 | tee "$OUT/pytest_sentinels_gpu.log" | tail -4
# (defaults: 200 + 150 + ~10 + 150 + 70 s, within one 10-minute call)
if [ "${SENTINELS_PROFILE:-1}" != 0 ]; then  # where what is left goes: each call site's host time a step, the
  # garbage collections, and torch.profiler's table of plain and armed side by side (host and device time per op)
(cd bench && timeout ${SENTINELS_PROFILE_S:-150} python3 call_profile.py --steps 20 --warmup 6 --top 10 --torch-profile 12:3 --variants "plain;sentinels armed" 2>&1 \
  | grep -v "Warning\|warnings.warn" | tee "$OUT/sentinels_calls.txt" | tail -70)
# and inside the call sites: the sentinels' own functions, host time a step after the warm-up
(cd bench && timeout ${SENTINELS_PARTS_S:-70} python3 sentinel_parts.py --steps 30 --warmup 10 2>&1 \
  | grep -v "Warning\|warnings.warn" | tee "$OUT/sentinel_parts.txt" | tail -20)
fi
fi
if want verdict; then
echo "== verdict (issue 53 item 5): real mismatches between two training runs of one checkpoint (examples/verdict_runs.py:"
echo "   Megatron's schedule, 2 micro-batches, forward+backward), compared layer by layer by source-patch compare:"
echo "   bf16 on the GPU against fp32 on the CPU (megatron-core 0.16.1), then 0.16.1 against 0.19.2 (fp32 on the GPU)"
# VERDICT_DEVICE=cpu: every GPU run on the CPU instead (the same commands, a dry path on a machine without a GPU)
vd=${VERDICT_DIR:-/tmp/sp-verdict}; vdev=${VERDICT_DEVICE:-cuda}
rm -rf "$vd"; mkdir -p "$vd"
if [ "$(python3 -c "import importlib.metadata as m; print(m.version('megatron-core'))")" != 0.16.1 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --force-reinstall .whl/megatron_core-0.16.1-*.whl 2>&1 | tail -2
fi
vrun() {  # vrun NAME [flags]: one run of the checkpoint, dumps under $vd/dumps/NAME, its output in $OUT
  local name=$1; shift
  timeout 300 python3 examples/verdict_runs.py --checkpoint "$vd/ckpt" --make-checkpoint --out "$vd/dumps" \
    --name "$name" "$@" > "$OUT/verdict_run_$name.log" 2>&1; local code=$?
  grep -v "Warning\|warnings.warn" "$OUT/verdict_run_$name.log" | tail -6; echo "exit $code"
}
vcompare() {  # vcompare A B REPORT: the verdict of run A against run B (the reference), table printed, JSON and HTML in $OUT
  python3 -m source_patch.patcher compare "$vd/dumps" "$vd/dumps" --exp-name "$1" --exp-name "$2" \
    --json-out "$OUT/verdict_$3.json" --html "$OUT/verdict_$3.html" 2>&1 | tee "$OUT/verdict_$3.txt"
  echo "exit ${PIPESTATUS[0]} (0: no divergence, 1: divergence, 2: cannot compare)"
}
echo "-- megatron-core 0.16.1: fp32 on the CPU, bf16 (Float16Module) on $vdev"
vrun fp32-cpu --dtype fp32 --device cpu --megatron-version 0.16.1
vrun bf16-$vdev --dtype bf16 --device "$vdev" --megatron-version 0.16.1
echo "-- verdict: bf16 on $vdev against fp32 on the CPU"
vcompare "bf16-$vdev" fp32-cpu "bf16_${vdev}_vs_fp32_cpu"
echo "-- megatron-core 0.16.1 against 0.19.2, ${VERDICT_VERSION_DTYPE:-fp32} on $vdev"
vrun "mcore-0.16.1-$vdev" --dtype "${VERDICT_VERSION_DTYPE:-fp32}" --device "$vdev" --megatron-version 0.16.1
next=$(ls .whl/next/megatron_core-0.19.2-*.whl 2>/dev/null | head -1)
if [ -z "$next" ]; then
  echo "no .whl/next/megatron_core-0.19.2-*.whl: the 0.19.2 run is skipped (see the header: pip download it here)"
else
  rm -rf "$vd/mcore-0.19.2"
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$vd/mcore-0.19.2" "$next" 2>&1 | tail -2
  PYTHONPATH="$vd/mcore-0.19.2${PYTHONPATH:+:$PYTHONPATH}" \
    vrun "mcore-0.19.2-$vdev" --dtype "${VERDICT_VERSION_DTYPE:-fp32}" --device "$vdev" --megatron-version 0.19.2
  echo "-- verdict: megatron-core 0.19.2 against 0.16.1"
  vcompare "mcore-0.19.2-$vdev" "mcore-0.16.1-$vdev" "megatron_0.19.2_vs_0.16.1_$vdev"
fi
(cd "$vd" && tar -czf "$OUT/verdict_dumps.tgz" dumps)
fi

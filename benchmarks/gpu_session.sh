#!/usr/bin/env bash
# The whole GPU check in one device call, for a lease too short for one call per step (15 minutes of
# device time, a machine start included; 10 minutes a command):
#
#   device run, timeout_s 600:  bash benchmarks/gpu_session.sh
#
# Runs benchmarks/gpu_check.sh's steps in priority order against one deadline (GPU_SESSION_SECONDS, default
# 540 s from the start), each under the smaller of its cap and the time left (a step that would get under
# 20 s is skipped and says so in session.log):
#   build (200 s), the CUDA tests (170 s), the bucket plans' host and device time (45 s), bench zero with
#   its bf16 and pool sections at one NCCL rank, collectives forced (180 s), bench ddp's forced pass (120 s), bench ops
#   (90 s; no slot padding, measured 2026-11-26), then bench ddp --full's forced pass when 120 s are left.
# Every log and JSON goes to $OUT as it is written, in at most 5 files (the device tool brings back 8):
# session.log (nvidia-smi, the environment, each step's start and exit), build.log (with readelf/objdump of the
# library), test.log, bench.log (every benchmark's output), and json.tar: every benchmark JSON (zero_cuda.json,
# zero_cuda_bf16.json, zero_cuda_pool.json, ddp_cuda.json, ops_cuda.json), appended after each bench step;
# back here, `tar -xf json.tar -C benchmarks/out` (a later copy of a name replaces the earlier one).
# The junit XML, the charts and the stripped extension stay in build/gpu-check.
set -u
OUT_DIR=${OUT:-benchmarks/out/gpu}
mkdir -p "$OUT_DIR" build/gpu-check
START=$(date +%s)
DEADLINE=$((START + ${GPU_SESSION_SECONDS:-540}))
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}

say() { echo "gpu_session $(date -u +%TZ) (+$(($(date +%s) - START))s): $*" | tee -a "$OUT_DIR/session.log"; }

# step NAME CAP [VAR=VALUE...]: one gpu_check.sh step under min(CAP, time left); every command of the step
# stops by its deadline. OUT is unset for it, so that the build leaves no ext.so in $OUT; GPU_OUT still points there.
step() {
  local name=$1 cap=$2 left rc
  shift 2
  left=$((DEADLINE - $(date +%s)))
  [ "$left" -lt "$cap" ] && cap=$left
  if [ "$cap" -lt 20 ]; then
    say "skipped $name: ${left}s left"
    return 1
  fi
  say "$name (at most ${cap}s)"
  env -u OUT GPU_OUT="$OUT_DIR" GPU_DEADLINE=$(($(date +%s) + cap)) "$@" bash benchmarks/gpu_check.sh "$name"
  rc=$?
  say "$name: exit $rc"
  return "$rc"
}

# pack_json: move the benchmark JSON written so far into $OUT_DIR/json.tar (appended, in the order written).
pack_json() {
  local f
  for f in "$OUT_DIR"/*.json; do
    [ -e "$f" ] || continue
    tar -rf "$OUT_DIR/json.tar" -C "$OUT_DIR" "$(basename "$f")" && rm -f "$f"
  done
}

{ nvidia-smi; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv
  python3 -c 'import sys, torch; print(sys.version); print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))'
  nproc; ulimit -s; env | grep -E '^(TORCH|PYTORCH|CUDA|NCCL|LD_|PYTHON|CC|CXX|CFLAGS|CXXFLAGS)' | sort; } >>"$OUT_DIR/session.log" 2>&1
step build 200
# The files whose CUDA tests have not run on a GPU yet go first, then every other file (pytest runs each once).
FIRST="tests/test_ops_sum_chunks.py tests/test_cuda_sharded.py tests/test_ddp.py tests/test_cuda_paths.py"
REST=$(grep -l "cuda" tests/test_*.py | grep -vxF -f <(tr ' ' '\n' <<<"$FIRST") | tr '\n' ' ')
step test 170 GPU_TESTS="$FIRST $REST"
mv -f "$OUT_DIR/test.xml" build/gpu-check/ 2>/dev/null
step bench-plan 45 GPU_LOG=bench
step bench-zero 180 GPU_LOG=bench
pack_json
step bench-ddp 120 GPU_LOG=bench GPU_DDP_PASS=forced
pack_json
step bench-ops 90 GPU_LOG=bench GPU_PAD=0
pack_json
# The full DDP benchmark's forced pass with what is left: its JSON replaces the default run's only when it ends.
[ $((DEADLINE - $(date +%s))) -ge 120 ] && step bench-ddp 600 GPU_LOG=bench GPU_DDP_PASS=forced BENCH_ARGS=--full
pack_json
say "done, $((DEADLINE - $(date +%s)))s before the deadline"

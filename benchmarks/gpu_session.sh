#!/usr/bin/env bash
# The whole GPU check in one device call, for a lease too short for one call per step (15 minutes of
# device time, a machine start included; 10 minutes a command):
#
#   device run, carry [".gpu-wheels"], timeout_s 600:  bash benchmarks/gpu_session.sh
#
# Runs benchmarks/gpu_check.sh's steps in priority order against one deadline (GPU_SESSION_SECONDS, default
# 540 s from the start): build (at most 240 s), the CUDA tests (170 s), the ops benchmark and the slot
# padding (90 s each), the DDP benchmark (what is left; with --quick when under 4 minutes are). A step gets the smaller of its cap and
# the time left; one that would get under 20 s is skipped and says so in session.log. Every log and JSON
# goes to $OUT as it is written, at most 8 files (what the device tool brings back): session.log (with nvidia-smi),
# build.log, test.log, ops.log with ops_cuda.json and pad_cuda.json, ddp.log with ddp_cuda.json.
# The junit XML and the stripped extension stay in build/gpu-check on the machine.
set -u
OUT_DIR=${OUT:-benchmarks/out/gpu}
mkdir -p "$OUT_DIR" build/gpu-check
DEADLINE=$(($(date +%s) + ${GPU_SESSION_SECONDS:-540}))
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}

say() { echo "gpu_session $(date -u +%TZ): $*" | tee -a "$OUT_DIR/session.log"; }

# step NAME CAP [VAR=VALUE...]: one gpu_check.sh step under min(CAP, time left). OUT is unset for it, so
# that the build leaves no ext.so in $OUT (8 files come back); GPU_OUT still points there.
step() {
  local name=$1 cap=$2 left rc
  shift 2
  left=$((DEADLINE - $(date +%s)))
  [ "$left" -lt "$cap" ] && cap=$left
  if [ "$cap" -lt 20 ]; then
    say "skipped $name: ${left}s left"
    return 1
  fi
  say "$name (limit ${cap}s per command)"
  env -u OUT GPU_OUT="$OUT_DIR" GPU_STEP_TIMEOUT="$cap" "$@" bash benchmarks/gpu_check.sh "$name"
  rc=$?
  say "$name: exit $rc"
  return "$rc"
}

{ nvidia-smi; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv
  python3 -c 'import sys, torch; print(sys.version); print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))'
  nproc; ulimit -s; env | grep -E '^(TORCH|PYTORCH|CUDA|NCCL|LD_|PYTHON|CC|CXX|CFLAGS|CXXFLAGS)' | sort; } >>"$OUT_DIR/session.log" 2>&1
step build 240
step test 170
mv -f "$OUT_DIR/test.xml" build/gpu-check/ 2>/dev/null
step bench-ops 90
# The full DDP benchmark (15 samples a method; --quick took 35-45 s on the H200) when 4 minutes are left, else --quick.
if [ $((DEADLINE - $(date +%s))) -ge 240 ]; then step bench-ddp 300; else step bench-ddp 300 BENCH_ARGS=--quick; fi
say "done, $((DEADLINE - $(date +%s)))s before the deadline"

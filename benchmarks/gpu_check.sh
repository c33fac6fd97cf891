#!/usr/bin/env bash
# One step of the GPU check (issue #14); the Makefile's gpu-* targets call it:
#
#   benchmarks/gpu_check.sh build       # make gpu-build:     build in place with the CUDA kernels, print build_info
#   benchmarks/gpu_check.sh test        # make gpu-test:      pytest -m cuda tests (junit XML)
#   benchmarks/gpu_check.sh bench-ops   # make gpu-bench-ops: python -m fastcoll.bench ops --device cuda, then the
#                                       #                     slot-padding measurement (issue 14 item 7)
#   benchmarks/gpu_check.sh bench-plan  # make gpu-bench-plan: benchmarks/plan_host_time.py on 25 MiB buckets of
#                                       #                     448 and 1024 tensors (host time, device time vs floor)
#   benchmarks/gpu_check.sh bench-zero  # make gpu-bench-zero: python -m fastcoll.bench zero --device cuda (and its
#                                       #                     bf16 section); one GPU: one NCCL rank, collectives forced
#   benchmarks/gpu_check.sh bench-ddp   # make gpu-bench-ddp: python -m fastcoll.bench ddp --device cuda: two passes,
#                                       #                     FASTCOLL_FORCE_COLLECTIVES=0 and =1, both in one JSON
#   benchmarks/gpu_check.sh pad-counts  # make gpu-pad-counts: the slot-padding counts (no GPU needed)
#
# Every step writes its log (NAME.log), and its JSON where it has one, to $GPU_OUT (default
# ${OUT:-benchmarks/out/gpu}: the device tool brings $OUT back) even when it fails or hangs (each
# command runs under `timeout`, its output tee'd as it comes), ends the log with "exit=N" and exits N.
# What a step writes there: build: build.log (+ ext.so, ext.sha256 on the device tool, see below);
# test: test.log, test.xml; bench-ops: ops.log, ops_cuda.json, pad_cuda.json; bench-plan: plan.log; bench-zero:
# zero.log, zero_cuda.json, zero_cuda_bf16.json, zero_cuda_pool.json; bench-ddp: ddp.log, ddp_cuda.json. Charts go to build/gpu-check/
# (the device tool brings back 8 files a call);
# benchmarks/render_results.py and the benches' chart() functions redo them from the JSON.
#
# Steps other than build build first when the extension is missing, lacks the CUDA kernels or was
# built from other sources (a hash of csrc/, setup.py, torch, Python and TORCH_CUDA_ARCH_LIST in
# build/gpu-check/ext.sha256). A fresh device machine has no build: the build step also leaves a
# stripped copy of the extension, ext.so, and its ext.sha256 in $GPU_OUT when $OUT is set; copied into
# build/gpu-check/ here and carried (carry: ["build/gpu-check"]), the next call uses it instead of
# building again (about 2 minutes saved per call).
#
# Environment: PYTHON (python3), GPU_OUT, PYTEST_ARGS, TORCH_CUDA_ARCH_LIST (9.0+PTX), MAX_JOBS (cores),
# GPU_WHEELS (what to install from .gpu-wheels when that folder exists), GPU_STEP_TIMEOUT (seconds,
# overrides every step's limit: build 300, test 290, ops 200, pad 100, plan 60, zero 300, ddp 560), GPU_DEADLINE
# (epoch seconds no command may pass), GPU_LOG (one log file for every step), GPU_DDP_PASS, BENCH_ARGS (more arguments
# for the benchmarks, e.g. --quick; benchmarks/gpu_session.sh runs every step in one call that way).
set -u
step=${1:?usage: benchmarks/gpu_check.sh build|test|bench-ops|bench-plan|bench-zero|bench-ddp|pad-counts}
PYTHON=${PYTHON:-python3}
GPU_OUT=${GPU_OUT:-${OUT:-benchmarks/out/gpu}}
STATE=build/gpu-check
ARCH=${TORCH_CUDA_ARCH_LIST:-9.0+PTX}
export PYTHONUNBUFFERED=1
# The steps build in place themselves: an import must not compile into the cache instead (fastcoll/extension).
export FASTCOLL_JIT=${FASTCOLL_JIT:-0}
mkdir -p "$GPU_OUT" "$STATE"

# limit CAP: a command's limit in seconds: CAP, or GPU_STEP_TIMEOUT, cut to what is left before GPU_DEADLINE
# (epoch seconds; gpu_session.sh gives each step one).
limit() {
  local c=${GPU_STEP_TIMEOUT:-$1} left
  if [ -n "${GPU_DEADLINE:-}" ]; then
    left=$((GPU_DEADLINE - $(date +%s)))
    [ "$left" -lt "$c" ] && c=$left
    [ "$c" -lt 1 ] && c=1
  fi
  echo "$c"
}

# logged NAME SECONDS CMD...: run CMD under timeout, its output appended to $GPU_OUT/NAME.log as it comes
# ($GPU_LOG.log instead when GPU_LOG is set: gpu_session.sh puts every benchmark's log in one file).
logged() {
  local name=${GPU_LOG:-$1} secs=$2 rc
  shift 2
  echo "== $(date -u +%FT%TZ) $name: $* (limit ${secs}s)" | tee -a "$GPU_OUT/$name.log"
  set -o pipefail
  timeout -k 15 "$secs" "$@" 2>&1 | tee -a "$GPU_OUT/$name.log"
  rc=$?
  set +o pipefail
  [ "$rc" = 124 ] && echo "!! $name: stopped after ${secs}s (timeout)" | tee -a "$GPU_OUT/$name.log"
  echo "exit=$rc ($name: $*)" | tee -a "$GPU_OUT/$name.log"
  return "$rc"
}

install_wheels() {  # the test and table tools carried as wheels (no package index on the GPU machine)
  [ -d .gpu-wheels ] || return 0
  [ -f "$STATE/wheels.done" ] && return 0
  local reqs=() w
  for w in ${GPU_WHEELS:-pytest pytest-timeout hypothesis expecttest rich ninja setuptools>=77}; do
    reqs+=("${w//\"/}")
  done
  # Installs only what is missing or too old; what the image already has stays.
  logged "$1" 120 "$PYTHON" -m pip install -q --no-index --find-links .gpu-wheels "${reqs[@]}" && touch "$STATE/wheels.done"
}

sources_hash() {
  { "$PYTHON" -c 'import sys, torch; print(torch.__version__, sys.version_info[:2])' 2>&1; echo "$ARCH"
    find csrc setup.py pyproject.toml -type f | LC_ALL=C sort | xargs cat; } | sha256sum | cut -d' ' -f1
}

ext_path() { echo "fastcoll/_C$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"; }

has_cuda_kernels() {
  "$PYTHON" -c 'import sys, fastcoll; sys.exit(0 if fastcoll.build_info()["cuda_kernels"] else 1)' >/dev/null 2>&1
}

build() {
  local rc so
  install_wheels build
  rm -f "$STATE/ext.sha256" "$STATE/build.failed"
  FASTCOLL_CUDA=1 TORCH_CUDA_ARCH_LIST="$ARCH" MAX_JOBS=${MAX_JOBS:-$(nproc)} \
    logged build "$(limit 300)" "$PYTHON" setup.py build_ext --inplace
  rc=$?
  logged build 60 "$PYTHON" -c "import fastcoll, json; i = fastcoll.build_info(); print(json.dumps(i, indent=1)); \
assert i['cuda_kernels'], 'the CUDA kernels are not in the build'" || rc=1
  if [ "$rc" != 0 ]; then
    sources_hash > "$STATE/build.failed"  # not retried by later steps until the sources change
    return "$rc"
  fi
  so=$(ext_path)
  # The library's headers and sections, for reading back here (issue 32 item 2).
  { echo "== readelf -Wh -Wd, objdump -h: $so"; readelf -Wh -Wd "$so"; objdump -h "$so"; } >>"$GPU_OUT/build.log" 2>&1
  cp "$so" "$STATE/ext.so" && (strip --strip-debug "$STATE/ext.so" 2>/dev/null || true)
  sources_hash > "$STATE/ext.sha256"
  if [ -n "${OUT:-}" ] && [ "$(stat -c %s "$STATE/ext.so")" -lt 16000000 ]; then
    cp "$STATE/ext.so" "$STATE/ext.sha256" "$GPU_OUT/"  # carried back as build/gpu-check by the next call
  fi
  return 0
}

# Build unless a usable extension is in place (or a carried one from build/gpu-check matches the sources).
ensure_built() {
  local so
  if [ -f "$STATE/ext.so" ] && [ "$(cat "$STATE/ext.sha256" 2>/dev/null)" = "$(sources_hash)" ]; then
    so=$(ext_path)
    if ! cmp -s "$STATE/ext.so" "$so" && ! has_cuda_kernels; then
      cp "$STATE/ext.so" "$so"  # a fresh machine: the extension carried from an earlier call
    fi
    if has_cuda_kernels; then
      echo "gpu_check: using the extension built from these sources ($STATE/ext.sha256)"
      return 0
    fi
  fi
  if [ "$(cat "$STATE/build.failed" 2>/dev/null)" = "$(sources_hash)" ]; then
    echo "gpu_check: the build of these sources failed earlier on this machine (build.log); not retrying: run \`make gpu-build\`"
    return 1
  fi
  build
}

pad_py() {  # the slot-padding counts and timings (issue 14 item 7), in Python
  cat <<'PY'
"""Slot padding (issue 14 item 7): what padding every bucket slot to 16 bytes would cost and gain.

copy_chunk.cuh copies a chunk with 16-byte vectors only when source and destination are co-aligned;
a bucket slot that starts off a 16-byte boundary (after a parameter whose byte size is not a multiple
of 16) is copied element by element, and so is every later slot that stays off it.

counts: the bench models (fastcoll/bench/model_shapes.json) and variants with odd-sized heads, bucketed
as fastcoll.DDP does (reverse registration order, 1 MiB first bucket, 25 MiB after): per bucket the
parameters whose byte size is not a multiple of 16, the slots off a 16-byte boundary, the elements the
kernel copies one by one (packing from separately allocated, 512-byte aligned gradients, and unpacking
into them; the rule of copy_chunk: head up to the source's boundary, vectors if the destination is then
aligned, else scalar), and the bytes padding each slot to 16 bytes of the wire would add.
time (GPU): flatten_scale / unflatten_scale of buckets of the same bytes whose slots are all aligned,
all shifted 4 bytes off (a 1-element tensor first), of odd sizes (every residue), and padded back to
16 bytes; fp32 and bf16 wire; median of CUDA-event-timed loops, inputs rotated past the L2 cache.
"""

import json
import math
import sys

import torch

CHUNK_BYTES = 64 * 1024  # kChunkBytes
MiB = 1 << 20


def split(src: int, dst: int, n: int, ss: int, ds: int):
    """(scalar, vector) elements of copying n elements from address src (ss bytes each) to dst (ds bytes each)."""
    widest = max(ss, ds)
    per, kvec = CHUNK_BYTES // widest, 16 // widest
    sa, da = kvec * ss, kvec * ds
    scalar = vector = 0
    for start in range(0, n, per):
        m = min(per, n - start)
        s, d = src + start * ss, dst + start * ds
        head = min(((sa - s % sa) % sa) // ss, m)
        if (d + head * ds) % da:
            scalar += m
            continue
        nv = (m - head) // kvec
        vector += nv * kvec
        scalar += m - nv * kvec
    return scalar, vector


def bucket_rows(shapes, psize: int, wsize: int):
    from fastcoll.bucketing import ParamSpec, assign_buckets, reverse_registration_order

    specs = [ParamSpec(math.prod(s), psize, "g") for s in shapes]
    rows = []
    for b in assign_buckets(specs, reverse_registration_order(len(specs)), MiB, 25 * MiB):
        off = padded = total = odd = off16 = scal_pack = scal_unpack = 0
        q = 16 // wsize  # elements of 16 bytes of the wire
        for i in b:
            n = specs[i].numel
            odd += (n * psize) % 16 != 0
            off16 += (off * wsize) % 16 != 0
            scal_pack += split(0, off * wsize, n, psize, wsize)[0]
            scal_unpack += split(off * wsize, 0, n, wsize, psize)[0]
            padded = -(-padded // q) * q + n
            off += n
            total += n
        rows.append({"params": len(b), "numel": total, "wire_bytes": total * wsize, "odd_params": odd, "slots_off_16B": off16,
                     "scalar_pack": scal_pack, "scalar_unpack": scal_unpack, "pad_bytes": (-(-padded // q) * q - total) * wsize})
    return rows


def counts(verbose: bool = True):
    from fastcoll.bench.models import model_shapes

    shapes = {k: [s for _, s in v] for k, v in model_shapes().items()}
    r50, bert = shapes["resnet50"], shapes["bert_base"]
    models = {
        "resnet50": r50,
        "gpt2_small": shapes["gpt2_small"],
        "bert_base": bert,
        "resnet50, 10-class head": r50[:-2] + [(10, 2048), (10,)],
        "resnet50, 81-class head": r50[:-2] + [(81, 2048), (81,)],
        "bert_base + 2-label classifier": bert + [(2, 768), (2,)],
        "bert_base + MLM head (bias 30522)": bert + [(768, 768), (768,), (768,), (768,), (30522,)],
    }
    wires = {"fp32": (4, 4), "fp32 grads, fp16/bf16 wire": (4, 2), "bf16 grads": (2, 2)}
    out = {}
    if verbose:
        print(f"{'model':36s} {'wire':28s} {'buckets':>7s} {'odd':>4s} {'off16':>5s} {'scalar pack':>19s} {'pad B':>6s}  worst bucket")
    for name, sh in models.items():
        for wname, (ps, ws) in wires.items():
            rows = bucket_rows(sh, ps, ws)
            total = sum(r["numel"] for r in rows)
            sp = sum(r["scalar_pack"] for r in rows)
            worst = max(rows, key=lambda r: r["scalar_pack"])
            out[f"{name} | {wname}"] = {"buckets": rows, "scalar_pack": sp, "scalar_unpack": sum(r["scalar_unpack"] for r in rows),
                                        "numel": total, "pad_bytes": sum(r["pad_bytes"] for r in rows)}
            if verbose:
                w = (f"{worst['wire_bytes'] / MiB:.2f} MiB: {100 * worst['scalar_pack'] / worst['numel']:.0f}% scalar"
                     if worst["scalar_pack"] else "-")
                print(f"{name:36s} {wname:28s} {len(rows):7d} {sum(r['odd_params'] for r in rows):4d} "
                      f"{sum(r['slots_off_16B'] for r in rows):5d} {sp:>10d} ({100 * sp / total:5.2f}%) "
                      f"{sum(r['pad_bytes'] for r in rows):6d}  {w}")
    return out


def median_time(fn, inner=10, reps=25):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e-3 / inner)
    ts.sort()
    return {"median_s": ts[len(ts) // 2], "q1_s": ts[len(ts) // 4], "q3_s": ts[3 * len(ts) // 4]}


def variants(total_bytes: int, ntensors: int):
    base = total_bytes // 4 // ntensors // 4 * 4
    sizes = [base + 4 * (k % 7) for k in range(ntensors)]
    return {"aligned": sizes, "shifted": [1] + sizes, "odd sizes": [s + 1 for s in sizes], "padded": [s + 4 for s in sizes]}


def time_buckets(out_path: str):
    if not torch.cuda.is_available():
        print("pad: no GPU (torch.cuda.is_available() is False)")
        return 2
    import fastcoll
    from fastcoll import ops
    from fastcoll.bench.report import machine_info

    info = fastcoll.build_info()
    if not info.get("cuda_kernels"):
        print("pad: WARNING: the CUDA kernels are not built; this times the pure-PyTorch reference")
    rows = []
    scale = 0.125
    for total in (4 * MiB, 25 * MiB):
        for ntensors in (64, 448):
            for wire in (torch.float32, torch.bfloat16):
                base = None
                for vname, sizes in variants(total, ntensors).items():
                    numel = sum(sizes)
                    sets = max(1, math.ceil(120 * MiB / (2 * numel * 4)))  # rotate past the 50-60 MB L2
                    grads = [[torch.randn(n, device="cuda") for n in sizes] for _ in range(sets)]
                    dests = [[torch.empty_like(g) for g in gs] for gs in grads]
                    flats = [torch.empty(numel, device="cuda", dtype=wire) for _ in range(sets)]
                    ops.flatten_scale(grads[0], flats[0], scale)
                    ops.unflatten_scale(flats[0], dests[0], 1.0)
                    torch.cuda.synchronize()
                    want = torch.cat(grads[0]) * scale
                    ok = torch.equal(flats[0], want.to(wire)) and torch.equal(torch.cat(dests[0]), flats[0].float())
                    scal = vec = off = 0
                    f0 = flats[0].data_ptr()
                    ws = flats[0].element_size()
                    for g in grads[0]:
                        s_, v_ = split(g.data_ptr(), f0 + off * ws, g.numel(), 4, ws)
                        scal, vec, off = scal + s_, vec + v_, off + g.numel()
                    k = {"i": 0}

                    def pack():
                        i = k["i"] = (k["i"] + 1) % sets
                        ops.flatten_scale(grads[i], flats[i], scale)

                    def unpack():
                        i = k["i"] = (k["i"] + 1) % sets
                        ops.unflatten_scale(flats[i], dests[i], 1.0)

                    tp, tu = median_time(pack), median_time(unpack)
                    rt = tp["median_s"] + tu["median_s"]
                    base = rt if vname == "aligned" else base
                    moved = 2 * numel * (4 + ws)  # read + write, both directions
                    row = {"bytes": total, "tensors": len(sizes), "wire": str(wire).replace("torch.", ""), "layout": vname,
                           "numel": numel, "correct": ok, "scalar_elements": scal, "vector_elements": vec, "pack": tp,
                           "unpack": tu, "round_trip_s": rt, "vs_aligned": rt / base, "gb_s": moved / rt / 1e9}
                    rows.append(row)
                    print(f"{total // MiB:3d} MiB {len(sizes):4d} tensors {row['wire']:8s} {vname:10s} scalar "
                          f"{100 * scal / numel:5.1f}%  pack {tp['median_s'] * 1e6:8.1f} us  unpack {tu['median_s'] * 1e6:8.1f} us"
                          f"  {row['vs_aligned']:5.2f}x aligned  {row['gb_s']:7.1f} GB/s{'' if ok else '  WRONG RESULT'}")
                    del grads, dests, flats
    worst = max((r for r in rows if r["layout"] in ("shifted", "odd sizes") and r["bytes"] == 25 * MiB),
                key=lambda r: r["vs_aligned"])
    verdict = (f"misaligned 25 MiB round trip {worst['vs_aligned']:.2f}x the aligned one ({worst['layout']}, {worst['wire']}, "
               f"{worst['tensors']} tensors): "
               + ("worth fixing (>= 1.2x): a kernel-side fallback to 8/4-byte vectors, or 16-byte slot padding"
                  if worst["vs_aligned"] >= 1.2 else "not worth padding (< 1.2x): keep the layout as it is"))
    print("pad:", verdict)
    payload = {"benchmark": "slot_padding", "machine": machine_info("cuda"), "build": info, "rows": rows,
               "verdict": verdict, "counts": counts(verbose=False)}
    with open(out_path, "w") as f:
        json.dump(payload, f, indent=1, default=str)
    print(f"pad: wrote {out_path}")
    return 0 if all(r["correct"] for r in rows) else 1


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "counts"
    if mode == "counts":
        counts()
        sys.exit(0)
    sys.exit(time_buckets(sys.argv[2]))
PY
}

bench_charts_out() {  # keep $GPU_OUT to logs and JSON (the device tool brings back 8 files)
  mkdir -p "$STATE/charts"
  mv -f "$GPU_OUT"/*.png "$STATE/charts/" 2>/dev/null || true
}

case "$step" in
  build)
    build
    exit $?
    ;;
  test)
    install_wheels test
    ensure_built || echo "gpu_check: testing without the CUDA kernels (kernel tests skip or fail)" | tee -a "$GPU_OUT/test.log"
    # -v prints each test as it starts: a hang or a timeout still shows which test it was. A test
    # that kills the process (SIGSEGV 139, SIGABRT 134) is named, run alone under cuda-gdb for a
    # native backtrace, and deselected; the run then goes on with the tests not yet run (those with
    # a result in the log are deselected too; at most 5 crashes), all within the step's one limit.
    deadline=$(($(date +%s) + $(limit 290)))
    deselected=()
    crashes=()
    for attempt in 1 2 3 4 5 6; do
      left=$((deadline - $(date +%s)))
      [ "$left" -ge 20 ] || { echo "gpu_check: no time left for more tests" | tee -a "$GPU_OUT/test.log"; exit 124; }
      # shellcheck disable=SC2086  # GPU_TESTS: test files in the order to run them (default: tests/)
      logged test "$left" "$PYTHON" -m pytest -v -p no:cacheprovider -m cuda ${GPU_TESTS:-tests} \
        --junitxml="$GPU_OUT/test.xml" --durations=15 ${PYTEST_ARGS:-} "${deselected[@]}"
      rc=$?
      if { [ "$rc" != 139 ] && [ "$rc" != 134 ]; } || [ "$attempt" = 6 ]; then
        [ "$rc" = 0 ] && [ "${#crashes[@]}" -gt 0 ] && rc=1  # the others passed; the crashes still fail the step
        exit "$rc"
      fi
      crashed=$(grep -E '^tests/[^ ]+::' "$GPU_OUT/test.log" | tail -1 | sed -E 's/ (Fatal Python error|PASSED|FAILED|SKIPPED|ERROR).*//')
      [ -n "$crashed" ] || exit "$rc"
      echo "gpu_check: CRASHED (exit $rc): $crashed; its native backtrace, then the other tests" | tee -a "$GPU_OUT/test.log"
      if command -v cuda-gdb >/dev/null; then
        timeout -k 5 90 cuda-gdb -q -batch -ex run -ex bt --args "$PYTHON" -m pytest -q -p no:cacheprovider \
          "$crashed" 2>&1 | grep -vE '^\[(New|Thread|Detaching)' | tail -60 >>"$GPU_OUT/test.log"
      fi
      deselected=()
      while IFS= read -r done_id; do
        deselected+=(--deselect "$done_id")
      done < <(grep -E '^tests/[^ ]+::.* (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)' "$GPU_OUT/test.log" |
        sed -E 's/ (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS).*//' | sort -u)
      crashes+=("$crashed")
      for c in "${crashes[@]}"; do deselected+=(--deselect "$c"); done
    done
    ;;
  bench-ops)
    ensure_built || echo "gpu_check: benchmarking without the CUDA kernels" | tee -a "$GPU_OUT/ops.log"
    logged ops "$(limit 200)" "$PYTHON" -m fastcoll.bench ops --device cuda --json "$GPU_OUT/ops_cuda.json" ${BENCH_ARGS:-}
    rc=$?
    [ "${GPU_PAD:-1}" = 0 ] && { bench_charts_out; exit "$rc"; }  # GPU_PAD=0: no slot-padding timings
    pad_py > "$STATE/pad.py"
    logged ops "$(limit 100)" env PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" "$STATE/pad.py" time "$GPU_OUT/pad_cuda.json" || rc=1
    bench_charts_out
    exit "$rc"
    ;;
  bench-plan)
    ensure_built || echo "gpu_check: benchmarking without the CUDA kernels" | tee -a "$GPU_OUT/${GPU_LOG:-plan}.log"
    # Bucket plans (issue 32 item 3): host time per call with and without a plan, and the planned pack +
    # unpack's device time against the copy floor, on 25 MiB buckets of 448 and of 1024 float32 tensors.
    rc=0
    for shape in "--tensors 448 --elements 14628" "--tensors 1024 --elements 6400"; do
      # shellcheck disable=SC2086
      logged plan "$(limit 60)" "$PYTHON" benchmarks/plan_host_time.py --device cuda --reps 15 --inner 50 $shape || rc=1
    done
    exit "$rc"
    ;;
  bench-zero)
    ensure_built || echo "gpu_check: benchmarking without the CUDA kernels" | tee -a "$GPU_OUT/${GPU_LOG:-zero}.log"
    # One GPU: one NCCL rank with FASTCOLL_FORCE_COLLECTIVES=1 (the bench sets it); then the bf16 and pool sections.
    logged zero "$(limit 300)" "$PYTHON" -m fastcoll.bench zero --device cuda --json "$GPU_OUT/zero_cuda.json" ${BENCH_ARGS:-}
    rc=$?
    bench_charts_out
    exit "$rc"
    ;;
  bench-ddp)
    ensure_built || echo "gpu_check: benchmarking without the CUDA kernels" | tee -a "$GPU_OUT/ddp.log"
    # FASTCOLL_FORCE_COLLECTIVES unset: the bench runs both passes (=0, then =1) and writes the JSON after each.
    # GPU_DDP_PASS=forced (or plain): that pass alone.
    case "${GPU_DDP_PASS:-}" in forced) force=(env FASTCOLL_FORCE_COLLECTIVES=1) ;; plain) force=(env FASTCOLL_FORCE_COLLECTIVES=0) ;;
      *) force=(env -u FASTCOLL_FORCE_COLLECTIVES) ;; esac
    logged ddp "$(limit 560)" "${force[@]}" "$PYTHON" -m fastcoll.bench ddp --device cuda \
      --json "$GPU_OUT/ddp_cuda.json" ${BENCH_ARGS:-}
    rc=$?
    bench_charts_out
    exit "$rc"
    ;;
  pad-counts)
    pad_py > "$STATE/pad.py"
    logged pad "$(limit 100)" env PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" "$STATE/pad.py" counts
    exit $?
    ;;
  *)
    echo "gpu_check: unknown step '$step' (build, test, bench-ops, bench-plan, bench-zero, bench-ddp, pad-counts)" >&2
    exit 2
    ;;
esac

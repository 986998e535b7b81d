#!/usr/bin/env bash
# GPU verification of jcoccl (one H200, at most 6 minutes, run once). Steps, most valuable first:
#   build        tools/gpu_build.py: finds nvcc, pip install -e (offline), else plain CMake
#   import       jcoccl._cuda loads, NCCL version, jax sees the GPU
#   codecs       CUDA codecs vs the jnp spec run on the CPU, bit for bit (tools/gpu_codecs.py)
#   plugin       the example codec plugin built with CUDA against this install, its kernels
#                on the GPU vs its jnp spec on the CPU (tools/gpu_plugin.py)
#   single       every fused op at world size 1, fused vs xla backend, bit for bit
#   world2       2 processes on the one GPU over NCCL's socket transport: engine ops vs the
#                jnp spec, NCCL's plain ops vs numpy (tools/gpu_collectives.py launch)
#   world4       the same with 4 processes
#   xla_comm     does XLA hand an FFI handler its own communicator (tools/xla_comm_probe.py)
#   nccl_interposer  docs/nccl.md's train.py (GSPMD jit, never imports jcoccl), 2 processes,
#                plain and with libjcoccl_nccl.so in three XLA modes (command buffers on and
#                off, nonblocking communicators): NCCL bytes, step-time ratio, loss difference
#                (tools/gpu_nccl_interposer.py; --cpu: on CPU, the emulation-built library)
#   codec_bench  codec throughput vs the device copy bandwidth:   } JCOCCL_GPU_ROUNDS rounds
#                jitted calls, and the kernels alone timed with  }
#                CUDA events (decode_sum, decode_sum_encode too)  }
#   bench2       compressed vs NCCL collectives at world 2         } (default 3), steps
#                (nccl-tests algbw/busbw)                          } named *_r1, *_r2, ...
#   fp8_probe    fp8 at 256 MiB and 1 GiB with XLA's preallocation on and off (the 1 GiB
#                fp8 decode anomaly of the first H200 run)
#   ncu          Nsight Compute on the codec kernels (throughput, occupancy, launch shape)
#   cuda_ext     (--cpu only) the CUDA handlers, fused engine and NCCL transport built against
#                the host shim and an NCCL emulation: op matrix vs the CPU paths, seeded
#                host-side bugs caught (tools/cuda_ext_check.py check)
#   report       summary.json / summary.txt from every JSON written, with the median and
#                spread over rounds of every timing
# Every step writes its JSON as it goes (a step cut short keeps what it finished), prints a
# one-line `=== VERDICT [step] ...`, and runs under its own time limit, clipped so that the
# whole run stays within JCOCCL_GPU_BUDGET_S (default 340 s on the GPU, so that with the
# report and the packing the script ends within 6 minutes; 500 s for the slower CPU dry run)
# with 20 s kept for the report.
# Step limits: see benchmarks/README.md for the CPU dry-run times they were set from.
#
# Usage: tools/gpu_check.sh [--cpu] [OUT]   (OUT defaults to $OUT, else ./gpu_out)
#   --cpu   the CI dry run: every step on the CPU at world size 1 (host transport), small
#           sizes; world2/world4 are skipped. JCOCCL_GPU_QUICK=1 (CI's dry run) narrows the
#           codecs, codec_bench, single and world1 steps to one compressor, plugin to one
#           block size and dtype, cuda_ext to one seeded bug and nccl_interposer to one of
#           XLA's modes (tests/ check the rest).
# While running, OUT/<step>.json and <step>.log appear step by step; at the end OUT holds
# summary.json (every step's JSON), summary.txt and logs.tgz (the rest). Exit status:
# non-zero if any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=gpu
if [ "${1:-}" = "--cpu" ]; then
  MODE=cpu
  shift
fi
OUT="${1:-${OUT:-./gpu_out}}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
STATUS=0
declare -a STEPS=()
BUDGET="${JCOCCL_GPU_BUDGET_S:-340}"
if [ "$MODE" = cpu ]; then BUDGET="${JCOCCL_GPU_BUDGET_S:-500}"; fi
RESERVE=20
START=$SECONDS

step() {  # step NAME SECONDS CMD... : runs CMD under timeout, logs to OUT/NAME.log
  local name="$1" secs="$2"
  shift 2
  local left=$((BUDGET - (SECONDS - START)))
  if [ "$name" != report ]; then left=$((left - RESERVE)); fi
  if [ "$left" -lt 10 ]; then
    echo "=== VERDICT [$name] SKIPPED: time budget spent" | tee "$OUT/$name.log"
    STEPS+=("$name skipped (budget)")
    STATUS=1
    return 0
  fi
  if [ "$secs" -gt "$left" ]; then secs=$left; fi
  echo "=== [$name] (limit ${secs}s): $*"
  local t0=$SECONDS rc=0
  timeout --kill-after=5 "$secs" "$@" > >(tee "$OUT/$name.log") 2>&1 || rc=$?
  sleep 0.2  # let tee finish the log
  local dt=$((SECONDS - t0)) verdict
  case $rc in
    0) verdict=PASS ;;
    124|137) verdict="TIMEOUT after ${dt}s" ;;
    *) verdict="FAIL rc=$rc" ;;
  esac
  local own
  own=$(grep -h "^VERDICT" "$OUT/$name.log" | tail -n 1)
  echo "=== VERDICT [$name] $verdict in ${dt}s${own:+ | $own}"
  STEPS+=("$name $verdict ${dt}s${own:+ | $own}")
  if [ "$rc" -ne 0 ]; then STATUS=1; fi
  return 0
}

skip() {  # skip NAME REASON
  echo "=== VERDICT [$1] SKIPPED: $2" | tee "$OUT/$1.log"
  STEPS+=("$1 skipped ($2)")
}

export XLA_PYTHON_CLIENT_PREALLOCATE=false
export JCOCCL_TIMEOUT_S="${JCOCCL_TIMEOUT_S:-30}"
GC=tools/gpu_collectives.py
if [ "$MODE" = gpu ]; then
  nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
  step build 150 "$PY" tools/gpu_build.py --python "$PY" --env-file "$OUT/build_env.sh"
  # shellcheck disable=SC1091
  if [ -f "$OUT/build_env.sh" ]; then source "$OUT/build_env.sh"; fi
  step import 20 "$PY" -c "from jcoccl import native; m = native.module('cuda'); \
print('jcoccl._cuda', m, native.import_error('cuda')); print('nccl', m.nccl_version()); \
import jax; print(jax.devices())"
  step codecs 90 "$PY" tools/gpu_codecs.py --skip-bench --out "$OUT/codecs.json"
  step plugin 60 "$PY" tools/gpu_plugin.py --out "$OUT/plugin.json"
  step single 50 "$PY" "$GC" single --out "$OUT/single.json"
  # `launch` exits 3 and prints "NCCL REFUSED" if NCCL will not run ranks on one GPU; its
  # deadline comes before the step limit so that its summary is always written.
  step world2 60 "$PY" "$GC" launch --world 2 --timeout 20 --deadline 50 --dir "$OUT/world2" \
    --out "$OUT/world2.json"
  step world4 60 "$PY" "$GC" launch --world 4 --timeout 20 --deadline 50 --dir "$OUT/world4" \
    --out "$OUT/world4.json"
  step xla_comm 30 "$PY" tools/xla_comm_probe.py --platform cuda --out "$OUT/xla_comm.json"
  step nccl_interposer 150 "$PY" tools/gpu_nccl_interposer.py --timeout 35 \
    --dir "$OUT/nccl_interposer" --out "$OUT/nccl_interposer.json"
  # Timings in rounds, each round timing every codec and collective once: the report gives
  # each figure's median and its spread over the rounds.
  for r in $(seq 1 "${JCOCCL_GPU_ROUNDS:-3}"); do
    step "codec_bench_r$r" 45 "$PY" tools/gpu_codecs.py --skip-check --sizes-mib 256,1024 \
      --iters 10 --out "$OUT/codec_bench_r$r.json"
    step "bench2_r$r" 40 "$PY" "$GC" launch --world 2 --no-checks --bench --sizes-mib 1 16 64 \
      --iters 5 --timeout 20 --deadline 32 --dir "$OUT/bench2_r$r" --out "$OUT/bench2_r$r.json"
  done
  step fp8_probe 60 "$PY" tools/gpu_codecs.py --skip-check --prealloc-probe 256,1024 --iters 5 \
    --out "$OUT/fp8_probe.json"
  # Where each codec kernel spends its time (throughput against the chip's limits,
  # occupancy, launch shape): the 20 codec launches of one 256 MiB round (jitted calls only:
  # encode and decode of int8, int4, fp8, hadamard(int4) and spike(int4), a warm-up and a
  # timed call each).
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null \
    | tail -n 1)
  if [ -n "$NCU" ]; then
    mkdir -p "$OUT/ncu"
    step ncu 90 "$NCU" --clock-control none \
      -k "regex:Chunks|EncodeBlocks|Elementwise|Hadamard|Spike" -c 20 \
      --section SpeedOfLight --section Occupancy --section LaunchStats \
      "$PY" tools/gpu_codecs.py --skip-check --no-events --sizes-mib 256 --iters 1 \
      --out "$OUT/ncu/bench.json"
  else
    skip ncu "no ncu on this machine"
  fi
  if grep -q "NCCL REFUSED" "$OUT/world2.log" "$OUT/world4.log" 2>/dev/null; then
    echo "NOTE: NCCL refused several ranks on one GPU; see $OUT/world*.log"
  fi
else
  ONLY=()
  COMPS=()
  QUICK=()
  BENCH=()
  MODES=()
  if [ "${JCOCCL_GPU_QUICK:-0}" = 1 ]; then
    ONLY=(--only 'int8:block=32$')
    COMPS=(--compressors '^int8$')
    QUICK=(--quick)
    BENCH=(--bench-codecs '^int8$')
    # XLA:CPU reads none of the modes' GPU flags: on the CPU they are the same run.
    MODES=(--modes nonblocking)
  fi
  step build 30 "$PY" tools/gpu_build.py --python "$PY" --dry-run
  step import 30 "$PY" -c "from jcoccl import native; m = native.module('cpu'); \
print('jcoccl._cpu', m); import jax; print(jax.devices())"
  step codecs 300 "$PY" tools/gpu_codecs.py --platform cpu --skip-bench "${ONLY[@]}" \
    --out "$OUT/codecs.json"
  step plugin 60 "$PY" tools/gpu_plugin.py --platform cpu "${QUICK[@]}" --out "$OUT/plugin.json"
  step single 120 "$PY" "$GC" single --platform cpu "${COMPS[@]}" --out "$OUT/single.json"
  step world1 120 "$PY" "$GC" launch --world 1 --platform cpu --timeout 60 --deadline 110 \
    "${COMPS[@]}" --dir "$OUT/world1" --out "$OUT/world1.json"
  skip world2 "needs a GPU (the host transport is in-process)"
  skip world4 "needs a GPU (the host transport is in-process)"
  step codec_bench 60 "$PY" tools/gpu_codecs.py --platform cpu --skip-check --sizes-mib 1 \
    --iters 2 "${BENCH[@]}" --out "$OUT/codec_bench.json"
  step fp8_probe 60 "$PY" tools/gpu_codecs.py --platform cpu --skip-check --prealloc-probe 0.25 \
    --iters 1 --out "$OUT/fp8_probe.json"
  step bench1 60 "$PY" "$GC" launch --world 1 --platform cpu --no-checks --bench \
    --sizes-mib 0.25 --iters 1 --timeout 30 --deadline 55 --dir "$OUT/bench1" \
    --out "$OUT/bench1.json"
  step cuda_ext 240 "$PY" tools/cuda_ext_check.py check "${QUICK[@]}" --out "$OUT/cuda_ext.json"
  step nccl_interposer 120 "$PY" tools/gpu_nccl_interposer.py --cpu "${MODES[@]}" \
    --dir "$OUT/nccl_interposer" --out "$OUT/nccl_interposer.json"
fi

step report 20 "$PY" "$GC" report --dir "$OUT"
{
  echo "# steps ($MODE, $((SECONDS - START)) s of a ${BUDGET} s budget)"
  for s in "${STEPS[@]}"; do echo "$s"; done
} | tee -a "$OUT/summary.txt"
# The device tool returns at most 8 files from $OUT: keep summary.json (every step's JSON,
# merged) and summary.txt as they are, and pack everything else into one archive.
(cd "$OUT" && find . -mindepth 1 -maxdepth 1 ! -name summary.json ! -name summary.txt \
   ! -name logs.tgz -printf '%P\n' | tar czf logs.tgz -T - && \
 find . -mindepth 1 -maxdepth 1 ! -name summary.json ! -name summary.txt ! -name logs.tgz \
   -exec rm -rf {} +) || true
exit "$STATUS"

#!/usr/bin/env bash
# GPU verification of jcoccl (one H200, about 8 minutes): builds the CUDA extension, checks
# the CUDA codecs bit for bit, checks every fused collective at world size 1 (fused vs xla
# backend) and at 2 and 4 processes on the one GPU over NCCL's socket transport (against the
# jnp specification), and times compressed vs uncompressed collectives.
#
# Usage: tools/gpu_check.sh [OUT]   (OUT defaults to $OUT, else ./gpu_out)
# Writes OUT/{codecs.json, single.json, world2.json, world4.json, summary.json, summary.txt,
# logs.tgz (every step's log)}. Each step has its own time limit; a failed step is recorded and the
# remaining steps still run; the exit status is non-zero if any step failed.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-${OUT:-./gpu_out}}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
STATUS=0
declare -a STEPS=()

# Whole-run budget (seconds): a step never runs past it, and is skipped when it is spent.
BUDGET="${JCOCCL_GPU_BUDGET_S:-470}"
START=$SECONDS

step() {  # step NAME SECONDS CMD... : runs CMD under timeout, logs to OUT/NAME.log
  local name="$1" secs="$2"
  shift 2
  local left=$((BUDGET - (SECONDS - START)))
  if [ "$left" -lt 15 ]; then
    echo "=== [$name] SKIPPED: time budget spent" | tee "$OUT/$name.log"
    STEPS+=("$name skipped (budget)")
    STATUS=1
    return 0
  fi
  if [ "$secs" -gt "$left" ]; then secs=$left; fi
  echo "=== [$name] (limit ${secs}s): $*"
  local t0=$SECONDS rc=0
  timeout --kill-after=10 "$secs" "$@" > >(tee "$OUT/$name.log") 2>&1 || rc=$?
  echo "=== [$name] rc=$rc in $((SECONDS - t0))s"
  STEPS+=("$name rc=$rc $((SECONDS - t0))s")
  if [ "$rc" -ne 0 ]; then STATUS=1; fi
  return 0
}

export XLA_PYTHON_CLIENT_PREALLOCATE=false
export JCOCCL_TIMEOUT_S="${JCOCCL_TIMEOUT_S:-60}"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true

# 1) Build the CUDA extension offline (no network there: no build isolation, no deps).
step build 240 env JCOCCL_CUDA=ON "$PY" -m pip install --no-build-isolation --no-deps -e .
step import 30 "$PY" -c "from jcoccl._src import _ffi; m = _ffi.native_module('cuda'); \
print('jcoccl._cuda', m, _ffi.native_import_error('cuda')); print('nccl', m.nccl_version()); \
import jax; print(jax.devices())"

# 2) CUDA codecs: bit-exact checks and bandwidth (script owned by the codec kernels).
if [ -f tools/gpu_codecs.py ]; then
  step codecs 120 "$PY" tools/gpu_codecs.py --out "$OUT/codecs.json"
else
  echo "tools/gpu_codecs.py not found: codec step skipped" | tee "$OUT/codecs.log"
fi

# 3) Every fused op at world size 1 through jax on the GPU vs the XLA backend.
step single 90 "$PY" tools/gpu_collectives.py single --out "$OUT/single.json"

# 4+5) 2 and 4 processes on the one GPU (distinct NCCL_HOSTID, NCCL_SOCKET_IFNAME=lo):
# correctness against the jnp specification, then compressed vs uncompressed timings.
# `launch` exits 3 and prints "NCCL REFUSED" if NCCL will not run ranks on one GPU.
step world2 130 "$PY" tools/gpu_collectives.py launch --world 2 --bench \
  --sizes-mib 1 16 64 --iters 5 --timeout 30 --out "$OUT/world2.json"
step world4 130 "$PY" tools/gpu_collectives.py launch --world 4 --bench \
  --sizes-mib 1 16 64 --iters 3 --timeout 30 --out "$OUT/world4.json"
if grep -q "NCCL REFUSED" "$OUT/world2.log" "$OUT/world4.log" 2>/dev/null; then
  echo "NOTE: NCCL refused several ranks on one GPU; see $OUT/world*.log"
fi

# 6) JSON + text summary.
step report 20 "$PY" tools/gpu_collectives.py report --dir "$OUT"
{
  echo "# steps"
  for s in "${STEPS[@]}"; do echo "$s"; done
} | tee -a "$OUT/summary.txt"
# The device tool returns at most 8 files from $OUT: keep the JSON and the summary as they
# are and pack the logs into one archive.
(cd "$OUT" && tar czf logs.tgz ./*.log nvidia-smi.txt 2>/dev/null && rm -f ./*.log nvidia-smi.txt) || true
exit "$STATUS"

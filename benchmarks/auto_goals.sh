#!/usr/bin/env bash
# The measurements behind the goals of algorithm="auto" (docs/multiprocess.md, calibration):
# each configuration calibrated, then auto timed against the lax op in the same run, repeated.
#
#   bash benchmarks/auto_goals.sh OUT_DIR [REPEATS]
#
# 1. One process, 8 host CPU devices: int8 all_reduce of 16 MiB, auto vs lax.psum (and
#    two_shot, the compressed algorithm auto would otherwise take).
# 2. 4 processes on one shaped link (1 and 10 Gbit/s): the same, per-rank 16 MiB.
# 3. End to end: benchmarks/train_e2e.py (2 processes x 4 devices; models.train calibrates
#    at start) unshaped, 10 and 1 Gbit/s, and a compute-heavier batch unshaped and 1 Gbit/s.
# Every output goes to OUT_DIR (the calibrated models as JSON next to the tables).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bash benchmarks/auto_goals.sh OUT_DIR [REPEATS]}
repeats=${2:-3}
py=${PYTHON:-.venv/bin/python}
mkdir -p "$out"
collectives=(--sizes 16MiB --ops all_reduce --compressors int8 --algorithms auto,two_shot --iters 9)
for r in $(seq 1 "$repeats"); do
  # Calibrated on the axis the collectives benchmark runs on ("r"), so auto finds its model.
  "$py" -m jcoccl.bench calibrate --mesh r=8 --out "$out/cm-1proc-r$r.json" > "$out/calibrate-1proc-r$r.txt"
  JCOCCL_COST_MODEL="$out/cm-1proc-r$r.json" "$py" -m jcoccl.bench collectives "${collectives[@]}" \
    > "$out/collectives-1proc-r$r.txt"
  for rate in 1gbit 10gbit; do
    "$py" -m jcoccl.bench calibrate --processes 4 --link-rate "$rate" --mesh r=4 \
      --out "$out/cm-4proc-$rate-r$r.json" > "$out/calibrate-4proc-$rate-r$r.txt"
    JCOCCL_COST_MODEL="$out/cm-4proc-$rate-r$r.json" "$py" -m jcoccl.bench collectives \
      --processes 4 --link-rate "$rate" "${collectives[@]}" > "$out/collectives-4proc-$rate-r$r.txt"
  done
done
"$py" benchmarks/train_e2e.py --link-rate none --link-rate 10gbit --link-rate 1gbit \
  --steps 8 --repeats "$repeats" --out "$out/train-e2e"
"$py" benchmarks/train_e2e.py --link-rate none --link-rate 1gbit --batch 16 --seq-len 64 \
  --steps 6 --repeats "$repeats" --out "$out/train-e2e-batch16x64"

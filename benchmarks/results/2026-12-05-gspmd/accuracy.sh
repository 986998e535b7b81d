#!/bin/bash
# 200-step losses: the original program, jcoccl int8 + error feedback (3 seeds), and
# jcoccl compressor "none" (seed 0); one process, 8 CPU devices, mesh data 4 x model 2.
# Usage: bash benchmarks/results/2026-12-05-gspmd/accuracy.sh OUT_DIR
set -euo pipefail
out=${1:?out dir}
mkdir -p "$out"
py=.venv/bin/python
for seed in 0 1 2; do
  $py -m examples.gspmd.train --steps 200 --seed $seed --json "$out/orig-$seed.json"
  $py -m examples.gspmd.train --steps 200 --seed $seed --compressor int8 --ef --json "$out/int8ef-$seed.json"
done
$py -m examples.gspmd.train --steps 200 --seed 0 --compressor none --json "$out/none-0.json"

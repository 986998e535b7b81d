#!/bin/bash
# Step time at a 1 Gbit/s shaped link between 2 processes x 4 CPU devices (mesh data 4 x
# model 2; the data axis crosses the link, 'model' stays inside a process): the original
# program and jcoccl int8 two_shot + error feedback, interleaved, 3 repeats. jcoccl.launch
# --link-rate puts both processes in a fresh network namespace whose loopback is shaped by
# tc (token bucket 1gbit) and deletes it afterwards. A larger model than the accuracy runs
# (d_model 256, 4 layers: 3.3M parameters) so that the gradient sum is visible at all.
# Usage: bash benchmarks/results/2026-12-05-gspmd/timing.sh OUT_DIR
set -euo pipefail
out=${1:?out dir}
mkdir -p "$out"
py=.venv/bin/python
launch="$py -m jcoccl.launch -n 2 --devices-per-process 4 --link-rate 1gbit --"
run="$py -m examples.gspmd.train --steps 25 --d-model 256 --n-layers 4"
for r in 1 2 3; do
  $launch $run --json "$out/orig-$r.json"
  $launch $run --compressor int8 --ef --json "$out/int8ef-$r.json"
done

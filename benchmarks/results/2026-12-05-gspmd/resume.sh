#!/bin/bash
# Resume bit-exactness: 20 steps straight vs 10 steps + orbax checkpoint (params, optimizer,
# error-feedback state) + a resumed run to step 20; then the same example across
# 2 processes x 4 devices under jcoccl.launch (straight, then save at 10 and resume).
# Usage: bash benchmarks/results/2026-12-05-gspmd/resume.sh OUT_DIR
set -euo pipefail
out=${1:?out dir}
mkdir -p "$out"
rm -rf "$out/ckpt1" "$out/ckpt2"
py=.venv/bin/python
run="$py -m examples.gspmd.train --steps 20 --compressor int8 --ef"
$run --json "$out/straight.json"
$run --checkpoint "$out/ckpt1" --save-at 10 --steps 10 --json "$out/first.json"
$run --checkpoint "$out/ckpt1" --resume --json "$out/resumed.json"
launch="$py -m jcoccl.launch -n 2 --devices-per-process 4 --"
$launch $run --json "$out/mp-straight.json"
$launch $run --checkpoint "$out/ckpt2" --save-at 10 --steps 10 --json "$out/mp-first.json"
$launch $run --checkpoint "$out/ckpt2" --resume --json "$out/mp-resumed.json"

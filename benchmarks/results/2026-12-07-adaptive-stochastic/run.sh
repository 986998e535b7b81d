#!/bin/bash
set -u
cd "$(dirname "$0")/../../.."
py=.venv/bin/python
o=${OUT:-/tmp/adsr}
mkdir -p "$o"
$py -m benchmarks.accuracy.run --policies lean --models gpt --seeds 2 --steps 800 --train-arg=--adapt=0.15 --train-arg=--adapt-rounding=stochastic --out $o/g800adaptsr > $o/g800adaptsr.log 2>&1
$py -m benchmarks.accuracy.run --policies lean --models qwen --seeds 2 --steps 800 --train-arg=--adapt=0.15 --train-arg=--adapt-rounding=stochastic --out $o/q800adaptsr > $o/q800adaptsr.log 2>&1
$py -m benchmarks.accuracy.run --policies exact --models gpt --seeds 1 --steps 800 --out $o/g800exact > $o/g800exact.log 2>&1
echo done > $o/DONE

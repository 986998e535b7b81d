#!/bin/bash
# The tuner on Qwen and GPT (seed 1, 200 steps, budget 1%, bytes), then its pick on seeds 0-2.
set -u
cd "$(dirname "$0")/../../.."
py=.venv/bin/python
o=${OUT:-/tmp/tune}
mkdir -p "$o"
for m in qwen gpt; do
  $py -m models.tune --model $m --mesh 2,2,2 --budget 1% --objective bytes --steps 200 \
    --seed 1 --max-runs 5 --out $o/$m-1pct.toml > $o/$m-tune.log 2>&1
  if [ -f $o/$m-1pct.toml ]; then
    $py -m benchmarks.accuracy.run --policies exact,$o/$m-1pct.toml --models $m --seeds 3 \
      --steps 200 --out $o/$m-check > $o/$m-check.log 2>&1
  fi
done
# The same search with stochastic twins of failing points (its own work folders).
for m in qwen gpt; do
  $py -m models.tune --model $m --mesh 2,2,2 --budget 1% --objective bytes --steps 200 \
    --seed 1 --max-runs 8 --roundings nearest,stochastic --out $o/$m-1pct-sr.toml > $o/$m-tune-sr.log 2>&1
done
echo done > $o/DONE

#!/usr/bin/env bash
# Runs the test suite in .venv (create it first with tools/setup.sh; VENV=... picks another,
# as tools/setup.sh does). Extra arguments go to pytest, e.g.
# `bash tools/test.sh tests/test_compressors.py -x`.
# The suite runs on JCOCCL_TEST_WORKERS pytest-xdist workers (default 2, one per core of the
# CI machine; 0 runs it in this process). Work stealing keeps both busy to the end: the
# test files differ in cost by two orders of magnitude.
# Tests compile at XLA's lowest backend level except those marked optimized (tests/conftest.py);
# JCOCCL_TEST_OPTIMIZED=1 compiles them all as users do.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  echo "error: $VENV not found; run 'bash tools/setup.sh' first" >&2
  exit 1
fi
workers=${JCOCCL_TEST_WORKERS:-2}
xdist=()
if [ "$workers" != 0 ]; then
  xdist=(-n "$workers" --dist worksteal)
fi
# One XLA compilation cache per run, shared by the workers and by the processes the tests
# start: a program compiled by several tests (a codec's round trip, a resumed training run's
# step) compiles once. A fresh directory each run, so that a run compiles everything it tests;
# JCOCCL_TEST_JAX_CACHE=DIR keeps one across runs instead.
cache=${JCOCCL_TEST_JAX_CACHE:-}
if [ -z "$cache" ]; then
  cache=$(mktemp -d -t jcoccl-jax-cache.XXXXXX)
  trap 'rm -rf "$cache"' EXIT
fi
export JAX_COMPILATION_CACHE_DIR=$cache
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
start=$(date +%s)
rc=0
# The slowest tests are listed at the end of every run: that is where the suite's time goes.
"$VENV/bin/python" -m pytest -q --durations=30 "${xdist[@]}" "$@" || rc=$?
echo "tools/test.sh: pytest exited $rc after $(( $(date +%s) - start )) s"
exit "$rc"

#!/usr/bin/env bash
# Runs the test suite in .venv (create it first with tools/setup.sh; VENV=... picks another,
# as tools/setup.sh does). Extra arguments go to pytest, e.g.
# `bash tools/test.sh tests/test_compressors.py -x`.
# The suite runs on JCOCCL_TEST_WORKERS pytest-xdist workers (default 2, one per core of the
# CI machine; 0 runs it in this process). Work stealing keeps both busy to the end: the
# test files differ in cost by two orders of magnitude.
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
start=$(date +%s)
rc=0
"$VENV/bin/python" -m pytest -q "${xdist[@]}" "$@" || rc=$?
echo "tools/test.sh: pytest exited $rc after $(( $(date +%s) - start )) s"
exit "$rc"

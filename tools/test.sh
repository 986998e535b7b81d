#!/usr/bin/env bash
# Runs the test suite in .venv (create it first with tools/setup.sh; VENV=... picks another,
# as tools/setup.sh does). Extra arguments go to pytest, e.g.
# `bash tools/test.sh tests/test_compressors.py -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  echo "error: $VENV not found; run 'bash tools/setup.sh' first" >&2
  exit 1
fi
exec "$VENV/bin/python" -m pytest -q "$@"

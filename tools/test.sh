#!/usr/bin/env bash
# Runs the test suite in .venv (create it first with tools/setup.sh). Extra arguments go
# to pytest, e.g. `bash tools/test.sh tests/test_compressors.py -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  echo "error: .venv not found; run 'bash tools/setup.sh' first" >&2
  exit 1
fi
exec .venv/bin/python -m pytest -q "$@"

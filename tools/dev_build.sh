#!/usr/bin/env bash
# Rebuilds the native extensions into the existing .venv after a C++/CUDA change
# (serialised with a lock, so parallel rebuilds do not trample the build directory).
set -euo pipefail
cd "$(dirname "$0")/.."
exec flock /tmp/jcoccl-build.lock .venv/bin/pip install -q --no-build-isolation --no-deps -e . "$@"

#!/usr/bin/env bash
# The code checks CI runs: ruff (lint and format), mypy on jcoccl/, clang-format on cuda/,
# the public plugin header (jcoccl/include/) and the C++/CUDA examples (examples/).
# Tools come from the `lint` extra that tools/setup.sh installs into .venv.
# `bash tools/lint.sh --fix` applies ruff's safe fixes and both formatters instead of checking.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=.venv/bin
if [ ! -x "$bin/ruff" ]; then
  echo "error: $bin/ruff not found; run 'bash tools/setup.sh' first" >&2
  exit 1
fi
mapfile -t cxx < <(git ls-files 'cuda/*.cc' 'cuda/*.h' 'cuda/*.cu' 'cuda/*.inc' \
  'jcoccl/include/*.h' 'examples/*.cc' 'examples/*.h' 'examples/*.cu')
if [ "${1:-}" = "--fix" ]; then
  "$bin/ruff" check --fix .
  "$bin/ruff" format .
  "$bin/clang-format" -i --style=file "${cxx[@]}"
  exit 0
fi
"$bin/ruff" check .
"$bin/ruff" format --check .
"$bin/mypy"
"$bin/clang-format" --dry-run --Werror --style=file "${cxx[@]}"
echo "lint: clean"

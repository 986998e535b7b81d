#!/usr/bin/env python3
"""Build jcoccl with its CUDA extension on an offline GPU machine, whatever it allows.

1. Finds nvcc ($CUDACXX, PATH, /usr/local/cuda*/bin, /usr/local/bin, the nvidia-cuda-nvcc
   wheel) and exports it as CUDACXX (CMake does not look outside PATH on its own).
2. `pip install --no-build-isolation --no-deps -e .` (no network needed).
3. If pip refuses (an externally managed system Python, no pip, ...): a plain CMake build
   into build/gpu, the modules copied into jcoccl/, and PYTHONPATH pointed at the checkout.
4. Writes ENV_FILE (sourced by tools/gpu_check.sh): the CUDACXX/PATH/PYTHONPATH exports the
   later steps need.

  python tools/gpu_build.py --env-file gpu_out/build_env.sh
  python tools/gpu_build.py --dry-run     # print the plan only (what CI runs)
"""

from __future__ import annotations

import argparse
import glob
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def find_nvcc(env: dict[str, str] | None = None) -> str | None:
  """The nvcc to build with, or None.

  Args:
    env: the environment to read CUDACXX and PATH from (default os.environ).
  Returns:
    an existing nvcc path: $CUDACXX, else nvcc on PATH, else the newest
    /usr/local/cuda*/bin/nvcc, /usr/local/bin/nvcc, or the nvidia-cuda-nvcc wheel's.
  """
  env = os.environ if env is None else env
  cands = [env.get("CUDACXX"), shutil.which("nvcc", path=env.get("PATH", ""))]
  cands += [
    "/usr/local/cuda/bin/nvcc",
    *sorted(glob.glob("/usr/local/cuda-*/bin/nvcc"), reverse=True),
    "/usr/local/bin/nvcc",
  ]
  try:
    import nvidia.cuda_nvcc as w  # type: ignore[import-not-found]

    cands.append(os.path.join(list(w.__path__)[0], "bin", "nvcc"))
  except ImportError:
    pass
  for c in cands:
    if c and os.path.isfile(c) and os.access(c, os.X_OK):
      return c
  return None


def pip_cmd(py: str) -> list[str]:
  return [py, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "-e", str(ROOT)]


def cmake_cmds(py: str, nvcc: str | None, build_dir: Path) -> list[list[str]]:
  gen = ["-G", "Ninja"] if shutil.which("ninja") else []
  cfg = [
    "cmake",
    "-S",
    str(ROOT),
    "-B",
    str(build_dir),
    *gen,
    "-DCMAKE_BUILD_TYPE=Release",
    f"-DPython_EXECUTABLE={py}",
    f"-DJCOCCL_CUDA={'ON' if nvcc else 'OFF'}",
  ]
  if nvcc:
    cfg.append(f"-DCMAKE_CUDA_COMPILER={nvcc}")
  return [cfg, ["cmake", "--build", str(build_dir), "-j", str(os.cpu_count() or 4)]]


def _run(cmd: list[str], env: dict[str, str]) -> int:
  print("+", shlex.join(cmd), flush=True)
  return subprocess.run(cmd, env=env).returncode


def _copy_modules(build_dir: Path) -> list[str]:
  """Puts the built _cpu/_cuda modules into jcoccl/ (for a PYTHONPATH import)."""
  got = []
  for name in ("_cpu", "_cuda"):
    for so in build_dir.glob(f"{name}*.so"):
      shutil.copy2(so, ROOT / "jcoccl" / so.name)
      got.append(so.name)
  return got


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--python", default=sys.executable, help="interpreter to build for")
  p.add_argument("--env-file", default=None, help="write the exports later steps need here")
  p.add_argument("--build-dir", default=str(ROOT / "build" / "gpu"))
  p.add_argument("--dry-run", action="store_true", help="print the plan; build nothing")
  args = p.parse_args()
  env = dict(os.environ)
  nvcc = find_nvcc(env)
  exports = {}
  if nvcc:
    exports["CUDACXX"] = nvcc
    exports["PATH"] = os.path.dirname(nvcc) + os.pathsep + env.get("PATH", "")
  env.update(exports, JCOCCL_CUDA="ON" if nvcc else "AUTO")
  print(f"nvcc: {nvcc or 'NOT FOUND (building without the CUDA extension)'}", flush=True)
  build_dir = Path(args.build_dir)
  plan = [pip_cmd(args.python), *cmake_cmds(args.python, nvcc, build_dir)]
  if args.dry_run:
    print("plan: pip, else cmake:")
    for c in plan:
      print("  " + shlex.join(c))
    print("VERDICT build: DRY RUN")
    return 0
  how = "pip"
  if _run(plan[0], env) != 0:
    print("pip install failed (externally managed Python?): plain CMake build", flush=True)
    how = "cmake"
    for c in plan[1:]:
      if _run(c, env) != 0:
        print("VERDICT build: FAIL (cmake)")
        return 1
    print("copied into jcoccl/:", _copy_modules(build_dir), flush=True)
    exports["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
  if args.env_file:
    with open(args.env_file, "w") as f:
      for k, v in exports.items():
        f.write(f"export {k}={shlex.quote(v)}\n")
  print(f"VERDICT build: PASS ({how}{', CUDA' if nvcc else ', no nvcc'})")
  return 0


if __name__ == "__main__":
  sys.exit(main())

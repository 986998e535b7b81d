#!/usr/bin/env python3
"""Compile the CUDA sources with the project's flags and check the machine code's arithmetic.

The codecs must give the jnp specification's bits, so the device code may contain no fused
multiply-add (`fma.*`, float `mad.*`), no approximate or non-IEEE division or other
`.approx` instruction (`div.full`, `div.approx`, `rcp.approx`, ...), no flush-to-zero
(`.ftz`), and no register spills (`-Xptxas -v`). The flags are read from CMakeLists.txt (the
CUDA compile options and JCOCCL_CUDA_ARCHITECTURES), so a build change is checked too.

  python tools/gpu_ptx.py            # exits 1 and lists the violations, 0 when clean

tools/gpu_sass.py reads the same compile's cubin for its per-kernel SASS report.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("cuda/gpu/codecs.cu", "cuda/gpu/fused.cu")
FORBIDDEN = {
  "fused multiply-add": re.compile(r"^\s*(@!?%\w+\s+)?(fma\.\S+|mad(\.\w+)*\.f(16|32|64)\b)", re.M),
  "non-IEEE division or approximation": re.compile(r"\b(div\.full|div\.approx|\w+\.approx)\S*"),
  "flush to zero": re.compile(r"^\s*(@!?%\w+\s+)?\w+(\.\w+)*\.ftz\b\S*", re.M),
}


def nvcc() -> str | None:
  """nvcc from $CUDACXX, PATH, /usr/local/cuda/bin or /usr/local/bin."""
  for c in (
    os.environ.get("CUDACXX"),
    shutil.which("nvcc"),
    "/usr/local/cuda/bin/nvcc",
    "/usr/local/bin/nvcc",
  ):
    if c and os.path.exists(c):
      return c
  return None


def project_flags(cmake: str) -> tuple[list[str], str]:
  """(CUDA compile options, architecture) as CMakeLists.txt gives them to nvcc."""
  m = re.search(r"\$<\$<COMPILE_LANGUAGE:CUDA>:([^>]*)>", cmake)
  if m is None:
    raise RuntimeError("CMakeLists.txt: no $<$<COMPILE_LANGUAGE:CUDA>:...> compile options")
  arch = re.search(r'set\(JCOCCL_CUDA_ARCHITECTURES\s+"(\d+)"', cmake)
  if arch is None:
    raise RuntimeError("CMakeLists.txt: no JCOCCL_CUDA_ARCHITECTURES default")
  return [f for f in m.group(1).split(";") if f], arch.group(1)


def _include_dirs() -> list[str]:
  dirs = [str(ROOT / "cuda"), str(ROOT / "jcoccl" / "include")]
  for mod, sub in (("jaxlib", "include"), ("nvidia.nccl", "include")):
    try:
      spec = importlib.util.find_spec(mod)
    except ModuleNotFoundError:
      spec = None
    if spec is not None and spec.submodule_search_locations:
      dirs.append(os.path.join(list(spec.submodule_search_locations)[0], sub))
  return dirs


@dataclasses.dataclass
class Compiled:
  """One source compiled with the project's flags: its PTX, ptxas report and cubin."""

  src: Path
  ptx: str
  ptxas: str
  cubin: Path


def compile_source(src: Path, flags: list[str], arch: str, work: Path) -> Compiled:
  """Compiles one source to a cubin under `work`, keeping the PTX and the ptxas report."""
  exe = nvcc()
  if exe is None:
    raise RuntimeError("nvcc not found (set CUDACXX or PATH)")
  keep = work / src.stem
  keep.mkdir(parents=True, exist_ok=True)
  cubin = keep / f"{src.stem}.cubin"
  cmd = [
    exe,
    "-std=c++17",
    *flags,
    f"-arch=sm_{arch}",
    "-Xptxas",
    "-v",
    "-cubin",
    "--keep",
    "--keep-dir",
    str(keep),
    *[f"-I{d}" for d in _include_dirs()],
    str(src),
    "-o",
    str(cubin),
  ]
  r = subprocess.run(cmd, capture_output=True, text=True)
  if r.returncode != 0:
    raise RuntimeError(f"nvcc failed: {' '.join(cmd)}\n{r.stderr[-4000:]}")
  ptx = "\n".join(p.read_text() for p in keep.glob("*.ptx"))
  return Compiled(src, ptx, r.stdout + r.stderr, cubin)


def compile_all(
  sources: tuple[str, ...] = SOURCES, flags: list[str] | None = None, *, work: Path
) -> list[Compiled]:
  """Compiles each source with the project's flags (or `flags`) into `work`.

  The PTX check and the SASS report (tools/gpu_sass.py) both read this one compile.
  """
  cmake_flags, arch = project_flags((ROOT / "CMakeLists.txt").read_text())
  flags = cmake_flags if flags is None else flags
  out = []
  for s in sources:
    src = Path(s) if Path(s).is_absolute() else ROOT / s
    out.append(compile_source(src, flags, arch, work))
  return out


def violations(ptx: str, ptxas: str) -> list[str]:
  """Every forbidden instruction in ptx and every spill in the ptxas report."""
  bad = []
  for what, rx in FORBIDDEN.items():
    for m in rx.finditer(ptx):
      bad.append(f"{what}: {m.group(0).strip()}")
  for m in re.finditer(r"(\d+) bytes spill stores, (\d+) bytes spill loads", ptxas):
    if int(m.group(1)) or int(m.group(2)):
      bad.append(f"register spill: {m.group(0)}")
  return bad


def compiled_violations(compiled: list[Compiled]) -> list[str]:
  """The violations of sources compiled by compile_all, each prefixed by its file name."""
  return [f"{c.src.name}: {v}" for c in compiled for v in violations(c.ptx, c.ptxas)]


def check(sources: tuple[str, ...] = SOURCES, flags: list[str] | None = None) -> list[str]:
  """Compiles each source with the project's flags (or `flags`); returns the violations."""
  with tempfile.TemporaryDirectory() as d:
    return compiled_violations(compile_all(sources, flags, work=Path(d)))


def main() -> int:
  argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
  if nvcc() is None:
    print("nvcc not found: nothing checked")
    return 2
  bad = check()
  for v in bad:
    print("VIOLATION", v)
  print(f"PTX check of {', '.join(SOURCES)}: {len(bad)} violations")
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())

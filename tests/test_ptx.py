"""PTX check: the CUDA sources compiled with the project's flags contain no FMA, no
non-IEEE division or approximation, no flush-to-zero and no register spills
(tools/gpu_ptx.py). Needs nvcc only (no GPU); skipped with the reason where it is absent."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import gpu_ptx  # noqa: E402

needs_nvcc = pytest.mark.skipif(gpu_ptx.nvcc() is None, reason="nvcc not found (CUDACXX, PATH)")


def test_project_flags_come_from_cmake():
  flags, arch = gpu_ptx.project_flags((gpu_ptx.ROOT / "CMakeLists.txt").read_text())
  assert "--fmad=false" in flags and arch == "90"


@needs_nvcc
def test_cuda_sources_have_ieee_arithmetic_and_no_spills():
  assert gpu_ptx.check() == []


@needs_nvcc
def test_check_reports_fma_ftz_and_fast_division(tmp_path):
  # The same expressions compiled without --fmad=false, and with fast math: each kind of
  # violation must be reported, so a clean result above means something.
  src = tmp_path / "k.cu"
  src.write_text("__global__ void k(float* p, float a, float b) {\n"
                 "  p[threadIdx.x] = p[threadIdx.x] * a + b;\n"
                 "  p[threadIdx.x + 64] = p[threadIdx.x + 32] / a;\n}\n")
  assert any("fused multiply-add" in v for v in gpu_ptx.check((str(src),), flags=[]))
  fast = gpu_ptx.check((str(src),), flags=["--use_fast_math"])
  assert any("flush to zero" in v for v in fast)
  assert any("non-IEEE division" in v for v in fast)


def test_violations_parses_spills():
  report = "ptxas info : 0 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads"
  assert gpu_ptx.violations("", report) == [
      "register spill: 8 bytes spill stores, 8 bytes spill loads"]

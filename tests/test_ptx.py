"""PTX check: the CUDA sources compiled with the project's flags contain no FMA, no
non-IEEE division or approximation, no flush-to-zero and no register spills
(tools/gpu_ptx.py). Needs nvcc only (no GPU); skipped with the reason where it is absent."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import gpu_ptx

needs_nvcc = pytest.mark.skipif(gpu_ptx.nvcc() is None, reason="nvcc not found (CUDACXX, PATH)")


def test_project_flags_come_from_cmake():
  flags, arch = gpu_ptx.project_flags((gpu_ptx.ROOT / "CMakeLists.txt").read_text())
  assert "--fmad=false" in flags and arch == "90"


@pytest.mark.slow  # nvcc, two sources: 15-30 s
@needs_nvcc
def test_cuda_sources_have_ieee_arithmetic_and_no_spills():
  assert gpu_ptx.check() == []


@needs_nvcc
def test_check_reports_fma_ftz_and_fast_division(tmp_path):
  # The same expressions compiled without --fmad=false, and with fast math: each kind of
  # violation must be reported, so a clean result above means something.
  src = tmp_path / "k.cu"
  src.write_text(
    "__global__ void k(float* p, float a, float b) {\n"
    "  p[threadIdx.x] = p[threadIdx.x] * a + b;\n"
    "  p[threadIdx.x + 64] = p[threadIdx.x + 32] / a;\n}\n"
  )
  assert any("fused multiply-add" in v for v in gpu_ptx.check((str(src),), flags=[]))
  fast = gpu_ptx.check((str(src),), flags=["--use_fast_math"])
  assert any("flush to zero" in v for v in fast)
  assert any("non-IEEE division" in v for v in fast)


def test_violations_parses_spills():
  report = "ptxas info : 0 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads"
  assert gpu_ptx.violations("", report) == [
    "register spill: 8 bytes spill stores, 8 bytes spill loads"
  ]


def _function_body(src: str, signature: str) -> str:
  start = src.index(signature)
  depth, i = 0, src.index("{", start)
  for j in range(i, len(src)):
    depth += {"{": 1, "}": -1}.get(src[j], 0)
    if depth == 0:
      return src[i : j + 1]
  raise AssertionError(f"unbalanced braces after {signature}")


def test_fused_engine_reuses_its_events_and_always_joins_its_lanes():
  # Source guards for what only a GPU run can observe: events are created once per device
  # (with its lanes), never per hand-off or per call, and a failing Run still joins the
  # lanes back into XLA's stream before returning.
  src = (gpu_ptx.ROOT / "cuda" / "gpu" / "fused.cu").read_text()
  setup = _function_body(src, "Status StreamsFor(")
  assert src.count("cudaEventCreate") == setup.count("cudaEventCreate") > 0
  assert "cudaEventDestroy" not in src
  run = _function_body(src, "Status RunGpu(")
  assert "RETURN_IF_ERROR(Run(" not in run.replace(" ", "").replace("\n", "")
  assert run.index("Run(c, &lanes") < run.index("StreamWait(ds, l, ds->s[l], xla)")

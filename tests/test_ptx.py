"""PTX check and SASS report: the CUDA sources compiled with the project's flags contain no
FMA, no non-IEEE division or approximation, no flush-to-zero and no register spills
(tools/gpu_ptx.py), and each kernel's machine code stays within tools/sass_thresholds.json
(tools/gpu_sass.py: registers, spills, 128-bit and byte-wide global accesses, divisions in
loops). Needs nvcc (and nvdisasm for the SASS report), no GPU; skipped with the reason where
they are absent."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import gpu_ptx
import gpu_sass

needs_nvcc = pytest.mark.skipif(gpu_ptx.nvcc() is None, reason="nvcc not found (CUDACXX, PATH)")
needs_nvdisasm = pytest.mark.skipif(
  gpu_sass.nvdisasm() is None,
  reason="nvdisasm not found (NVDISASM, PATH, next to nvcc, or pip install nvidia-cuda-nvdisasm)",
)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
  # One compile of the sources serves both the PTX check and the SASS report.
  return gpu_ptx.compile_all(work=tmp_path_factory.mktemp("cuda"))


def test_project_flags_come_from_cmake():
  flags, arch = gpu_ptx.project_flags((gpu_ptx.ROOT / "CMakeLists.txt").read_text())
  assert "--fmad=false" in flags and arch == "90"


@pytest.mark.slow  # nvcc, two sources: 15-30 s, shared with the SASS report below
@needs_nvcc
def test_cuda_sources_have_ieee_arithmetic_and_no_spills(compiled):
  assert gpu_ptx.compiled_violations(compiled) == []


@pytest.mark.slow  # the compile above, then nvdisasm: 1-4 s
@needs_nvcc
@needs_nvdisasm
def test_sass_report_passes_its_thresholds(compiled):
  kernels = gpu_sass.report(compiled)
  thresholds = gpu_sass.load_thresholds()
  bad = gpu_sass.compare(kernels, thresholds)
  assert bad == [], "\n".join([gpu_sass.table(kernels, thresholds), *bad])
  # Every codec kernel was found and measured (a parse that saw no loops would pass vacuously).
  assert {k.name for k in kernels} == set(thresholds["kernels"])
  assert all(k.loops > 0 and k.registers > 0 for k in kernels)


# A kernel as nvdisasm prints it: a 128-bit load before its loop, and inside the loop a byte
# load, a 64-bit division and an IEEE division (calls to nvcc's subroutines, which follow the
# kernel in its section), then the branch back. ptxas reports 40 registers and a spill.
SEEDED_SASS = """
//--------------------- .text.k --------------------------
\t.section\t.text.k,"ax",@progbits
k:
        /*0000*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
.L_x_0:
        /*0010*/                   LDG.E.U8 R6, desc[UR4][R2.64] ;
        /*0020*/                   CALL.REL.NOINC `($__internal_0_$__cuda_sm20_div_s64) ;
        /*0030*/                   CALL.REL.NOINC `($__internal_1_$__cuda_sm3x_div_rn_noftz_f32_slowpath) ;
        /*0040*/               @P0 BRA `(.L_x_0) ;
        /*0050*/                   EXIT ;
$__internal_0_$__cuda_sm20_div_s64:
        /*0060*/                   RET.REL.NODEC R20 `(k) ;
.L_x_1:
        /*0070*/                   BRA `(.L_x_1);
"""
SEEDED_PTXAS = """ptxas info    : Function properties for k
    0 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads
ptxas info    : Used 40 registers, used 0 barriers
"""


def test_sass_report_catches_seeded_regressions():
  (k,) = gpu_sass.analyze(SEEDED_SASS, SEEDED_PTXAS)
  assert (k.name, k.registers, k.spill_bytes, k.loops, k.ld128, k.ld128_in_loops) == (
    "k",
    40,
    16,
    1,
    1,
    0,
  )
  limits = {
    "max_registers": 32,
    "max_spill_bytes": 0,
    "min_ld128_in_loops": 1,
    "max_byte_loads_in_loops": 0,
    "max_div64_in_loops": 0,
    "max_fdiv_in_loops": 0,
  }
  bad = gpu_sass.compare([k], {"kernels": {"k": limits, "gone": {}}})
  assert bad == [
    "k: registers = 40, above its maximum max_registers = 32",
    "k: spill_bytes = 16, above its maximum max_spill_bytes = 0",
    "k: ld128_in_loops = 0, below its minimum min_ld128_in_loops = 1",
    "k: byte_loads_in_loops = 1, above its maximum max_byte_loads_in_loops = 0",
    "k: div64_in_loops = 1, above its maximum max_div64_in_loops = 0",
    "k: fdiv_in_loops = 1, above its maximum max_fdiv_in_loops = 0",
    "gone: in sass_thresholds.json but not in the compiled code (remove the entry)",
  ]
  assert gpu_sass.compare([k], {"kernels": {"k": {**limits, "max_registers": 40}}})[0].startswith(
    "k: spill_bytes"
  )
  (missing,) = gpu_sass.compare([k], {"kernels": {}})
  assert missing.startswith("k: no entry in sass_thresholds.json")


def test_sass_loops_follow_the_control_flow_graph():
  # An indirect branch into an outer loop and past it, an inner loop, code after both, and
  # the unreachable self-branch that ends every kernel: depths 0 1 2 2 1 0 0 0.
  sass = """
\t.section\t.text.f,"ax",@progbits
f:
        /*0000*/                   BRX R4 -0x10 (*"BRANCH_TARGETS .L_x_0,.L_x_3"*);
.L_x_0:
        /*0010*/                   NOP ;
.L_x_1:
        /*0020*/                   LDG.E.U8 R6, desc[UR4][R2.64] ;
        /*0030*/               @P0 BRA `(.L_x_1) ;
        /*0040*/               @P1 BRA `(.L_x_0) ;
.L_x_3:
        /*0050*/                   LDG.E.U8 R6, desc[UR4][R2.64] ;
        /*0060*/                   EXIT ;
.L_x_2:
        /*0070*/                   BRA `(.L_x_2);
"""
  instrs, labels = gpu_sass.split_functions(sass)["f"]
  assert instrs[0].targets == [".L_x_0", ".L_x_3"]
  assert gpu_sass.loop_depths(instrs, labels) == ([0, 1, 2, 2, 1, 0, 0, 0], 2)
  (f,) = gpu_sass.analyze(sass)
  assert (f.byte_loads, f.byte_loads_in_loops, f.max_loop_depth) == (2, 1, 2)


def test_sass_kernel_names_are_short_and_name_the_kind():
  kinds = gpu_sass.kind_names()
  assert kinds["2"] == "kInt"
  demangled = (
    "void jcoccl::codecs::(anonymous namespace)::EncodeBlocksKernel<(jcoccl::codecs::Kind)2, "
    "true>(jcoccl::codecs::CodecSpec, jcoccl::codecs::DType, void const*, long)"
  )
  assert gpu_sass.short_name(demangled, kinds) == "EncodeBlocksKernel<kInt, true>"
  assert gpu_sass.short_name("ns::(anonymous namespace)::K(int)", kinds) == "K"


@needs_nvcc
@needs_nvdisasm
def test_sass_measures_what_nvcc_emits(tmp_path):
  # What the report counts, checked against nvcc's own output with the project's flags:
  # `a / b` on floats and 1.0f / x are IEEE (a call to the slow path), __fdividef is not; a
  # 64-bit division calls __cuda_sm20_div_s64; a division before the loop is not in a loop.
  src = tmp_path / "k.cu"
  src.write_text(
    "__global__ void ieee(float* p, float a, int n) {\n"
    "  for (int i = threadIdx.x; i < n; i += 32) p[i] = p[i] / a + 1.0f / p[i + n]; }\n"
    "__global__ void fast(float* p, float a, int n) {\n"
    "  for (int i = threadIdx.x; i < n; i += 32) p[i] = __fdividef(p[i], a); }\n"
    "__global__ void d64(long long* p, long long a, long long n) {\n"
    "  const long long q = n / a;\n"
    "  for (long long i = threadIdx.x; i < n; i += 32) p[i] = p[i] / a + q; }\n"
    "__global__ void bytes(const unsigned char* q, const float4* v, float4* p, int n) {\n"
    "  for (int i = threadIdx.x; i < n; i += 32) { p[i] = v[i]; p[i].x += q[i]; } }\n"
  )
  (c,) = gpu_ptx.compile_all((str(src),), work=tmp_path)
  k = {r.name: r for r in gpu_sass.report([c])}
  assert k["ieee"].fdiv_in_loops >= 2 and k["fast"].fdiv == 0
  assert k["d64"].div64 > k["d64"].div64_in_loops >= 1 and k["d64"].fdiv == 0
  assert k["bytes"].byte_loads_in_loops >= 1
  assert k["bytes"].ld128_in_loops >= 1 and k["bytes"].st128_in_loops >= 1
  assert all(r.div64 == 0 for r in k.values() if r.name != "d64")


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

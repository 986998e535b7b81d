"""The CUDA codec kernels (cuda/gpu/codecs.cu, unmodified) run on the CPU through the host
shim (cuda/hostshim/) and are compared bit for bit with the CPU codecs (tools/gpu_shim.py):
every codec family x dtype x block size (spike reserving included), NaN/Inf/subnormal data,
partial CUDA blocks, the grid-stride paths; and deliberately broken copies must be caught."""

import ctypes
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import gpu_shim  # noqa: E402

pytestmark = pytest.mark.skipif(gpu_shim.compiler() is None, reason="no C++ compiler")


def _compare(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, "tools/gpu_shim.py", "compare", *args],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=900,
  )


@pytest.fixture(scope="module")
def mutant_libs() -> tuple[gpu_shim.CodecLib, gpu_shim.CodecLib]:
  """The mutant shim library (every seeded defect behind jc_set_mutation) and its reference,
  loaded as `gpu_shim.py compare --mutate` loads them."""
  return gpu_shim.load(ROOT / "build" / "gpu_shim", mutants=True)


@pytest.mark.slow
def test_cuda_kernels_match_cpu_codecs_for_every_family_dtype_and_block():
  r = _compare()
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  assert "384 cases" in r.stdout and " 0 mismatches" in r.stdout, r.stdout[-500:]


def test_grid_stride_paths_match():
  # Every grid capped at 2 blocks: each thread/warp/block walks several grid strides,
  # including the elementwise kernel's incremental (row, offset) stepping.
  r = _compare(
    "--max-grid",
    "2",
    "--only",
    r"^(none|cast_bf16|int8_B32|int4_asym_B64|"
    r"fp8_e5m2_B32|int8_asym_B1024|eb_1e-2_B32|had256_int4_B128|had64_fp8_e4m3_B128|had64_cast_f16|"
    r"spike3_int3_asym_B64|spike1_int4_B32|spike2_fp8_e4m3_B64)$",
  )
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


@pytest.mark.parametrize(
  "mutation, cases",
  [
    # The warp-per-block encode: the inner codecs of the block-wide Hadamard and spike
    # kernels, int2 with 32-element blocks.
    ("fp8_byte_order", r"^spike16_fp8_e5m2_B512$"),
    ("int_code_order", r"^(int2_B32|spike4_int8_B4096)$"),
    ("odd_width_code_order", r"^(int3_B32|int7_asym_B256)$"),
    ("round_half_away", r"^(int2_B64|eb_0.25_B32)$"),
    ("eb_last_word", r"^eb_1e-2_B32$"),
    ("hadamard_stage", r"^had128_int3_B128$"),  # the block-wide transform (odd-width inner)
    ("sum_order", r"^cast_bf16$"),
    ("spike_fill", r"^spike3_int3_asym_B64$"),  # the block-wide spike kernel (odd width)
    ("spike_unused_slot", r"^spike3_int3_asym_B64$"),
    # The chunk kernels (int 2/4/8 bits, fp8; error_bounded decode): packing, unpacking, the
    # sum's row order, and the statistics of a block spread over lanes and over warps.
    ("chunk_code_order", r"^(int4_B64|fp8_e4m3_B32)$"),
    ("chunk_decode_order", r"^int8_B32$"),
    ("chunk_sum_order", r"^int8_B32$"),
    ("chunk_eb_width", r"^eb_1e-2_B32$"),
    ("group_stats_lanes", r"^int8_B256$"),
    ("group_stats_warps", r"^int8_B1024$"),
    # The register (warp) Hadamard transform: butterflies across and within lanes, the inner
    # codes it packs and unpacks.
    ("warp_hadamard_lanes", r"^had256_int4_B128$"),
    ("warp_hadamard_in_lane", r"^had16_int8_asym_B256$"),
    ("warp_hadamard_codes", r"^had256_fp8_e5m2_B64$"),
    ("warp_hadamard_decode", r"^had32_int2_asym_B256$"),
    # Spike reserving in a warp: the fill, the unused slots, the restore on decode.
    ("warp_spike_fill", r"^spike1_int4_B32$"),
    ("warp_spike_unused_slot", r"^spike31_int4_asym_B32$"),
    ("warp_spike_restore", r"^(spike2_fp8_e4m3_B64|spike4_int2_B256)$"),
  ],
)
def test_broken_packing_or_rounding_is_caught(mutant_libs, mutation, cases):
  # In this process, as `gpu_shim.py compare --mutate` runs it (one library load serves
  # every seeded defect; test_mutate_flag_runs_a_broken_copy runs the command itself).
  shim, ref = mutant_libs
  shim.lib.jc_set_mutation(gpu_shim.MUTATION_IDS[mutation])
  try:
    bad = [m for case in gpu_shim.run_all(shim, ref, cases) for m in case]
  finally:
    shim.lib.jc_set_mutation(0)
  assert bad, f"{mutation} not caught by {cases}"


def test_mutate_flag_runs_a_broken_copy():
  r = _compare("--mutate", "sum_order", "--only", r"^cast_bf16$")
  assert r.returncode == 1 and "MISMATCH" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


def test_reference_library_is_jcoccl_cpu_codec():
  # The reference library run as XLA:CPU runs (DAZ/FTZ) gives the bytes of jcoccl's own CPU
  # handlers, so "shim == reference" means "CUDA kernels == jcoccl._cpu" (with IEEE
  # subnormals, as on the GPU).
  import jax.numpy as jnp

  from jcoccl import compressors as jc

  _, ref_path = gpu_shim.build(ROOT / "build" / "gpu_shim")
  ref = gpu_shim.CodecLib(ref_path, 0)
  ref.lib.jc_set_daz(1)
  S, g = gpu_shim.Spec, gpu_shim.gc
  cases = [
    (S("int8", g.INT, bits=8, block=256), jc.int8(block_size=256)),
    (S("fp8", g.FP8, block=128, fp8=1), jc.fp8("e5m2", block_size=128)),
    (S("eb", g.ERROR_BOUNDED, block=64, abs_error=1e-2), jc.error_bounded(1e-2, block_size=64)),
    (
      S("had", g.INT, bits=4, block=128, hadamard=256),
      jc.hadamard(jc.int4(block_size=128), size=256),
    ),
  ]
  for spec, comp in cases:
    x = gpu_shim.data(4, 1024, g.F32, seed=7)
    want = np.asarray(comp.encode_rows(jnp.asarray(x), impl="native"))
    assert not gpu_shim.gc.payload_mismatch(
      spec.layout(g.F32, 1024), ref.encode(spec, g.F32, x), want
    ).any(), spec.name


_SYNC_KERNELS = r"""
#include "cuda_runtime.h"
#define JC extern "C" __attribute__((visibility("default")))
__global__ void WarpSum(const float* x, float* out) {
  float v = x[blockIdx.x * blockDim.x + threadIdx.x];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if ((threadIdx.x & 31) == 0) out[(blockIdx.x * blockDim.x + threadIdx.x) >> 5] = v;
}
__global__ void BlockReverse(const float* x, float* out) {
  extern __shared__ float t[];
  const int i = threadIdx.x;
  t[i] = x[blockIdx.x * blockDim.x + i];
  __syncthreads();
  out[blockIdx.x * blockDim.x + i] = t[blockDim.x - 1 - i];
}
__global__ void Divergent(float* out) {
  float v = 1.0f;
  if (threadIdx.x < 16) v = __shfl_xor_sync(0xffffffffu, v, 1);
  out[threadIdx.x] = v;
}
__global__ void BarrierInBranch(float* out) {
  if (threadIdx.x < 64) __syncthreads();
  out[threadIdx.x] = 1.0f;
}
JC int warp_sum(const float* x, float* out, int blocks) {
  WarpSum<<<blocks, 128>>>(x, out); return cudaGetLastError(); }
JC int block_reverse(const float* x, float* out, int blocks) {
  BlockReverse<<<blocks, 256, 256 * sizeof(float)>>>(x, out); return cudaGetLastError(); }
JC int divergent(float* out) { Divergent<<<1, 32>>>(out); return cudaGetLastError(); }
JC int barrier_in_branch(float* out) { BarrierInBranch<<<1, 128>>>(out); return cudaGetLastError(); }
JC int too_many_threads(float* out) { Divergent<<<1, 2048>>>(out); return cudaGetLastError(); }
JC const char* message() { return jcoccl_shim::g_last_message.c_str(); }
"""


@pytest.mark.parametrize("switch", ["asm", "ucontext"])
def test_shim_synchronises_warps_and_blocks_and_reports_misuse(tmp_path, switch):
  # The shim's own semantics: shuffles see every lane's value, __syncthreads orders shared
  # memory across warps, and divergent collectives or bad launches are errors, not hangs.
  src = tmp_path / "k.cc"
  src.write_text(gpu_shim.translate(_SYNC_KERNELS))
  lib_path = tmp_path / "k.so"
  gpu_shim._compile(
    gpu_shim.compiler(),
    [str(src)],
    [str(gpu_shim.SHIM_DIR)],
    lib_path,
    ["JCOCCL_SHIM_UCONTEXT"] if switch == "ucontext" else [],
  )
  lib = ctypes.CDLL(str(lib_path))
  lib.message.restype = ctypes.c_char_p
  vp = ctypes.c_void_p
  for fn, args in (
    ("warp_sum", [vp, vp, ctypes.c_int]),
    ("block_reverse", [vp, vp, ctypes.c_int]),
    ("divergent", [vp]),
    ("barrier_in_branch", [vp]),
    ("too_many_threads", [vp]),
  ):
    getattr(lib, fn).argtypes = args
  x = np.arange(3 * 256, dtype=np.float32)
  out = np.zeros(3 * 256 // 32, np.float32)
  assert lib.warp_sum(x.ctypes.data, out.ctypes.data, 6) == 0
  np.testing.assert_array_equal(out, x.reshape(-1, 32).sum(axis=1))
  rev = np.zeros_like(x)
  assert lib.block_reverse(x.ctypes.data, rev.ctypes.data, 3) == 0
  np.testing.assert_array_equal(rev, x.reshape(3, 256)[:, ::-1].reshape(-1))
  buf = np.zeros(2048, np.float32)
  assert lib.divergent(buf.ctypes.data) != 0 and b"warp divergence" in lib.message()
  assert lib.barrier_in_branch(buf.ctypes.data) != 0 and b"__syncthreads" in lib.message()
  assert lib.too_many_threads(buf.ctypes.data) != 0 and b"invalid launch" in lib.message()

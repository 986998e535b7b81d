"""Codec plugins (jcoccl/include/jcoccl/codec_plugin.h, jcoccl.compressors.load_plugin): the
example scaled-sign plugin (examples/custom_codecs/sign) built as a user builds it (cmake and
the installed CMake package), bit-identical to its jnp specification in every row operation
and in every collective on both backends; clear errors for broken libraries; its CUDA
kernels run through the host shim against its CPU kernels; its decoder on random bytes."""

from __future__ import annotations

import ctypes
import fcntl
import functools
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jcoccl
from jcoccl import compressors as jc
from jcoccl._src import _ffi, fused_comms
from jcoccl._src.compressors import plugins

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "custom_codecs" / "sign"
BUILD = ROOT / "build" / "plugin_test"
sys.path.insert(0, str(EXAMPLE))
sys.path.insert(0, str(ROOT / "tools"))
import gpu_shim  # noqa: E402
import sign_codec  # noqa: E402

CXX = gpu_shim.compiler()
pytestmark = [
  pytest.mark.skipif(_ffi.native_module("cpu") is None, reason="jcoccl._cpu is not built"),
  pytest.mark.skipif(CXX is None or shutil.which("cmake") is None, reason="no C++ compiler/cmake"),
]
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _cmake_build(build: Path, *options: str) -> Path:
  """Configures and builds the example plugin as its README says (cached in ``build``; one
  test worker at a time); returns the library's path."""
  build.mkdir(parents=True, exist_ok=True)
  with open(build.parent / f"{build.name}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    for cmd in (
      ["cmake", "-S", str(EXAMPLE), "-B", str(build), f"-Djcoccl_DIR={jcoccl.get_cmake_dir()}",
       "-DCMAKE_BUILD_TYPE=Release", *options],
      ["cmake", "--build", str(build)],
    ):  # fmt: skip
      r = subprocess.run(cmd, capture_output=True, text=True)
      assert r.returncode == 0, " ".join(cmd) + "\n" + r.stdout[-3000:] + r.stderr[-3000:]
  return build / "libjcoccl_sign.so"


@functools.cache
def _sign_library() -> str:
  return str(_cmake_build(BUILD / "sign_cpu", "-DSIGN_CUDA=OFF"))


@pytest.fixture(scope="module")
def sign_plugin() -> plugins.Plugin:
  return jc.load_plugin(_sign_library(), spec=sign_codec.SignCompressor)


@jc.register("sign1_spec")
class SignSpec(sign_codec.SignCompressor):
  """The same codec without a native hook: always its jnp code (the reference)."""


def _data(rows: int, n: int, seed: int = 0) -> np.ndarray:
  """Gaussian rows with NaN, +-Inf, zero blocks, signed zeros, spikes and tiny values."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((rows, n)).astype(np.float32)
  x[rng.random(x.shape) < 0.01] *= 3000.0
  x[0, 3] = np.nan
  x[min(1, rows - 1), 70] = np.inf
  x[rows - 1, -1] = -np.inf
  x[min(2, rows - 1), 128:192] = 0.0
  x[0, 200:210] = -0.0
  x[0, 300:310] = 1e-3
  return x


def _bits(a) -> np.ndarray:
  return np.asarray(a).view(np.uint8)


# ---- installation: header, CMake package --------------------------------------------------


def test_plugin_header_and_cmake_package_ship_with_the_package():
  header = Path(jcoccl.get_include()) / "jcoccl" / "codec_plugin.h"
  assert header.is_file()
  assert (Path(jcoccl.get_cmake_dir()) / "jcocclConfig.cmake").is_file()
  text = header.read_text()
  assert f'#define JCOCCL_VERSION_STRING "{jcoccl.__version__}"' in text
  assert f"#define JCOCCL_PLUGIN_ABI_VERSION {plugins.ABI_VERSION}" in text


def test_plugin_header_is_plain_c():
  cc = shutil.which("gcc") or shutil.which("cc")
  if cc is None:
    pytest.skip("no C compiler")
  src = "#include <jcoccl/codec_plugin.h>\nint main(void) { return (int)sizeof(jcoccl_codec_plugin) == 0; }\n"
  r = subprocess.run(
    [cc, "-std=c99", "-Wall", "-Werror", "-pedantic", f"-I{jcoccl.get_include()}", "-x", "c",
     "-fsyntax-only", "-"],
    input=src, capture_output=True, text=True,
  )  # fmt: skip
  assert r.returncode == 0, r.stderr


# ---- row operations: native == jnp, bit for bit ----------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [32, 256])
def test_plugin_row_ops_match_jnp_bitwise(sign_plugin, dtype, block):
  c = sign_codec.SignCompressor(block=block)
  x = jnp.asarray(_data(3, 1024, seed=block), dtype)
  n = x.shape[1]
  for op in ("encode", "decode", "decode_sum", "decode_sum_encode"):
    assert jc.Compressor._impl(c, "auto", op, jnp.dtype(dtype)) == "native"
  enc = {i: jax.jit(lambda x, i=i: c.encode_rows(x, impl=i))(x) for i in ("native", "jnp")}
  np.testing.assert_array_equal(enc["native"], enc["jnp"])
  buf = enc["jnp"]
  for op in ("decode_rows", "decode_sum", "decode_sum_encode"):
    got = {
      i: jax.jit(lambda b, i=i: getattr(c, op)(b, n, dtype, impl=i))(buf) for i in ("native", "jnp")
    }
    np.testing.assert_array_equal(_bits(got["native"]), _bits(got["jnp"]), err_msg=op)


def test_plugin_decoder_fuzz_random_bytes_matches_jnp(sign_plugin):
  # Payloads off the network may hold anything (NaN/Inf/subnormal scales): no crash, and the
  # kernels decode them exactly as the specification does.
  c = sign_codec.SignCompressor(block=64)
  rng = np.random.default_rng(7)
  for dtype in DTYPES:
    n = 512
    buf = jnp.asarray(rng.integers(0, 256, (5, c.payload_nbytes(n, dtype)), dtype=np.uint8))
    for op in ("decode_rows", "decode_sum", "decode_sum_encode"):
      a = jax.jit(lambda b: getattr(c, op)(b, n, dtype, impl="native"))(buf)
      b = jax.jit(lambda b: getattr(c, op)(b, n, dtype, impl="jnp"))(buf)
      np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=f"{op} {dtype}")


def test_plugin_bound_holds(sign_plugin):
  c = sign_codec.SignCompressor(block=32)
  x = jnp.asarray(_data(2, 256)).reshape(-1)
  err = jnp.abs(x - c.decode(c.encode(x, impl="native"), impl="native"))
  bound = c.error_bound(x)
  finite = jnp.isfinite(bound)
  assert bool(jnp.all(err[finite] <= bound[finite]))


# ---- collectives: both backends == the jnp path ------------------------------------------


def _collectives(mesh, comp, backend):
  kw = dict(compressor=comp, backend=backend, min_bytes=0)
  n = mesh.devices.size

  def body(x):
    return (
      jcoccl.all_reduce(x, "d", algorithm="one_shot", **kw),
      jcoccl.all_reduce(x, "d", algorithm="two_shot", **kw),
      jcoccl.reduce_scatter(x, "d", scatter_dimension=0, tiled=True, **kw),
      jcoccl.all_gather(x, "d", axis=0, tiled=True, **kw),
      jcoccl.all_to_all(x, "d", 0, 0, tiled=True, **kw),
      jcoccl.ppermute(x, "d", [(i, i + 1) for i in range(n - 1)], **kw),
    )

  spec = jax.P("d")
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_plugin_collectives_xla_and_fused_match_jnp(sign_plugin, dtype):
  mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  x = jax.device_put(jnp.asarray(_data(64, 100), dtype), jax.NamedSharding(mesh, jax.P("d")))
  ref = _collectives(mesh, SignSpec(block=32), "xla")(x)
  comp = sign_codec.SignCompressor(block=32)
  fused_comms.shutdown()
  jcoccl.init(mesh)
  try:
    for backend, target in (("xla", "jcoccl_encode_rows"), ("fused", "jcoccl_fused_")):
      prog = _collectives(mesh, comp, backend)
      assert target in prog.lower(x).as_text(), backend
      for i, (a, b) in enumerate(zip(ref, prog(x))):
        np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=f"{backend} output {i}")
  finally:
    fused_comms.shutdown()


@pytest.mark.parametrize("plugin_level", ["outer", "inner"])
def test_plugin_hierarchical_all_reduce_matches_jnp(sign_plugin, plugin_level):
  # The outer codec travels as "o_"-prefixed attributes (o_plugin, o_params).
  mesh = jax.make_mesh((2, 4), ("node", "gpu"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  axes = ("node", "gpu")
  x = jax.device_put(jnp.asarray(_data(64, 128)), jax.NamedSharding(mesh, jax.P(axes)))
  int8 = jc.int8(block_size=32)

  def prog(sign, backend):
    levels = (sign, int8) if plugin_level == "outer" else (int8, sign)

    def body(v):
      return jcoccl.all_reduce(
        v, axes, compressor=levels, algorithm="hierarchical", backend=backend, min_bytes=0
      )

    spec = jax.P(axes)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))

  ref = prog(SignSpec(block=32), "xla")(x)
  fused_comms.shutdown()
  jcoccl.init(mesh)
  try:
    for backend in ("xla", "fused"):
      got = prog(sign_codec.SignCompressor(block=32), backend)(x)
      np.testing.assert_array_equal(_bits(got), _bits(ref), err_msg=backend)
  finally:
    fused_comms.shutdown()


# ---- loading: idempotence and errors ----------------------------------------------------------


def test_plugin_codec_passes_the_conformance_check_natively(sign_plugin):
  r = jc.check(jc.parse("sign1:block=64"), dtypes=("float32", "float16"), verbose=False)
  assert r, r.table()
  assert r.status("native_match") == {"PASS"}


def test_plugin_load_is_idempotent(sign_plugin):
  again = jc.load_plugin(_sign_library())
  assert again is sign_plugin
  assert sign_plugin.name == "sign1" and sign_plugin.param_names == ("block",)
  assert jc.parse("sign1:block=64") == sign_codec.SignCompressor(block=64)


def test_plugin_missing_file_names_the_path():
  with pytest.raises(FileNotFoundError, match="no plugin library at '/nonexistent/libx.so'"):
    jc.load_plugin("/nonexistent/libx.so")


def test_plugin_not_a_library(tmp_path):
  p = tmp_path / "junk.so"
  p.write_bytes(b"not an ELF file")
  with pytest.raises(OSError, match="cannot open"):
    jc.load_plugin(p)


_BAD_TEMPLATE = r"""
#include <jcoccl/codec_plugin.h>
static const char* Err(void) { return "boom: the kernel refused"; }
static int Fail(void) { return 1; }
static int Ok(const double* p) { (void)p; return 0; }
static int Gran(const double* p, int64_t* g) { *g = (int64_t)p[0]; return 0; }
static int Bytes(const double* p, int64_t n, int32_t d, int64_t* b) {
  (void)d; *b = n / 8 + 4 * (n / (int64_t)p[0]); return 0; }
static int Enc(const double* p, int32_t d, const void* x, int64_t r, int64_t n, uint8_t* o) {
  (void)p; (void)d; (void)x; (void)r; (void)n; (void)o; return Fail(); }
static int Dec(const double* p, int32_t d, const uint8_t* i, int64_t r, int64_t n, void* o) {
  (void)p; (void)d; (void)i; (void)r; (void)n; (void)o; return Fail(); }
static int Sum(const double* p, int32_t d, const uint8_t* const* i, int32_t r, int64_t n, void* o) {
  (void)p; (void)d; (void)i; (void)r; (void)n; (void)o; return Fail(); }
static int SumEnc(const double* p, int32_t d, const uint8_t* const* i, int32_t r, int64_t n,
                  uint8_t* o) { (void)p; (void)d; (void)i; (void)r; (void)n; (void)o; return Fail(); }
static const jcoccl_codec_plugin kP = {ABI, sizeof(jcoccl_codec_plugin), VERSION, NAME, 1, {PARAM},
  VALIDATE, Gran, Bytes, Enc, Dec, Sum, SumEnc, 0, 0, 0, 0, Err};
JCOCCL_PLUGIN_EXPORT const jcoccl_codec_plugin* ENTRY(void) { return &kP; }
"""


def _bad_plugin(tmp_path: Path, tag: str, **defines: str) -> Path:
  """A tiny C plugin whose kernels all fail; ``defines`` override its fields."""
  d = {
    "ABI": "JCOCCL_PLUGIN_ABI_VERSION",
    "VERSION": "JCOCCL_VERSION_STRING",
    "NAME": '"sign1_failing"',
    "PARAM": '"block"',
    "ENTRY": "jcoccl_codec_plugin_v1",
    "VALIDATE": "Ok",
    **defines,
  }
  src = tmp_path / f"{tag}.c"
  src.write_text(_BAD_TEMPLATE)
  out = tmp_path / f"lib{tag}.so"
  cmd = [
    shutil.which("gcc") or "cc", "-shared", "-fPIC", "-O1", f"-I{jcoccl.get_include()}",
    *[f"-D{k}={v}" for k, v in d.items()], str(src), "-o", str(out),
  ]  # fmt: skip
  subprocess.run(cmd, check=True, capture_output=True, text=True)
  return out


@jc.register("sign1_failing")
class FailingSign(sign_codec.SignCompressor):
  """The spec of the failing test plugins (their kernels refuse every call)."""


def test_plugin_missing_entry_symbol(tmp_path):
  lib = _bad_plugin(tmp_path, "nosym", ENTRY="some_other_name")
  with pytest.raises(
    ImportError, match="does not export the entry symbol 'jcoccl_codec_plugin_v1'"
  ):
    jc.load_plugin(lib)


def test_plugin_abi_mismatch(tmp_path):
  lib = _bad_plugin(tmp_path, "abi", ABI="999")
  with pytest.raises(ImportError, match="plugin ABI version 999.*has ABI version 1; rebuild"):
    jc.load_plugin(lib)


def test_plugin_built_for_another_jcoccl(tmp_path):
  lib = _bad_plugin(tmp_path, "oldver", VERSION='"0.0.3"')
  with pytest.raises(ImportError, match=r"built against jcoccl 0\.0\.3.*major\.minor must match"):
    jc.load_plugin(lib)


def test_plugin_param_names_must_be_fields(tmp_path):
  lib = _bad_plugin(tmp_path, "badparam", PARAM='"blk"')
  with pytest.raises(ValueError, match=r"\['blk'\].*not fields of FailingSign"):
    jc.load_plugin(lib)


def test_plugin_unregistered_codec_needs_a_spec(tmp_path):
  lib = _bad_plugin(tmp_path, "noname", NAME='"nobody_codec"')
  with pytest.raises(ValueError, match="'nobody_codec', which is not a registered.*spec="):
    jc.load_plugin(lib)


def test_plugin_with_a_null_required_function(tmp_path):
  lib = _bad_plugin(tmp_path, "nullfn", VALIDATE="0")
  with pytest.raises(ImportError, match="required entries are missing .NULL: validate"):
    jc.load_plugin(lib)


def test_plugin_without_cuda_kernels_on_a_gpu_backend(tmp_path, monkeypatch):
  monkeypatch.setattr(plugins, "_on_gpu", lambda: True)
  monkeypatch.setattr(plugins, "_cuda_module", lambda: object())
  lib = _bad_plugin(tmp_path, "nocuda")
  with pytest.raises(ValueError, match="has no CUDA kernels.*default backend is a GPU"):
    jc.load_plugin(lib)


def test_plugin_codec_under_hadamard_stays_jnp(sign_plugin):
  from jcoccl._src.compressors import native

  assert native.available(sign_codec.SignCompressor(block=32), "encode", jnp.float32)
  assert not native.available(
    jc.hadamard(sign_codec.SignCompressor(block=32)), "encode", jnp.float32
  )


def test_plugin_kernel_error_becomes_a_python_exception(tmp_path):
  jc.load_plugin(_bad_plugin(tmp_path, "failing"))
  c = FailingSign(block=32)
  x = jnp.ones((2, 64), jnp.float32)
  with pytest.raises(Exception, match="sign1_failing' encode: boom: the kernel refused"):
    jax.block_until_ready(c.encode_rows(x, impl="native"))
  buf = c.encode_rows(x, impl="jnp")
  with pytest.raises(Exception, match="decode_sum: boom"):
    jax.block_until_ready(c.decode_sum(buf, 64, jnp.float32, impl="native"))


# ---- CUDA kernels: nvcc, and the host shim == the CPU kernels -----------------------------------


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
def test_plugin_example_builds_with_cuda_where_nvcc_exists():
  lib = _cmake_build(BUILD / "sign_cuda", "-DSIGN_CUDA=ON")
  info = _ffi.require_module("cpu").plugin_load(str(lib), 63, False)
  assert info["status"] == "ok" and info["has_cuda"], info


class _PluginStruct(ctypes.Structure):
  _fields_ = [
    ("abi_version", ctypes.c_uint32),
    ("struct_size", ctypes.c_uint32),
    ("jcoccl_version", ctypes.c_char_p),
    ("name", ctypes.c_char_p),
    ("num_params", ctypes.c_int32),
    ("param_names", ctypes.c_char_p * 8),
    *[
      (f, ctypes.c_void_p)
      for f in (
        "validate", "granule", "payload_bytes", "cpu_encode", "cpu_decode", "cpu_decode_sum",
        "cpu_decode_sum_encode", "cuda_encode", "cuda_decode", "cuda_decode_sum",
        "cuda_decode_sum_encode", "last_error",
      )
    ],
  ]  # fmt: skip


def _shim_library() -> Path:
  """sign_cuda.cu through the host shim, with sign_cpu.cc, in one library (cached)."""
  out_dir = BUILD / "shim"
  out_dir.mkdir(parents=True, exist_ok=True)
  with open(BUILD / "shim.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    return _build_shim(out_dir)


def _build_shim(out_dir: Path) -> Path:
  sources = [EXAMPLE / "sign_cuda.cu", EXAMPLE / "sign_cpu.cc", EXAMPLE / "sign.h"]
  key = gpu_shim._digest([*sources, *gpu_shim.SHIM_DIR.glob("*")], CXX or "")
  lib = out_dir / f"libsign_shim-{key}.so"
  if lib.exists():
    return lib
  kernels = out_dir / f"sign_cuda_shim-{key}.cc"
  kernels.write_text(
    '#define __CUDACC__ 1\n#include "cuda_runtime.h"\n'
    + gpu_shim.translate((EXAMPLE / "sign_cuda.cu").read_text())
  )
  cmd = [
    CXX, "-std=c++17", "-O1", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math",
    "-DJCOCCL_PLUGIN_WITH_CUDA=1", f"-I{gpu_shim.SHIM_DIR}", f"-I{EXAMPLE}",
    f"-I{jcoccl.get_include()}", str(kernels), str(EXAMPLE / "sign_cpu.cc"), "-o", str(lib),
  ]  # fmt: skip
  r = subprocess.run(cmd, capture_output=True, text=True)
  assert r.returncode == 0, r.stderr[-4000:]
  return lib


def _entry(lib: Path) -> _PluginStruct:
  dll = ctypes.CDLL(str(lib))
  fn = dll.jcoccl_codec_plugin_v1
  fn.restype = ctypes.POINTER(_PluginStruct)
  return fn().contents


def _fn(addr: int, *args) -> ctypes._CFuncPtr:
  return ctypes.CFUNCTYPE(ctypes.c_int, *args)(addr)


_P = ctypes.c_void_p
_I64, _I32 = ctypes.c_int64, ctypes.c_int32


def test_plugin_cuda_kernels_under_host_shim_match_cpu_kernels():
  p = _entry(_shim_library())
  assert p.cuda_encode, "the shim library was built without its CUDA kernels"
  ptr = lambda a: a.ctypes.data_as(_P)
  codes = {jnp.float32: 0, jnp.bfloat16: 1, jnp.float16: 2}
  rng = np.random.default_rng(3)
  for block in (32, 128, 4096):
    params = (ctypes.c_double * 8)(block)
    n, rows = 2 * max(block, 256), 3
    for dtype, code in codes.items():
      x = np.asarray(jnp.asarray(_data(rows, n, seed=block), dtype))
      pb = n // 8 + 4 * (n // block)
      enc = [np.zeros((rows, pb), np.uint8) for _ in range(2)]
      assert (
        _fn(p.cpu_encode, _P, _I32, _P, _I64, _I64, _P)(params, code, ptr(x), rows, n, ptr(enc[0]))
        == 0
      )
      assert (
        _fn(p.cuda_encode, _P, _I32, _P, _I64, _I64, _P, _P)(
          params, code, ptr(x), rows, n, ptr(enc[1]), None
        )
        == 0
      )
      np.testing.assert_array_equal(enc[0], enc[1])
      noisy = enc[0].copy()
      noisy[1, rng.integers(0, pb, 40)] = rng.integers(0, 256, 40, dtype=np.uint8)  # any bytes
      dec = [np.zeros((rows, n), x.dtype) for _ in range(2)]
      assert (
        _fn(p.cpu_decode, _P, _I32, _P, _I64, _I64, _P)(
          params, code, ptr(noisy), rows, n, ptr(dec[0])
        )
        == 0
      )
      assert (
        _fn(p.cuda_decode, _P, _I32, _P, _I64, _I64, _P, _P)(
          params, code, ptr(noisy), rows, n, ptr(dec[1]), None
        )
        == 0
      )
      np.testing.assert_array_equal(dec[0].view(np.uint8), dec[1].view(np.uint8))
      row_ptrs = (_P * rows)(*[noisy[r].ctypes.data for r in range(rows)])
      s = [np.zeros((n,), x.dtype) for _ in range(2)]
      assert (
        _fn(p.cpu_decode_sum, _P, _I32, _P, _I32, _I64, _P)(
          params, code, row_ptrs, rows, n, ptr(s[0])
        )
        == 0
      )
      assert (
        _fn(p.cuda_decode_sum, _P, _I32, _P, _I32, _I64, _I64, _I64, _P, _P)(
          params, code, ptr(noisy), rows, pb, 1, n, ptr(s[1]), None
        )
        == 0
      )
      np.testing.assert_array_equal(s[0].view(np.uint8), s[1].view(np.uint8))
      e = [np.zeros((pb,), np.uint8) for _ in range(2)]
      assert (
        _fn(p.cpu_decode_sum_encode, _P, _I32, _P, _I32, _I64, _P)(
          params, code, row_ptrs, rows, n, ptr(e[0])
        )
        == 0
      )
      assert (
        _fn(p.cuda_decode_sum_encode, _P, _I32, _P, _I32, _I64, _I64, _I64, _P, _P)(
          params, code, ptr(noisy), rows, pb, 1, n, ptr(e[1]), None
        )
        == 0
      )
      np.testing.assert_array_equal(e[0], e[1])  # fmt: skip


def test_plugin_kernels_reject_bad_params_with_a_message():
  p = _entry(_shim_library())
  params = (ctypes.c_double * 8)(48)
  assert _fn(p.validate, _P)(params) != 0
  msg = ctypes.CFUNCTYPE(ctypes.c_char_p)(p.last_error)()
  assert b"power of two" in msg
  out = np.zeros(16, np.uint8)
  x = np.zeros(64, np.float32)
  good = (ctypes.c_double * 8)(32)
  assert _fn(p.cuda_encode, _P, _I32, _P, _I64, _I64, _P, _P)(good, 0, x.ctypes.data_as(_P), 1, 48, out.ctypes.data_as(_P), None) != 0  # fmt: skip
  assert b"multiple of the block" in ctypes.CFUNCTYPE(ctypes.c_char_p)(p.last_error)()

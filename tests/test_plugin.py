"""Codec plugins (jcoccl/include/jcoccl/codec_plugin.h, jcoccl.compressors.load_plugin): the
example scaled-sign plugin (examples/custom_codecs/sign) built as a user builds it (cmake and
the installed CMake package), bit-identical to its jnp specification in every row operation
and in every collective on both backends; clear errors for broken libraries; its CUDA
kernels run through the host shim against its CPU kernels; its decoder on random bytes."""

from __future__ import annotations

import ctypes
import fcntl
import functools
import json
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jcoccl
from jcoccl import compressors as jc
from jcoccl._src.compressors import plugins
from jcoccl._src.engine import fused_comms
from jcoccl._src.native import _ffi

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


def _cmake_build(build: Path, *options: str, source: Path = EXAMPLE, cmake: str = "cmake") -> Path:
  """Configures and builds a plugin as the example's README says, with no build type
  (cached in ``build``; one test worker at a time); returns the library's path."""
  build.mkdir(parents=True, exist_ok=True)
  with open(build.parent / f"{build.name}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    for cmd in (
      [cmake, "-S", str(source), "-B", str(build), f"-Djcoccl_DIR={jcoccl.get_cmake_dir()}",
       "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON", *options],
      [cmake, "--build", str(build)],
    ):  # fmt: skip
      r = subprocess.run(cmd, capture_output=True, text=True)
      assert r.returncode == 0, " ".join(cmd) + "\n" + r.stdout[-3000:] + r.stderr[-3000:]
  return build / "libjcoccl_sign.so"


def _assert_optimized(build: Path) -> None:
  """Every compile command of the build optimizes (-O2/-O3), never -O0, without FP
  contraction, although no CMAKE_BUILD_TYPE was given."""
  cache = (build / "CMakeCache.txt").read_text()
  assert re.search(r"^CMAKE_BUILD_TYPE:\w+=$", cache, re.M), "a build type was set"
  commands = json.loads((build / "compile_commands.json").read_text())
  assert commands
  for c in commands:
    flags = c["command"].split()
    assert {"-O3", "-O2"} & set(flags) and "-O0" not in flags, c["command"]
    assert "-ffp-contract=off" in flags, c["command"]


@functools.cache
def _sign_library() -> str:
  build = BUILD / "sign_default_type"
  lib = _cmake_build(build, "-DSIGN_CUDA=OFF")
  _assert_optimized(build)
  return str(lib)


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


def _cmakes() -> list[str]:
  """The CMake of the Python environment (pip's, 4.x) and the system's (3.2x), where present."""
  found = [str(Path(sys.executable).parent / "cmake"), shutil.which("cmake", path="/usr/bin")]
  return list(dict.fromkeys(c for c in found if c and Path(c).is_file()))


def test_plugin_doc_cmakelists_builds_as_written():
  """docs/custom_compressors.md's CMakeLists, copied as it stands next to the example's CPU
  sources, configures and builds with every CMake here (4.x wants cmake_minimum_required
  and project()), optimized with no build type given; the library loads."""
  text = (ROOT / "docs" / "custom_compressors.md").read_text()
  blocks = [b.split("\n", 1)[1] for b in text.split("```")[1::2] if b.startswith("cmake\n")]
  assert len(blocks) == 1
  src = BUILD / "doc_cmakelists"
  src.mkdir(parents=True, exist_ok=True)
  (src / "CMakeLists.txt").write_text(blocks[0])
  for f in ("sign_cpu.cc", "sign.h"):
    shutil.copy(EXAMPLE / f, src / f)
  assert _cmakes()
  for i, cmake in enumerate(_cmakes()):
    build = BUILD / f"doc_build_{i}"
    shutil.rmtree(build, ignore_errors=True)  # a fresh configure: no cached build type
    lib = _cmake_build(build, source=src, cmake=cmake)
    _assert_optimized(build)
    info = _ffi.require_module("cpu").plugin_load(str(lib), 62, False)
    assert info["status"] == "ok" and info["name"] == "sign1", (cmake, info)


_HELPERS_C = r"""
#include <jcoccl/codec_plugin.h>
void to_f32(const uint16_t* in, float* out, int64_t n, int bf16) {
  for (int64_t i = 0; i < n; ++i) out[i] = bf16 ? jcoccl_bf16_to_f32(in[i]) : jcoccl_f16_to_f32(in[i]);
}
void from_f32(const float* in, uint16_t* out, int64_t n, int bf16) {
  for (int64_t i = 0; i < n; ++i) out[i] = bf16 ? jcoccl_f32_to_bf16(in[i]) : jcoccl_f32_to_f16(in[i]);
}
void round_to(const float* in, float* out, int64_t n, int32_t dtype) {
  for (int64_t i = 0; i < n; ++i) out[i] = jcoccl_round_to(dtype, in[i]);
}
"""


def _f32_cases() -> np.ndarray:
  """float32 values for the narrowing conversions: every float16 and bfloat16 value, the
  midpoints between neighbours (ties) and one ulp either side, NaNs with payloads, +-Inf,
  float32 subnormals, values around the float16 overflow and underflow thresholds, and
  random bit patterns."""
  wide = [np.arange(65536, dtype=np.uint16).view(t).astype(np.float32)
          for t in (np.float16, jnp.bfloat16)]  # fmt: skip
  out = []
  for w in wide:
    w = np.unique(w[np.isfinite(w)])
    mid = (w[:-1].astype(np.float64) + w[1:]) / 2
    m32 = mid.astype(np.float32)
    out += [w, m32, np.nextafter(m32, np.float32(np.inf)), np.nextafter(m32, np.float32(-np.inf))]
  bits = np.array([0x7f800001, 0x7fc00000, 0xffc00001, 0x7fbfffff, 0xff800000, 0x7f800000,
                   0x00000001, 0x807fffff, 0x00400000, 0x477ff000, 0x477fefff, 0x33000000,
                   0x33000001, 0xb3000001, 0x38800000, 0x387fffff], np.uint32)  # fmt: skip
  rand = np.random.default_rng(5).integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
  return np.concatenate([*out, bits.view(np.float32), rand.view(np.float32)])


def test_plugin_header_conversions_match_jnp_bitwise(tmp_path):
  """The header's float16/bfloat16 <-> float32 helpers give jnp's bits on XLA:CPU, NaN
  payloads, Inf and subnormals included, and ml_dtypes'/numpy's away from NaN (numpy keeps
  a float16 signaling NaN signaling; XLA quiets it)."""
  src = tmp_path / "helpers.c"
  src.write_text(_HELPERS_C)
  so = tmp_path / "libhelpers.so"
  cc = shutil.which("gcc") or "cc"
  subprocess.run([cc, "-std=c99", "-O2", "-shared", "-fPIC", f"-I{jcoccl.get_include()}",
                  str(src), "-o", str(so)], check=True, capture_output=True)  # fmt: skip
  lib = ctypes.CDLL(str(so))
  ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)
  every = np.arange(65536, dtype=np.uint16)
  x = _f32_cases()
  xla = jax.jit(lambda v, t: v.astype(t), static_argnums=1)
  u32 = lambda a: np.asarray(a).view(np.uint32)
  for bf16, dtype, code in ((0, jnp.float16, 2), (1, jnp.bfloat16, 1)):
    name = jnp.dtype(dtype).name
    h = every.view(dtype)
    wide = np.zeros(65536, np.float32)
    lib.to_f32(ptr(every), ptr(wide), ctypes.c_int64(65536), bf16)
    np.testing.assert_array_equal(u32(wide), u32(xla(jnp.asarray(h), jnp.float32)), name)
    ok = ~np.isnan(h)
    np.testing.assert_array_equal(u32(wide)[ok], u32(h.astype(np.float32))[ok], name)
    narrow = np.zeros(x.size, np.uint16)
    lib.from_f32(ptr(x), ptr(narrow), ctypes.c_int64(x.size), bf16)
    want = np.asarray(xla(jnp.asarray(x), dtype)).view(np.uint16)
    np.testing.assert_array_equal(narrow, want, err_msg=f"float32 -> {name}")
    ok = ~np.isnan(x)
    with np.errstate(over="ignore"):  # numpy warns where it rounds to Inf, as it should
      np.testing.assert_array_equal(narrow[ok], x[ok].astype(dtype).view(np.uint16), name)
    back = np.zeros(x.size, np.float32)
    lib.round_to(ptr(x), ptr(back), ctypes.c_int64(x.size), ctypes.c_int32(code))
    want = xla(xla(jnp.asarray(x), dtype), jnp.float32)
    np.testing.assert_array_equal(u32(back), u32(want), f"float32 -> {name} -> float32")


# ---- row operations: native == jnp, bit for bit ----------------------------------------------


# Every dtype at block 32, and block 256 (32 sign bytes a block instead of 4) once: the block
# size only bounds sign.h's loops and places the scales, the dtype picks the loads and stores.
@pytest.mark.parametrize(
  "block, dtype", [(32, jnp.float32), (32, jnp.bfloat16), (32, jnp.float16), (256, jnp.float32)]
)
def test_plugin_row_ops_match_jnp_bitwise(sign_plugin, block, dtype):
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
  # The outer codec travels as its own descriptor (the "outer" attribute).
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
  (void)d; *b = n / 8 + 4 * (n / (int64_t)p[0]) + EXTRA; return 0; }
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
    "EXTRA": "0",
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


def test_plugin_kernel_error_names_the_plugin_and_the_sizes(tmp_path):
  lib = _bad_plugin(tmp_path, "failing")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", jc.PluginReplacedWarning)  # another test's library
    jc.load_plugin(lib)
  c = FailingSign(block=32)
  x = jnp.ones((2, 64), jnp.float32)
  head = re.escape(
    f"jcoccl plugin 'sign1_failing' ({lib}), rows of n=64 float32 (its payload_bytes: 16 bytes per row): "
  )
  with pytest.raises(
    Exception, match=head + r"encode of 2 row\(s\) failed: boom: the kernel refused"
  ):
    jax.block_until_ready(c.encode_rows(x, impl="native"))
  buf = c.encode_rows(x, impl="jnp")
  with pytest.raises(Exception, match=head + r"decode_sum of 2 row\(s\) failed: boom"):
    jax.block_until_ready(c.decode_sum(buf, 64, jnp.float32, impl="native"))


def test_plugin_payload_size_is_checked_at_load(tmp_path):
  """A library whose payload_bytes disagrees with the jnp specification's row_nbytes (here
  for float16 rows only) is refused at load, naming the plugin, codec, n, dtype and sizes."""
  lib = _bad_plugin(tmp_path, "f16size", EXTRA="(d == 2 ? 4 : 0)")
  msg = (
    f"plugin '{lib}' for codec 'sign1_failing' (sign1_failing): payload_bytes gives 40 "
    "bytes for a row of n=256 float16, but the jnp specification's row_nbytes gives 36"
  )
  with pytest.raises(ValueError, match=re.escape(msg)):
    jc.load_plugin(lib)
  # Each other configuration is checked at its first use.
  lib64 = _bad_plugin(tmp_path, "block64", EXTRA="(p[0] == 64 ? 1 : 0)")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", jc.PluginReplacedWarning)
    jc.load_plugin(lib64)  # the default block (256) agrees
  with pytest.raises(
    ValueError,
    match=re.escape(
      "(sign1_failing:block=64): payload_bytes gives 13 bytes for a row of n=64 float32"
    )
    + ".*row_nbytes gives 12",
  ):
    jax.jit(lambda x: FailingSign(block=64).encode_rows(x, impl="native"))(jnp.ones((1, 64)))


def test_plugin_replacing_a_loaded_plugin_warns(tmp_path):
  first, second = _bad_plugin(tmp_path, "first"), _bad_plugin(tmp_path, "second")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", jc.PluginReplacedWarning)
    jc.load_plugin(first)
  with pytest.warns(
    jc.PluginReplacedWarning,
    match=re.escape(
      f"{str(second)!r} replaces {str(first)!r} as the kernels of codec 'sign1_failing'"
    ),
  ):
    jc.load_plugin(second)
  with warnings.catch_warnings():
    warnings.simplefilter("error", jc.PluginReplacedWarning)
    assert jc.load_plugin(second).path == str(second)  # the same file again: no warning


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

#!/usr/bin/env python3
"""Run the CUDA codec kernels on the CPU through the host shim and compare them with the
CPU codecs, bit for bit (numpy + a C++ compiler; no GPU, no jax).

cuda/gpu/codecs.cu is compiled as C++ against cuda/hostshim/ (threads as fibers, warps and
blocks synchronised as on the GPU, PTX conversion semantics), after rewriting only the two
CUDA syntax forms C++ lacks (launches and `extern __shared__`). The CPU codecs
(cuda/cpu/codecs.cc) are compiled into a second library. Both export the C interface of
cuda/hostshim/codec_api.h; every codec family x dtype x block size is run through encode,
decode, decode_sum and decode_sum_encode on data with NaN, Inf, subnormals, signed zeros,
rounding ties and outliers, and the results compared (tools/gpu_compare.py).

Both run with IEEE subnormals, as the GPU does (the kernels are built without .ftz);
XLA:CPU runs its threads with DAZ/FTZ, so on subnormal inputs the GPU and XLA:CPU results
legitimately differ (see benchmarks/README.md).

  python tools/gpu_shim.py compare                 # build (cached in build/gpu_shim) and compare
  python tools/gpu_shim.py compare --max-grid 3    # cap every grid: the grid-stride paths
  python tools/gpu_shim.py compare --mutate fp8_byte_order   # must FAIL: the check has teeth
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_compare as gc

ROOT = Path(__file__).resolve().parents[1]
SHIM_DIR = ROOT / "cuda" / "hostshim"
PUBLIC_INCLUDE = ROOT / "jcoccl" / "include"  # codec_plugin.h, which codecs/codec.h includes
FLAGS = [
  "-std=c++17",
  "-O2",
  "-fPIC",
  "-shared",
  "-ffp-contract=off",
  "-fno-fast-math",
  "-fno-strict-aliasing",
  "-fvisibility=hidden",
  "-fvisibility-inlines-hidden",
  "-w",
]

# Deliberate defects, each a (file, statement, replacement statement) edit of a copy of the
# sources. The mutant library holds all of them, each behind a run-time switch
# (jc_set_mutation), so one compile serves every mutation; the comparison must report
# mismatches for each.
MUTATIONS: dict[str, tuple[str, str, str]] = {
  "fp8_byte_order": ("cuda/gpu/codecs.cu", "word |= c << (8 * t);", "word |= c << (8 * (3 - t));"),
  "int_code_order": (
    "cuda/gpu/codecs.cu",
    "word |= c << (bits * t);",
    "word |= c << (bits * (t ^ 1));",
  ),
  "odd_width_code_order": (
    "cuda/gpu/codecs.cu",
    "word |= static_cast<uint64_t>(c) << (bits * t);",
    "word |= static_cast<uint64_t>(c) << (bits * (t ^ 1));",
  ),
  "round_half_away": ("cuda/codecs/format.h", "return rintf(x);", "return roundf(x);"),
  "eb_last_word": (
    "cuda/gpu/codecs.cu",
    "if (last > B - 1) last = B - 1;",
    "if (last > B - 2) last = B - 2;",
  ),
  "hadamard_stage": ("cuda/gpu/codecs.cu", "t[a + len] = x - y;", "t[a + len] = y - x;"),
  "spike_fill": (
    "cuda/gpu/codecs.cu",
    "t[j] = mark[j] ? fill : t[j];",
    "t[j] = mark[j] ? 0.0f : t[j];",
  ),
  "spike_unused_slot": (
    "cuda/gpu/codecs.cu",
    "idx[r] = used ? static_cast<uint16_t>(j) : kSpikeUnused;",
    "idx[r] = static_cast<uint16_t>(j);",
  ),
  "chunk_code_order": (
    "cuda/gpu/codecs.cu",
    "w.w[e * BITS / 32] |= code << (e * BITS % 32);",
    "w.w[e * BITS / 32] |= code << ((e ^ 1) * BITS % 32);",
  ),
  "chunk_decode_order": (
    "cuda/gpu/codecs.cu",
    "return (w.w[e * BITS / 32] >> (e * BITS % 32)) & ((1u << BITS) - 1u);",
    "return (w.w[e * BITS / 32] >> ((e ^ 1) * BITS % 32)) & ((1u << BITS) - 1u);",
  ),
  "chunk_eb_width": (
    "cuda/gpu/codecs.cu",
    "return (reinterpret_cast<const uint32_t*>(row)[b >> 2] >> (8 * (b & 3u))) & 0xffu;",
    "return (reinterpret_cast<const uint32_t*>(row)[b >> 2] >> (8 * (b & 1u))) & 0xffu;",
  ),
  "chunk_sum_order": (
    "cuda/gpu/codecs.cu",
    "DecodeChunk<K, BITS, SYM>(c, lut, row0 + r * stride, ci, v);",
    "DecodeChunk<K, BITS, SYM>(c, lut, row0 + (nrows - r) * stride, ci, v);",
  ),
  "group_stats_lanes": (
    "cuda/gpu/codecs.cu",
    "amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));",
    "amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o & 1));",
  ),
  "group_stats_warps": (
    "cuda/gpu/codecs.cu",
    "amax = fmaxf(amax, red[kWarps + w]);",
    "amax = fmaxf(amax, red[kWarps + w0]);",
  ),
  "warp_hadamard_lanes": (
    "cuda/gpu/codecs.cu",
    "v[j] = upper ? other - v[j] : v[j] + other;",
    "v[j] = upper ? v[j] - other : v[j] + other;",
  ),
  "warp_hadamard_in_lane": ("cuda/gpu/codecs.cu", "v[j + LEN] = x - y;", "v[j + LEN] = y - x;"),
  "warp_hadamard_codes": (
    "cuda/gpu/codecs.cu",
    "w |= static_cast<uint64_t>(Quantize<K, BITS, SYM>(c, v[e], sc, mn)) << (e * BITS);",
    "w |= static_cast<uint64_t>(Quantize<K, BITS, SYM>(c, v[e], sc, mn)) << ((e ^ 1) * BITS);",
  ),
  "warp_hadamard_decode": (
    "cuda/gpu/codecs.cu",
    "return static_cast<uint32_t>(w >> (e * BITS)) & ((1u << BITS) - 1u);",
    "return static_cast<uint32_t>(w >> ((e ^ 1) * BITS)) & ((1u << BITS) - 1u);",
  ),
  "warp_spike_fill": (
    "cuda/gpu/codecs.cu",
    "for (int e = 0; e < kPerLane; ++e) v[e] = (marks >> e) & 1u ? fill : v[e];",
    "for (int e = 0; e < kPerLane; ++e) v[e] = (marks >> e) & 1u ? 0.0f : v[e];",
  ),
  "warp_spike_unused_slot": (
    "cuda/gpu/codecs.cu",
    "idx[r] = used ? static_cast<uint16_t>(at) : kSpikeUnused;",
    "idx[r] = static_cast<uint16_t>(at);",
  ),
  "warp_spike_restore": (
    "cuda/gpu/codecs.cu",
    "for (int e = 0; e < kPerLane; ++e) v[e] = i - first == static_cast<uint32_t>(e) ? val : v[e];",
    "for (int e = 0; e < kPerLane; ++e) v[e] = i - first == (e ^ 1u) ? val : v[e];",
  ),
  "sum_order": (
    "cuda/gpu/codecs.cu",
    "for (int r = 1; r < nrows; ++r) v = v + dec(row + r * stride, i);",
    "for (int r = nrows - 1; r >= 1; --r) v = v + dec(row + r * stride, i);",
  ),
}
MUTATION_IDS = {name: i + 1 for i, name in enumerate(MUTATIONS)}


# ---- building ------------------------------------------------------------------------------


def compiler() -> str | None:
  """A C++17 compiler with _Float16 (g++ >= 12, clang++ >= 15): $CXX, g++, clang++."""
  for c in filter(None, (os.environ.get("CXX"), "g++", "clang++")):
    if shutil.which(c):
      return c
  return None


def xla_include() -> str:
  spec = importlib.util.find_spec("jaxlib")
  if spec is None or not spec.submodule_search_locations:
    raise RuntimeError("jaxlib is not installed: its XLA FFI headers are needed")
  return os.path.join(list(spec.submodule_search_locations)[0], "include")


def translate(src: str) -> str:
  """Rewrites the two CUDA-only syntax forms of codecs.cu into shim calls (nothing else)."""
  out, launches = re.subn(
    r"(\w+)<<<(.*?)>>>\(", r"::jcoccl_shim::LaunchCfg(\2).Run(\1, ", src, flags=re.S
  )
  out, _ = re.subn(
    r"extern\s+__shared__\s+(\w+)\s+(\w+)\[\];",
    r"\1* \2 = ::jcoccl_shim::DynamicShared<\1>();",
    out,
  )
  if launches == 0:
    raise RuntimeError("no kernel launch found in cuda/gpu/codecs.cu")
  return out


def _compile(
  cxx: str, sources: list[str], includes: list[str], out: Path, defines: list[str] = ()
) -> None:
  cmd = [
    cxx,
    *FLAGS,
    *[f"-I{i}" for i in includes],
    *[f"-D{d}" for d in defines],
    *sources,
    "-o",
    str(out),
  ]
  r = subprocess.run(cmd, capture_output=True, text=True)
  if r.returncode != 0:
    raise RuntimeError(f"compile failed: {' '.join(cmd)}\n{r.stderr[-4000:]}")


def _digest(paths: list[Path], extra: str) -> str:
  h = hashlib.sha256(extra.encode())
  for p in paths:
    h.update(p.read_bytes())
  return h.hexdigest()[:16]


def _mutated_sources(cuda: Path) -> dict[str, str]:
  """codecs.cu and format.h with every mutation behind `if (g_mutation == id)`."""
  text = {
    "cuda/gpu/codecs.cu": (cuda / "gpu" / "codecs.cu").read_text(),
    "cuda/codecs/format.h": (cuda / "codecs" / "format.h").read_text(),
  }
  for name, (path, old, new) in MUTATIONS.items():
    if text[path].count(old) != 1:
      raise RuntimeError(f"mutation {name}: {old!r} must occur once in {path}")
    switched = (
      f"if (::jcoccl_shim::g_mutation == {MUTATION_IDS[name]}) {{ {new} }} else {{ {old} }}"
    )
    text[path] = text[path].replace(old, switched)
  return text


def build(out_dir: Path, mutants: bool = False) -> tuple[Path, Path]:
  """Builds (or reuses) the shim library of the CUDA kernels and the CPU reference library.

  Args:
    out_dir: cache directory; a library is rebuilt only when its inputs changed.
    mutants: build the shim from copies holding every MUTATIONS entry (off until
      jc_set_mutation picks one).
  Returns:
    (shim library, reference library) paths.

  Example:
    shim, ref = build(Path("build/gpu_shim"))
  """
  cxx = compiler()
  if cxx is None:
    raise RuntimeError("no C++ compiler (set CXX, or install g++ >= 12 or clang++ >= 15)")
  out_dir = out_dir.resolve()  # the kernels' path goes into an #include
  out_dir.mkdir(parents=True, exist_ok=True)
  cuda = ROOT / "cuda"
  ref_inputs = sorted(
    [
      *cuda.glob("codecs/*.h"),
      cuda / "registry.h",
      PUBLIC_INCLUDE / "jcoccl" / "codec_plugin.h",
      *cuda.glob("cpu/*.h"),
      cuda / "cpu" / "codecs.cc",
      cuda / "cpu" / "codec_kernels.inc",
      SHIM_DIR / "ref_api.cc",
      SHIM_DIR / "codec_api.h",
    ]
  )
  ref = out_dir / f"libref-{_digest(ref_inputs, cxx + str(FLAGS))}.so"
  if not ref.exists():
    _compile(
      cxx,
      [str(cuda / "cpu" / "codecs.cc"), str(SHIM_DIR / "ref_api.cc")],
      [str(cuda), str(PUBLIC_INCLUDE), xla_include()],
      ref.with_suffix(f".{os.getpid()}.tmp"),
    )
    # A per-process temporary: test workers may build the same library at once.
    ref.with_suffix(f".{os.getpid()}.tmp").replace(ref)
  inputs = sorted(
    [
      *cuda.glob("codecs/*.h"),
      *SHIM_DIR.glob("*"),
      cuda / "registry.h",
      cuda / "gpu" / "codecs.cu",
      PUBLIC_INCLUDE / "jcoccl" / "codec_plugin.h",
    ]
  )
  tag = "mutants" if mutants else "orig"
  key = _digest(inputs, f"{cxx} {FLAGS} {tag} {sorted(MUTATIONS.items())}")
  shim = out_dir / f"libshim-{tag}-{key}.so"
  if not shim.exists():
    src_dir = out_dir / f"src-{tag}-{key}"
    (src_dir / "codecs").mkdir(parents=True, exist_ok=True)
    if mutants:
      text = _mutated_sources(cuda)
      # Found before cuda/codecs/format.h: a quoted include looks next to the includer first.
      (src_dir / "codecs" / "format.h").write_text(text["cuda/codecs/format.h"])
    else:
      text = {"cuda/gpu/codecs.cu": (cuda / "gpu" / "codecs.cu").read_text()}
    kernels = src_dir / "gpu_codecs_shim.cc"
    kernels.write_text(translate(text["cuda/gpu/codecs.cu"]))
    _compile(
      cxx,
      [str(SHIM_DIR / "shim_api.cc")],
      [str(SHIM_DIR), str(cuda), str(PUBLIC_INCLUDE), xla_include()],
      shim.with_suffix(f".{os.getpid()}.tmp"),
      [f'JCOCCL_SHIM_KERNELS="{kernels}"'],
    )
    shim.with_suffix(f".{os.getpid()}.tmp").replace(shim)
  return shim, ref


# ---- the libraries -------------------------------------------------------------------------


class Spec(NamedTuple):
  name: str
  kind: int
  bits: int = 8
  block: int = 1
  symmetric: int = 1
  fp8: int = 0
  cast_dtype: int = gc.BF16
  hadamard: int = 0
  abs_error: float = 0.0
  spike: int = 0

  def text(self) -> bytes:
    """The codec descriptor's text form (codec_api.h; the fields not named here keep
    CodecSpec's defaults). A float is written as the shortest decimal of its float32, which
    C++'s strtof reads back exactly."""
    fields = self._asdict()
    del fields["name"]
    text = (f"{k}={np.float32(v) if isinstance(v, float) else v}" for k, v in fields.items())
    return " ".join(text).encode()

  def granule(self) -> int:  # a spike codec's granule is its inner block
    inner = 1 if self.kind in (gc.NONE, gc.CAST) else self.block
    return max(inner, self.hadamard)

  def layout(self, dtype: int, n: int) -> gc.Layout:
    return gc.Layout(self.kind, self.block, self.cast_dtype, self.hadamard, dtype, n)


ELEM_BYTES = {gc.F32: 4, gc.BF16: 2, gc.F16: 2}
GUARD = 64  # bytes after every output that no kernel may touch


class CodecLib:
  """One of the two libraries (shim or reference) behind codec_api.h."""

  def __init__(self, path: Path, fill: int):
    self.lib = ctypes.CDLL(str(path))
    self.fill = fill
    p, c, i32, i64 = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_int64
    self.lib.jc_payload_bytes.restype = i64
    self.lib.jc_payload_bytes.argtypes = [c, i32, i64]
    self.lib.jc_encode.argtypes = [c, i32, p, i64, i64, p]
    self.lib.jc_decode.argtypes = [c, i32, p, i64, i64, p]
    self.lib.jc_decode_sum.argtypes = [c, i32, p, i32, i64, i64, i64, p]
    self.lib.jc_decode_sum_encode.argtypes = [c, i32, p, i32, i64, i64, i64, p]
    self.lib.jc_last_message.restype = ctypes.c_char_p

  def payload_bytes(self, s: Spec, dtype: int, n: int) -> int:
    p = int(self.lib.jc_payload_bytes(s.text(), dtype, n))
    if p < 0:
      raise RuntimeError(f"jc_payload_bytes({s.name}): {self.lib.jc_last_message().decode()}")
    return p

  def _call(self, fn: Callable, nbytes: int, *args) -> np.ndarray:
    out = np.full(nbytes + GUARD, self.fill, np.uint8)
    rc = fn(*args, out.ctypes.data)
    if rc != 0:
      raise RuntimeError(f"{fn.__name__} failed ({rc}): {self.lib.jc_last_message().decode()}")
    if (out[nbytes:] != self.fill).any():
      raise RuntimeError(f"{fn.__name__} wrote past the end of its output")
    return out[:nbytes]

  def encode(self, s: Spec, dtype: int, x: np.ndarray) -> np.ndarray:
    rows, n = x.shape[0], x.shape[1]
    p = self.payload_bytes(s, dtype, n)
    x = np.ascontiguousarray(x)
    return self._call(
      self.lib.jc_encode, rows * p, s.text(), dtype, x.ctypes.data, rows, n
    ).reshape(rows, p)

  def decode(self, s: Spec, dtype: int, buf: np.ndarray, n: int) -> np.ndarray:
    rows = buf.shape[0]
    buf = np.ascontiguousarray(buf)
    return self._call(
      self.lib.jc_decode,
      rows * n * ELEM_BYTES[dtype],
      s.text(),
      dtype,
      buf.ctypes.data,
      rows,
      n,
    ).reshape(rows, -1)

  def decode_sum(
    self, s: Spec, dtype: int, buf: np.ndarray, nrows: int, stride: int, n: int
  ) -> np.ndarray:
    outs = buf.size // (nrows * stride)
    buf = np.ascontiguousarray(buf)
    return self._call(
      self.lib.jc_decode_sum,
      outs * n * ELEM_BYTES[dtype],
      s.text(),
      dtype,
      buf.ctypes.data,
      nrows,
      stride,
      outs,
      n,
    ).reshape(outs, -1)

  def decode_sum_encode(
    self, s: Spec, dtype: int, buf: np.ndarray, nrows: int, stride: int, n: int
  ) -> np.ndarray:
    outs = buf.size // (nrows * stride)
    p = self.payload_bytes(s, dtype, n)
    buf = np.ascontiguousarray(buf)
    return self._call(
      self.lib.jc_decode_sum_encode,
      outs * p,
      s.text(),
      dtype,
      buf.ctypes.data,
      nrows,
      stride,
      outs,
      n,
    ).reshape(outs, p)


# ---- cases ---------------------------------------------------------------------------------

BLOCKS = (32, 64, 128, 256, 512, 1024, 2048, 4096)
ODD_WIDTH_BLOCKS = (32, 256, 4096)


def specs() -> list[Spec]:
  """Every codec family x block size, and Hadamard around each inner family."""
  out = [
    Spec("none", gc.NONE),
    Spec("cast_bf16", gc.CAST, cast_dtype=gc.BF16),
    Spec("cast_f16", gc.CAST, cast_dtype=gc.F16),
  ]
  for b in BLOCKS:
    for bits in (8, 4, 2):
      out.append(Spec(f"int{bits}_B{b}", gc.INT, bits=bits, block=b))
      out.append(Spec(f"int{bits}_asym_B{b}", gc.INT, bits=bits, block=b, symmetric=0))
    if b in ODD_WIDTH_BLOCKS:  # the byte-straddling widths: packing is what differs
      for bits in (7, 6, 5, 3):
        out.append(Spec(f"int{bits}_B{b}", gc.INT, bits=bits, block=b))
        out.append(Spec(f"int{bits}_asym_B{b}", gc.INT, bits=bits, block=b, symmetric=0))
    out.append(Spec(f"fp8_e4m3_B{b}", gc.FP8, block=b, fp8=0))
    out.append(Spec(f"fp8_e5m2_B{b}", gc.FP8, block=b, fp8=1))
    out.append(Spec(f"eb_1e-2_B{b}", gc.ERROR_BOUNDED, block=b, abs_error=1e-2))
    out.append(Spec(f"eb_0.25_B{b}", gc.ERROR_BOUNDED, block=b, abs_error=0.25))
  out += [
    Spec("had2_none", gc.NONE, hadamard=2),
    Spec("had64_cast_f16", gc.CAST, cast_dtype=gc.F16, hadamard=64),
    Spec("had256_int4_B128", gc.INT, bits=4, block=128, hadamard=256),
    Spec("had32_int2_asym_B256", gc.INT, bits=2, block=256, symmetric=0, hadamard=32),
    Spec("had4096_int8_B64", gc.INT, bits=8, block=64, hadamard=4096),
    Spec("had128_int3_B128", gc.INT, bits=3, block=128, hadamard=128),
    Spec("had64_fp8_e4m3_B128", gc.FP8, block=128, hadamard=64),
    Spec("had128_eb_B32", gc.ERROR_BOUNDED, block=32, abs_error=1e-2, hadamard=128),
    # Granule 256: rows of whole 256-element tiles, the register (warp) transform.
    Spec("had256_fp8_e5m2_B64", gc.FP8, block=64, fp8=1, hadamard=256),
    Spec("had16_int8_asym_B256", gc.INT, bits=8, block=256, symmetric=0, hadamard=16),
  ]
  # Spike reserving around each inner family; k from 1 to block - 1 (every slot used, and
  # blocks with fewer finite values than k).
  out += [
    Spec("spike1_int4_B32", gc.INT, bits=4, block=32, spike=1),
    Spec("spike4_int2_B256", gc.INT, bits=2, block=256, spike=4),
    Spec("spike3_int3_asym_B64", gc.INT, bits=3, block=64, symmetric=0, spike=3),
    Spec("spike8_int5_B128", gc.INT, bits=5, block=128, spike=8),
    Spec("spike2_int6_asym_B32", gc.INT, bits=6, block=32, symmetric=0, spike=2),
    Spec("spike5_int7_B64", gc.INT, bits=7, block=64, spike=5),
    Spec("spike4_int8_B4096", gc.INT, bits=8, block=4096, spike=4),
    Spec("spike31_int4_asym_B32", gc.INT, bits=4, block=32, symmetric=0, spike=31),
    Spec("spike2_fp8_e4m3_B64", gc.FP8, block=64, fp8=0, spike=2),
    Spec("spike16_fp8_e5m2_B512", gc.FP8, block=512, fp8=1, spike=16),
    Spec("spike4_eb_1e-2_B32", gc.ERROR_BOUNDED, block=32, abs_error=1e-2, spike=4),
  ]
  return out


def row_length(s: Spec) -> int:
  """An odd multiple of the granule near 700 (at least 3 granules): partial CUDA blocks.

  A Hadamard row has at most 65 granules: the block-wide kernel runs one CUDA block per
  granule, and the shim runs each of its threads as a fiber (had2_none's 351 granules a row
  took 38% of the comparison).
  """
  g = s.granule()
  m = max(3, -(-700 // g))
  if s.hadamard:
    m = min(m, 65)
  return g * (m | 1)


def data(rows: int, n: int, dtype: int, seed: int) -> np.ndarray:
  """rows x n elements of ``dtype`` (as float32, or uint16 bits) mixing every special case.

  Runs of 32 are: normal, outliers, zeros, -0, a constant, subnormals, tiny values, exact
  rounding ties (multiples of 1/8), huge values, and (2-byte types) random bit patterns;
  a few single NaN/Inf elements are scattered in.
  """
  rng = np.random.default_rng(seed)
  full = -(-n // 32) * 32
  x = rng.standard_normal((rows, full)).astype(np.float32) * np.float32(3.0)
  runs = x.reshape(rows, -1, 32)
  kind = rng.integers(0, 11, size=runs.shape[:2])
  runs[kind == 1] *= np.float32(1e4)
  runs[kind == 2] = 0.0
  runs[kind == 3] = -0.0
  runs[kind == 4] = 1.25
  runs[kind == 5] *= np.float32(1e-39)
  runs[kind == 6] *= np.float32(1e-3)
  ties = (rng.integers(-32, 33, size=runs.shape) / 8.0).astype(np.float32)
  runs[kind == 7] = ties[kind == 7]
  runs[kind == 8] *= np.float32(1e37)
  flat = x.reshape(-1)
  pick = rng.choice(flat.size, size=max(2, flat.size // 500), replace=False)
  flat[pick[0::3]] = np.nan
  flat[pick[1::3]] = np.inf
  flat[pick[2::3]] = -np.inf
  if dtype == gc.F32:
    return np.ascontiguousarray(x[:, :n])
  with np.errstate(over="ignore"):
    bits = (
      (x.view(np.uint32) >> 16).astype(np.uint16)
      if dtype == gc.BF16
      else (x.astype(np.float16).view(np.uint16))
    )
  rnd = rng.integers(0, 1 << 16, size=bits.shape, dtype=np.uint16)
  b_runs, r_runs = bits.reshape(rows, -1, 32), rnd.reshape(rows, -1, 32)
  b_runs[kind == 9] = r_runs[kind == 9]
  return np.ascontiguousarray(bits[:, :n])


def compare(shim: CodecLib, ref: CodecLib, s: Spec, dtype: int, seed: int) -> list[str]:
  """All four operations of one spec and dtype; returns mismatch descriptions."""
  n, rows, nrows = row_length(s), 3, 3
  lay = s.layout(dtype, n)
  x = data(rows * nrows, n, dtype, seed)
  bad = []

  def check(what: str, a: np.ndarray, b: np.ndarray, payload: bool) -> None:
    m = gc.payload_mismatch(lay, a, b) if payload else gc.float_mismatch(a, b, dtype)
    if m.any():
      bad.append(f"{s.name} {['f32', 'bf16', 'f16'][dtype]} {what}: {gc.describe(m)}")

  enc_ref = ref.encode(s, dtype, x)
  check("encode", shim.encode(s, dtype, x), enc_ref, True)
  check("decode", shim.decode(s, dtype, enc_ref, n), ref.decode(s, dtype, enc_ref, n), False)
  p = enc_ref.shape[1]
  for stride in (p, p + 64):
    buf = np.zeros((rows * nrows, stride), np.uint8)
    buf[:, :p] = enc_ref
    check(
      f"decode_sum(stride={stride})",
      shim.decode_sum(s, dtype, buf, nrows, stride, n),
      ref.decode_sum(s, dtype, buf, nrows, stride, n),
      False,
    )
    check(
      f"decode_sum_encode(stride={stride})",
      shim.decode_sum_encode(s, dtype, buf, nrows, stride, n),
      ref.decode_sum_encode(s, dtype, buf, nrows, stride, n),
      True,
    )
  return bad


def load(build_dir: Path, mutants: bool = False, max_grid: int = 0) -> tuple[CodecLib, CodecLib]:
  """Builds (or reuses) and loads the shim and reference libraries, as `compare` runs them:
  distinct fill bytes for their output buffers (a byte neither writes shows as a mismatch),
  and every launch's grid capped at ``max_grid`` (0: none).

  Example:
    shim, ref = load(Path("build/gpu_shim"), mutants=True)
  """
  shim_path, ref_path = build(build_dir, mutants=mutants)
  shim, ref = CodecLib(shim_path, 0xA5), CodecLib(ref_path, 0x5A)
  shim.lib.jc_set_max_grid(ctypes.c_uint(max_grid))
  return shim, ref


def run_all(shim: CodecLib, ref: CodecLib, only: str | None = None) -> Iterator[list[str]]:
  for i, s in enumerate(specs()):
    if only and not re.search(only, s.name):
      continue
    for dtype in (gc.F32, gc.BF16, gc.F16):
      yield compare(shim, ref, s, dtype, seed=1000 * i + dtype)


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  sub = p.add_subparsers(dest="cmd", required=True)
  c = sub.add_parser("compare", help="build and compare every case")
  c.add_argument("--build-dir", default=str(ROOT / "build" / "gpu_shim"))
  c.add_argument(
    "--mutate",
    choices=sorted(MUTATIONS),
    default=None,
    help="compile a deliberately broken copy (the comparison must fail)",
  )
  c.add_argument("--max-grid", type=int, default=0, help="cap every launch's grid (0: none)")
  c.add_argument("--only", default=None, help="regex over case names")
  args = p.parse_args(argv)
  t0 = time.perf_counter()
  shim, ref = load(Path(args.build_dir), args.mutate is not None, args.max_grid)
  t_build = time.perf_counter() - t0
  if args.mutate:
    shim.lib.jc_set_mutation(MUTATION_IDS[args.mutate])
  cases, bad = 0, []
  for b in run_all(shim, ref, args.only):
    cases += 1
    bad += b
  for m in bad[:50]:
    print("MISMATCH", m)
  print(
    f"shim vs CPU codecs: {cases} cases (spec x dtype, 4 ops each), {len(bad)} mismatches; "
    f"build {t_build:.1f} s, run {time.perf_counter() - t0 - t_build:.1f} s"
  )
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())

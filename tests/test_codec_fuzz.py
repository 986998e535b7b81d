"""Decoders are total over arbitrary payload bytes (payloads cross the network untrusted).

Random payloads and mutations of valid ones (bit flips, width bytes, scale/min/raw fields set
to NaN, Inf, huge, subnormal, spike indices past the block or repeated) go through decode_rows, decode_sum and decode_sum_encode, native
and jnp; the results must agree bit for bit (cuda/WIRE_FORMAT.md defines every byte pattern,
NaNs included). ``tools/asan_fuzz.sh`` runs this file against a native module built with
AddressSanitizer and UndefinedBehaviorSanitizer, so a read or write outside a buffer fails.

Hypothesis runs a fixed, derandomised profile: CI sees the same examples every time.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jcoccl import compressors as jc
from jcoccl._src.compressors import native
from jcoccl._src.native import _ffi

if _ffi.native_module("cpu") is None:
  pytest.skip(
    f"native module jcoccl._cpu is absent ({_ffi.native_import_error('cpu')})",
    allow_module_level=True,
  )


FUZZ = settings(
  derandomize=True,
  database=None,
  deadline=None,
  max_examples=6,
  suppress_health_check=list(HealthCheck),
  print_blob=True,
)

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
CODECS = [
  jc.none(),
  jc.cast(jnp.bfloat16),
  jc.cast(jnp.float16),
  jc.int8(block_size=32),
  jc.int8(block_size=256, symmetric=False),
  jc.int4(block_size=64),
  jc.int4(block_size=4096, symmetric=False),
  jc.int2(block_size=32),
  jc.int2(block_size=128, symmetric=False),
  jc.int3(block_size=32),
  jc.int5(block_size=64, symmetric=False),
  jc.int6(block_size=128),
  jc.int7(block_size=32, symmetric=False),
  jc.fp8("e4m3", block_size=32),
  jc.fp8("e5m2", block_size=256),
  jc.error_bounded(1e-2, block_size=32),
  jc.error_bounded(1e-3, block_size=256),
  jc.error_bounded(0.5, block_size=4096),
  jc.hadamard(jc.int4(block_size=64), size=128),
  jc.hadamard(jc.fp8("e5m2", block_size=32), size=64),
  jc.hadamard(jc.error_bounded(1e-2, block_size=64), size=64),
  jc.hadamard(jc.none(), size=32),
  jc.spike(jc.int4(block_size=64), k=3),
  jc.spike(jc.int3(block_size=32, symmetric=False), k=31),
  jc.spike(jc.fp8("e5m2", block_size=128), k=4),
  jc.spike(jc.error_bounded(1e-2, block_size=32), k=2),
]
NROWS = 3

# float32 bit patterns written over scales, minimums, raw words and `none` elements.
SPECIALS = np.array(
  [
    0x7FC00000,
    0xFFC00000,
    0x7F800001,
    0xFF812345,
    0x7FC12345,  # NaNs (quiet, signalling)
    0x7F800000,
    0xFF800000,  # +-Inf
    0x7F7FFFFF,
    0xFF7FFFFF,
    0x7E967699,
    0x4F000000,  # +-max, 1e38, 2^31
    0x00000001,
    0x807FFFFF,
    0x00400000,  # subnormals
    0x00000000,
    0x80000000,
    0x00800000,
    0x0DA24260,  # +-0, smallest normal, 1e-30
    0xBF800000,
    0x3F800000,  # -1, 1
  ],
  dtype=np.uint32,
)
WIDTHS = (0, 1, 7, 16, 31, 32, 33, 40, 63, 64, 127, 128, 200, 254, 255)


def _inner(c):
  return c.inner if c.kind in ("hadamard", "spike") else c


def _row_len(c) -> int:
  return max(c.granule, 128)


def _sections(c, n: int, dtype) -> dict[str, tuple[int, int]]:
  """Byte ranges [start, stop) of a row payload's width bytes and 4-byte float fields."""
  inner = _inner(c)
  d = jnp.dtype(jnp.float32) if c.kind == "hadamard" else jnp.dtype(dtype)
  p = c.payload_nbytes(n, dtype)
  if c.kind == "spike":  # the inner sections, then the values (floats too) and the indices
    at = inner.payload_nbytes(n, jnp.float32)
    slots = c.k * (n // c.granule)
    secs = _sections(inner, n, jnp.float32)
    secs["floats"] = (secs["floats"][0], at + 4 * slots)
    return {**secs, "indices": (at + 4 * slots, at + 6 * slots)}
  if inner.kind == "int":
    return {"floats": (n * inner.bits // 8, p)}
  if inner.kind == "fp8":
    return {"floats": (n, p)}
  if inner.kind == "error_bounded":
    nb = n // inner.block_size
    nw = -(-nb // 4) * 4
    return {"widths": (0, nb), "floats": (nw, p)}
  if inner.kind == "none" and d.itemsize == 4:
    return {"floats": (0, p)}
  return {"halves": (0, p)}  # none/cast with 16-bit elements


def _bits(a) -> np.ndarray:
  a = np.asarray(a)
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _assert_same(got, want, what: str) -> None:
  got, want = np.asarray(got), np.asarray(want)
  assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape)
  bad = np.argwhere(_bits(got) != _bits(want))
  assert bad.size == 0, (
    f"{what}: {len(bad)} elements differ, first at {bad[:3].tolist()}: "
    f"native {_bits(got)[tuple(bad[0])]:#x} vs jnp {_bits(want)[tuple(bad[0])]:#x}"
  )


@functools.cache
def _decoders(c, n: int, dtype):
  """jit of buf -> ((decode, decode_sum, decode_sum_encode) for jnp, same for native)."""

  def run(buf):
    return [
      (
        c.decode_rows(buf, n, dtype, impl=impl),
        c.decode_sum(buf, n, dtype, impl=impl),
        c.decode_sum_encode(buf, n, dtype, impl=impl),
      )
      for impl in ("jnp", "native")
    ]

  return jax.jit(run)


@functools.cache
def _valid_payload(c, n: int, dtype) -> np.ndarray:
  """uint8[NROWS, P]: normal data, outliers, a zero block, a NaN block, huge values."""
  rng = np.random.default_rng(n)
  x = rng.standard_normal((NROWS, n)).astype(np.float32)
  x[0, : n // 4] = 0.0
  x[1, 3] = np.nan
  x[1, n // 2 :] *= np.float32(1e4)
  x[2, -1] = np.float32(6e4 if jnp.dtype(dtype) == jnp.float16 else 3e38)
  # Native encode (bit-identical to jnp: tests/test_native_codecs.py) compiles in no time.
  return np.asarray(c.encode_rows(jnp.asarray(x).astype(dtype), impl="native"))


def _mutate(buf: np.ndarray, secs: dict, ops: list, rng: np.random.Generator) -> None:
  """Applies (op, arg) mutations in place to a uint8[rows, P] buffer."""
  rows, _ = buf.shape
  flat = buf.reshape(-1)
  for op, arg in ops:
    r = arg % rows
    if op == "flip":
      pos = rng.integers(0, flat.size)
      flat[pos] ^= np.uint8(1 << (arg % 8))
    elif op == "byte":
      flat[rng.integers(0, flat.size)] = rng.integers(0, 256)
    elif op == "width" and "widths" in secs:
      lo, hi = secs["widths"]
      buf[r, rng.integers(lo, hi)] = WIDTHS[arg % len(WIDTHS)]
    elif op == "special":
      lo, hi = secs.get("floats", secs.get("halves"))
      k = lo + 4 * rng.integers(0, (hi - lo) // 4)
      buf[r, k : k + 4] = np.frombuffer(SPECIALS[arg % len(SPECIALS)].tobytes(), np.uint8)
    elif op == "index" and "indices" in secs:  # a spike index: edge, past the block, repeated
      lo, hi = secs["indices"]
      k = lo + 2 * rng.integers(0, (hi - lo) // 2)
      g = int(arg >> 3) % 4096
      v = (0, 1, g, 31, 32, 4095, 0xFFFF, int(buf[r, lo]) | int(buf[r, lo + 1]) << 8)[arg % 8]
      buf[r, k : k + 2] = np.frombuffer(np.uint16(v).tobytes(), np.uint8)
    elif op == "fill":  # every float field of a row the same special value
      lo, hi = secs.get("floats", secs.get("halves"))
      buf[r, lo:hi] = np.tile(
        np.frombuffer(SPECIALS[arg % len(SPECIALS)].tobytes(), np.uint8), (hi - lo) // 4
      )


def _check(c, dtype, buf: np.ndarray) -> None:
  n = _row_len(c)
  d = jnp.dtype(dtype)
  ref, got = _decoders(c, n, d)(jnp.asarray(buf))
  for what, a, b in zip(("decode_rows", "decode_sum", "decode_sum_encode"), got, ref):
    _assert_same(a, b, f"{c} {d.name} {what}")


MUTATIONS = st.lists(
  st.tuples(
    st.sampled_from(["flip", "byte", "width", "special", "fill", "index"]), st.integers(0, 2**16)
  ),
  min_size=1,
  max_size=8,
)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("c", CODECS, ids=str)
@FUZZ
@given(seed=st.integers(0, 2**32 - 1), random=st.booleans(), ops=MUTATIONS)
def test_decoders_agree_on_any_payload(c, dtype, seed, random, ops):
  """Random bytes (random=True) or a mutated valid payload decode identically everywhere."""
  n = _row_len(c)
  for op in ("decode", "decode_sum", "decode_sum_encode"):
    assert native.available(c, op, dtype)
  rng = np.random.default_rng(seed)
  p = c.payload_nbytes(n, dtype)
  if random:
    buf = rng.integers(0, 256, (NROWS, p), dtype=np.uint8)
  else:
    buf = _valid_payload(c, n, jnp.dtype(dtype)).copy()
  _mutate(buf, _sections(c, n, dtype), ops, rng)
  _check(c, dtype, buf)


@functools.cache
def _sum_decoders(c, n: int, dtype):
  """jit of bufs[k, rows, P] -> k independent (decode_sum, decode_sum_encode), jnp and native."""

  def one(buf):
    return [
      (c.decode_sum(buf, n, dtype, impl=impl), c.decode_sum_encode(buf, n, dtype, impl=impl))
      for impl in ("jnp", "native")
    ]

  return jax.jit(jax.vmap(one))


@pytest.mark.parametrize("block", [32, 256, 4096])
def test_error_bounded_every_width_byte(block):
  """Each width byte 0..255 in a block of random words: widths 32..254 decode to NaN.

  Regression: the native decoder trusted the width byte, read past the block's words
  (block 4096: out of the buffer, a crash) and disagreed with jnp for 227 of 256 values.
  """
  c = jc.error_bounded(0.01, block_size=block)
  n = 2 * block
  rng = np.random.default_rng(block)
  p = c.payload_nbytes(n, jnp.float32)
  buf = rng.integers(0, 256, (256, p), dtype=np.uint8)
  nw = -(-(n // block) // 4) * 4
  buf[:, 0] = np.arange(256)  # block 0: every width; block 1: valid width 9
  buf[:, 1] = 9
  buf[:, 2:nw] = 0
  for dtype in DTYPES:
    d = jnp.dtype(dtype)
    dec = [c.decode_rows(jnp.asarray(buf), n, d, impl=impl) for impl in ("native", "jnp")]
    _assert_same(*dec, f"{c} {d.name} decode_rows")
  # Reductions: rows of interesting widths, each summed with a row of another width.
  sel = np.array(WIDTHS)
  pairs = np.stack([buf[sel], buf[np.roll(sel, 1)]], axis=1)
  (ref_s, ref_se), (got_s, got_se) = _sum_decoders(c, n, jnp.dtype(jnp.float32))(jnp.asarray(pairs))
  _assert_same(got_s, ref_s, f"{c} decode_sum")
  _assert_same(got_se, ref_se, f"{c} decode_sum_encode")
  dec = np.asarray(c.decode_rows(jnp.asarray(buf), n, jnp.float32, impl="native"))
  first = dec[:, :block]
  w = np.arange(256)
  assert (first[(w > 31) & (w != 255)].view(np.uint32) == 0x7FC00000).all()
  assert np.isfinite(first[:32]).all() and np.isfinite(dec[:, block:]).all()
  raw = buf[255, nw : nw + 4 * block].view(np.uint32)
  np.testing.assert_array_equal(first[255].view(np.uint32), raw)


@pytest.mark.parametrize(
  "c",
  [
    jc.int8(block_size=32, symmetric=False),
    jc.fp8("e5m2", block_size=32),
    jc.hadamard(jc.none(), size=32),
  ],
  ids=str,
)
def test_arithmetic_nans_are_canonical(c):
  """0 * Inf, Inf - Inf, NaN scales of any sign/payload: the decoded NaN is 0x7fc00000."""
  n = 64
  p = c.payload_nbytes(n, jnp.float32)
  buf = np.zeros((NROWS + 1, p), np.uint8)
  lo, hi = _sections(c, n, jnp.float32)["floats"]
  for r, pattern in enumerate([0xFFC00000, 0x7F800001, 0xFF800000, 0x7F800000]):
    buf[r, lo:hi] = np.tile(np.frombuffer(np.uint32(pattern).tobytes(), np.uint8), (hi - lo) // 4)
  if c.kind == "hadamard":
    buf[3, 4:8] = np.frombuffer(np.uint32(0xFF800000).tobytes(), np.uint8)  # inf - inf
  dec = jax.jit(lambda b: [c.decode_rows(b, n, jnp.float32, impl=i) for i in ("jnp", "native")])
  for impl, out in zip(("jnp", "native"), dec(jnp.asarray(buf))):
    bits = np.asarray(out).view(np.uint32)
    nan = np.isnan(bits.view(np.float32))
    assert nan.any(), impl
    assert (bits[nan] == 0x7FC00000).all(), (impl, sorted({hex(v) for v in bits[nan]}))


@pytest.mark.parametrize("target", ["jcoccl_decode_rows", "jcoccl_decode_sum"])
def test_handlers_reject_short_payloads(target):
  """A payload buffer shorter than the attributes imply is an error, never an over-read."""
  c = jc.error_bounded(0.01, block_size=4096)
  assert native.available(c, "decode", jnp.float32)  # loads jcoccl._cpu's handlers
  p = c.payload_nbytes(4096, jnp.float32)
  out_shape = (2, 4096) if target == "jcoccl_decode_rows" else (4096,)
  call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(out_shape, jnp.float32))
  for shape in (
    [(2, p - 4), (2, p // 2), (1, p)] if target == "jcoccl_decode_rows" else [(2, p - 4)]
  ):
    buf = jnp.zeros(shape, jnp.uint8)
    with pytest.raises(Exception, match="payload must be uint8"):
      jax.block_until_ready(call(buf, codec=native.ffi_codec(c)))
  call = jax.ffi.ffi_call("jcoccl_decode_sum_encode", jax.ShapeDtypeStruct((p,), jnp.uint8))
  with pytest.raises(Exception, match="payload must be uint8"):
    jax.block_until_ready(
      call(
        jnp.zeros((2, p - 4), jnp.uint8),
        codec=native.ffi_codec(c),
        dtype=np.int32(0),
        n=np.int64(4096),
      )
    )

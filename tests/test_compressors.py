"""Tests of the compressor library (jnp specification): error bounds, sizes, formats, API."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jcoccl import compressors as jc
from jcoccl._src.compressors import native, registry

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
ALL = [
  jc.none(),
  jc.cast(jnp.bfloat16),
  jc.cast(jnp.float16),
  jc.int8(),
  jc.int8(block_size=32, symmetric=False),
  jc.int4(),
  jc.int4(block_size=128, symmetric=False),
  jc.int2(),
  jc.int2(block_size=4096, symmetric=False),
  jc.int7(),
  jc.int6(block_size=64, symmetric=False),
  jc.int5(),
  jc.int3(block_size=32),
  jc.int3(block_size=512, symmetric=False),
  jc.int3(rounding="stochastic"),
  jc.int8(rounding="stochastic"),
  jc.int4(symmetric=False, rounding="stochastic"),
  jc.fp8(),
  jc.fp8("e5m2", block_size=64),
  jc.hadamard(jc.int4(block_size=128)),
  jc.hadamard(jc.int8(block_size=64), size=256),
  jc.spike(jc.int4(), k=4),
  jc.spike(jc.int3(block_size=64, symmetric=False), k=8),
  jc.hadamard(jc.fp8(), size=32),
  jc.hadamard(jc.none()),
  jc.hadamard(jc.cast(jnp.bfloat16), size=64),
  jc.error_bounded(1e-3),
  jc.error_bounded(0.25, block_size=32),
]
IDS = [str(c) for c in ALL]
KEY = jax.random.key(0)
N = 1000  # not a multiple of any granule: exercises padding


def _data(seed: int, n: int, scale_exp: int, n_out: int, out_mag: float) -> np.ndarray:
  """Normal data times 2**scale_exp with ``n_out`` outliers ``out_mag`` times bigger."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(n) * 2.0**scale_exp
  idx = rng.integers(0, n, n_out)
  x[idx] *= out_mag
  return x


@functools.partial(jax.jit, static_argnums=0)
def _roundtrip_and_bound(c, x):
  return c.decode(c.encode(x, key=KEY, impl="jnp"), impl="jnp"), c.error_bound(x)


def _check_bound(c, x) -> None:
  x_hat, bound = _roundtrip_and_bound(c, x)
  assert x_hat.shape == x.shape and x_hat.dtype == x.dtype
  xd = np.asarray(x, np.float64)
  err = np.abs(xd - np.asarray(x_hat, np.float64))
  bound = np.asarray(bound, np.float64)
  assert bound.shape == x.shape
  bad = ~((err <= bound) | np.isposinf(bound))  # bound inf: NaN/Inf blocks (tested apart)
  assert not bad.any(), (
    f"{c} {x.dtype}: {bad.sum()} violations, e.g. x={xd[bad][:3]} "
    f"x_hat={np.asarray(x_hat, np.float64)[bad][:3]} bound={bound[bad][:3]}"
  )


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("c", ALL, ids=IDS)
@settings(max_examples=3, deadline=None)
@given(
  seed=st.integers(0, 2**31),
  scale_exp=st.integers(-20, 12),
  n_out=st.integers(0, 8),
  out_mag=st.sampled_from([1.0, 100.0, 1000.0, -700.0]),
)
def test_roundtrip_within_error_bound(c, dtype, seed, scale_exp, n_out, out_mag):
  x = _data(seed, N, scale_exp, n_out, out_mag)
  if jnp.dtype(dtype) == jnp.float16:
    x = np.clip(x, -6e4, 6e4)
  _check_bound(c, jnp.asarray(x, dtype))


# The tests below check properties on rows of N elements, so that the round trip that
# test_roundtrip_within_error_bound compiles for each (codec, dtype) serves them all.
@pytest.mark.parametrize("c", ALL, ids=IDS)
def test_subnormal_and_tiny_inputs(c):
  # float32 subnormals (flushed to zero by XLA:CPU), tiny normals and zeros in one row.
  x = np.zeros(N, np.float32)
  x[:100] = np.float32(1e-45) * np.arange(100)
  x[100:200] = np.float32(1.2e-38) * np.linspace(-3, 3, 100)
  x[300:310] = 1e-30
  _check_bound(c, jnp.asarray(x))


@pytest.mark.parametrize("c", ALL, ids=IDS)
def test_large_finite_inputs(c):
  x = _data(1, N, 100, 4, 1000.0).astype(np.float32)
  _check_bound(c, jnp.asarray(x))


def _expected_nbytes(c, n, dtype):
  item = jnp.dtype(dtype).itemsize
  if isinstance(c, jc.Compressor) and c.kind == "none":
    return n * item
  if c.kind == "cast":
    return n * c.dtype.itemsize
  if c.kind == "int":
    return n * c.bits // 8 + (4 if c.symmetric else 8) * (n // c.block_size)
  if c.kind == "fp8":
    return n + 4 * (n // c.block_size)
  if c.kind == "hadamard":
    return _expected_nbytes(c.inner, n, jnp.float32)
  if c.kind == "error_bounded":
    return -(-(n // c.block_size) // 4) * 4 + 4 * n
  if c.kind == "spike":  # inner's bytes, a float32 value and a uint16 index per slot, 4-aligned
    slots = c.k * (n // c.granule)
    return _expected_nbytes(c.inner, n, jnp.float32) + 4 * slots + -(-2 * slots // 4) * 4
  raise AssertionError(c)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("c", ALL, ids=IDS)
def test_payload_nbytes_exact(c, dtype):
  n = 4096
  want = _expected_nbytes(c, n, dtype)
  assert c.payload_nbytes(n, dtype) == want
  # Rounded up to the granule.
  want1 = _expected_nbytes(c, -(-(n - 1) // c.granule) * c.granule, dtype)
  assert c.payload_nbytes(n - 1, dtype) == want1
  # What the encoders build has those sizes (their shapes, traced without running them).
  rows = jax.eval_shape(
    lambda z: c.encode_rows(z, key=KEY, impl="jnp"), jax.ShapeDtypeStruct((2, n), dtype)
  )
  assert (rows.shape, rows.dtype) == ((2, want), jnp.uint8)
  one = jax.eval_shape(
    lambda z: c.encode(z, key=KEY, impl="jnp"), jax.ShapeDtypeStruct((n - 1,), dtype)
  )
  assert one.nbytes == want1 and one.shape == (n - 1,)


def test_payload_ratios():
  n = 1 << 20
  assert jc.int8().payload_nbytes(n, jnp.float32) == n * (1 + 4 / 256)
  assert jc.int8().payload_nbytes(n, jnp.float32) <= 0.254 * 4 * n
  assert jc.int4().payload_nbytes(n, jnp.float32) == n * (0.5 + 4 / 256)
  assert jc.int2().payload_nbytes(n, jnp.float32) == n * (0.25 + 4 / 256)
  # Every width packs without waste: b bits per value plus the block scales (and mins).
  for b, f in ((3, jc.int3), (5, jc.int5), (6, jc.int6), (7, jc.int7)):
    assert f().payload_nbytes(n, jnp.float32) == n * b // 8 + 4 * (n // 256)
    assert f(symmetric=False).payload_nbytes(n, jnp.bfloat16) == n * b // 8 + 8 * (n // 256)
    assert str(f()) == f"int{b}" and jc.parse(f"int{b}:asym") == f(symmetric=False)
  assert jc.int4(symmetric=False).payload_nbytes(n, jnp.float32) == n * (0.5 + 8 / 256)
  assert jc.fp8().payload_nbytes(n, jnp.bfloat16) == n * (1 + 4 / 128)
  assert jc.cast(jnp.bfloat16).payload_nbytes(n, jnp.float32) == 2 * n
  assert jc.hadamard(jc.int4()).payload_nbytes(n, jnp.bfloat16) == n * (0.5 + 4 / 256)
  assert jc.error_bounded(1e-3).payload_nbytes(n, jnp.float32) == 4 * n + n // 256


@pytest.mark.parametrize("c", ALL, ids=IDS)
def test_nonfinite_never_decodes_finite(c):
  x = np.linspace(-1, 1, N).astype(np.float32)
  pos = [0, 260, 530, 800, 999]  # NaN, +Inf, -Inf: in different blocks of 256
  x[pos] = [np.nan, np.inf, -np.inf, np.nan, np.inf]
  for dtype in DTYPES:
    xd = jnp.asarray(x, dtype)
    x_hat, b = _roundtrip_and_bound(c, xd)
    x_hat = np.asarray(x_hat, np.float32)
    assert not np.isfinite(x_hat[pos]).any(), f"{c} {dtype}: {x_hat[pos]}"
    if c.lossless or c.kind in ("cast", "error_bounded"):
      np.testing.assert_array_equal(x_hat[pos], np.asarray(xd, np.float32)[pos])
    assert np.isinf(np.asarray(b)[pos]).all() or c.lossless


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_error_bounded_passthrough_exact(dtype):
  c = jc.error_bounded(1e-3, block_size=64)
  fmax = float(jnp.finfo(dtype).max)
  x = np.linspace(-1, 1, 1024).astype(np.float32)
  x[[3, 70, 200, 201, 500]] = [np.nan, np.inf, -np.inf, fmax, -fmax / 3]
  x[600] = 1e9 if dtype != jnp.float16 else 6e4
  xd = jnp.asarray(x, dtype)
  x_hat = c.decode(c.encode(xd, impl="jnp"), impl="jnp")
  special = [3, 70, 200, 201, 500, 600]
  np.testing.assert_array_equal(
    np.asarray(x_hat)[special].view(np.uint8), np.asarray(xd)[special].view(np.uint8)
  )
  _check_bound(c, xd)
  # Blocks with a NaN/huge value go raw; the others quantize: ratio > 1 but < 4 bytes/elt.
  ratio = c.achieved_ratio(c.encode(jnp.zeros(4096, jnp.float32), impl="jnp"))
  assert ratio > 30
  assert c.achieved_ratio(c.encode(xd, impl="jnp")) < c.achieved_ratio(
    c.encode(jnp.asarray(np.linspace(-1, 1, 1024), dtype), impl="jnp")
  )


@pytest.mark.parametrize("c", ALL, ids=IDS)
def test_parse_str_roundtrip(c):
  assert jc.parse(str(c)) == c
  assert c.name == str(c)
  assert hash(jc.parse(str(c))) == hash(c)


@pytest.mark.parametrize(
  "spec,want",
  [
    ("none", jc.none()),
    ("bf16", jc.cast(jnp.bfloat16)),
    ("FP16", jc.cast(jnp.float16)),
    ("int8", jc.int8()),
    ("int4:block=128,asym", jc.int4(block_size=128, symmetric=False)),
    ("int8:stochastic", jc.int8(rounding="stochastic")),
    ("fp8:e5m2,block=64", jc.fp8("e5m2", 64)),
    ("hadamard(int4:block=128)", jc.hadamard(jc.int4(block_size=128))),
    ("hadamard(int4):size=64", jc.hadamard(jc.int4(), size=64)),
    ("eb:abs=1e-3,block=256", jc.error_bounded(1e-3)),
    (" int2 : block = 64 ", jc.int2(64)),
  ],
)
def test_parse_examples(spec, want):
  assert jc.parse(spec) == want


@pytest.mark.parametrize(
  "spec,match",
  [
    ("int16", "'int16'.*int8"),
    ("hadamrd(int4)", r"unknown compressor 'hadamrd' \(did you mean 'hadamard'\?\)"),
    ("int9", r"unknown compressor 'int9' \(did you mean 'int8'\?\)"),
    ("int8:blk=3", "'blk=3'.*block=INT"),
    ("fp8:e3m4", "'e3m4'.*e4m3"),
    ("int8:block=100", "block_size.*power of two"),
    ("eb", "abs=FLOAT"),
    ("eb:abs=-1", "abs_error"),
    ("hadamard(int8", "balanced"),
    ("hadamard(int8):size=3", "size.*power of two"),
    ("hadamard(int8):sz=4", "size=INT"),
    ("bf16:x", "'x'"),
  ],
)
def test_parse_errors(spec, match):
  with pytest.raises(ValueError, match=match):
    jc.parse(spec)


def test_registered_family_is_parsed_printed_and_kept_off_native_kernels(monkeypatch):
  """A family is one class plus one register call: the grammar and the native glue follow."""
  for table in ("_FAMILIES", "_NAMES", "_CLASSES"):
    monkeypatch.setattr(registry, table, dict(getattr(registry, table)))

  @dataclasses.dataclass(frozen=True)
  class Int8Wide(jc.IntCompressor):
    kind: ClassVar[str] = "int8_wide"

  def build(**kw):
    return Int8Wide(bits=8, **{"block_size": 1024, **kw})

  jc.register(
    {"i8w": build},
    Int8Wide,
    keys={"block": "block_size"},
    printer=lambda c: "i8w" + ("" if c.block_size == 1024 else f":block={c.block_size}"),
    native=lambda c: {"bits": 8, "block": c.block_size},
  )
  c = jc.parse(" I8W : block=64 ")
  assert c == build(block_size=64) and str(c) == "i8w:block=64" and jc.parse(str(c)) == c
  assert str(jc.parse("hadamard(i8w)")) == "hadamard(i8w)"
  # The C++ table has no such kind: no native kernel, the jnp specification runs.
  assert not native._supported(c) and not native.available(c, "encode", jnp.float32)
  x = jnp.linspace(-1, 1, 1024)
  assert bool(jnp.all(jnp.abs(c.decode(c.encode(x)) - x) <= c.error_bound(x)))
  with pytest.raises(ValueError, match="'i8w:blk=3'.*block=INT"):
    jc.parse("i8w:blk=3")
  with pytest.raises(ValueError, match="'int9'.*i8w"):
    jc.parse("int9")
  # Taking over a built-in name warns, and the name then builds the new class.
  with pytest.warns(UserWarning, match="'int8' built IntCompressor; it now builds .*Int8Wide"):
    jc.register({"int8": build}, Int8Wide, keys={"block": "block_size"})
  assert isinstance(jc.parse("int8"), Int8Wide)


def test_hashable_static_jit_arg():
  @functools.partial(jax.jit, static_argnums=0)
  def roundtrip(c, x):
    return c.decode(c.encode(x, impl="jnp"), impl="jnp")

  x = jnp.linspace(-1, 1, 512)
  for c in [jc.int8(), jc.fp8(), jc.hadamard(jc.int4(block_size=128)), jc.error_bounded(0.25, 32)]:
    assert hash(c) == hash(jc.parse(str(c)))
    np.testing.assert_array_equal(roundtrip(c, x), c.decode(c.encode(x, impl="jnp"), impl="jnp"))
  assert len({jc.int8(), jc.int8(), jc.int8(block_size=128)}) == 2


def test_eager_calls_compile_once_per_shape_and_match_jit():
  """Called outside a trace, a codec method is one compiled program per (codec, shape,
  dtype): a second call of the same shape compiles nothing; under jit it runs inline."""
  from jcoccl._src.compressors import eager

  c = jc.spike(jc.int4(block_size=64), k=3)
  x = jnp.asarray(_data(3, 777, 0, 5, 100.0), jnp.float32)
  p = c.encode(x, impl="jnp")
  before = eager._program._cache_size()
  for _ in range(2):
    again = c.encode(x, impl="jnp")
    np.testing.assert_array_equal(again.data, p.data)
  assert eager._program._cache_size() == before
  c.encode(x[:500], impl="jnp")
  assert eager._program._cache_size() == before + 1  # a new shape: one program more
  jitted = jax.jit(lambda v: c.decode(c.encode(v, impl="jnp"), impl="jnp"))(x)
  assert eager._program._cache_size() == before + 1
  np.testing.assert_array_equal(jitted, c.decode(p, impl="jnp"))
  with pytest.raises(TypeError, match="payload must be a jcoccl Payload.*ArrayImpl"):
    c.decode(x)


@functools.partial(jax.jit, static_argnums=0)
def _row_api(c, x2d):
  """Every row op on x2d (bfloat16 rows) and the single-array API on each row, as one
  program: the test compares results that separate calls would give."""
  n, bf16 = x2d.shape[1], jnp.bfloat16
  buf = c.encode_rows(x2d, impl="jnp")
  payloads = [c.encode(x2d[i], impl="jnp") for i in range(x2d.shape[0])]
  rows = c.decode_rows(buf, n, bf16, impl="jnp")
  singles = [c.decode(p, impl="jnp") for p in payloads]
  if c.kind == "none":  # the payload is in the row's dtype; its float32 decode is exact
    wide = rows.astype(jnp.float32)
  else:  # payloads of the other codecs do not depend on the dtype
    wide = jnp.stack(
      [c.decode_rows(buf[i : i + 1], n, jnp.float32, impl="jnp")[0] for i in range(3)]
    )
  total = c.decode_sum(buf, n, bf16, impl="jnp")
  dse = c.decode_sum_encode(buf, n, bf16, impl="jnp")
  return (
    buf,
    [p.data for p in payloads],
    rows,
    singles,
    wide,
    total,
    dse,
    c.encode_rows(total[None], impl="jnp")[0],
  )


@pytest.mark.parametrize("c", ALL, ids=IDS)
def test_row_api_matches_encode_decode(c):
  g = c.granule
  rows = np.random.default_rng(2).standard_normal((3, 2 * g if g > 1 else 64)).astype(np.float32)
  if c.stochastic:
    return  # a row's noise depends on the row index; covered by the stochastic tests
  buf, datas, dec, singles, wide, got, dse, re_encoded = _row_api(
    c, jnp.asarray(rows, jnp.bfloat16)
  )
  for i in range(3):
    np.testing.assert_array_equal(buf[i], datas[i])
    np.testing.assert_array_equal(dec[i], singles[i])
  # decode_sum: float32 left fold of the float32 decodes in row order, cast once.
  wide = np.asarray(wide)
  acc = wide[0]
  for w in wide[1:]:
    acc = (acc + w).astype(np.float32)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.asarray(acc).astype(jnp.bfloat16)))
  np.testing.assert_array_equal(dse, re_encoded)


def test_decode_f32_of_bf16_payload_is_exact_decode():
  # decode_rows to float32 of a bf16-encoded payload is used above as "the float32 decode".
  c = jc.int8()
  x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 256)), jnp.bfloat16)
  buf = c.encode_rows(x, impl="jnp")
  assert buf.shape[1] == c.payload_nbytes(256, jnp.float32) == c.payload_nbytes(256, jnp.bfloat16)


def _np_int8_sym(x: np.ndarray, block: int) -> np.ndarray:
  """Independent numpy reading of WIRE_FORMAT.md's symmetric int8 (finite blocks)."""
  xb = x.reshape(-1, block).astype(np.float32)
  s = (np.abs(xb).max(-1, keepdims=True) * np.float32(1 / 127)).astype(np.float32)
  with np.errstate(invalid="ignore", divide="ignore"):
    q = np.where(s > 0, np.clip(np.rint(xb / s), -127, 127), 0)
  codes = (q + 128).astype(np.uint8).reshape(-1)
  return np.concatenate([codes, s.reshape(-1).astype("<f4").view(np.uint8)])


@pytest.mark.optimized  # an independent reading, against the spec as users compile it
def test_int8_matches_numpy_reading_of_wire_format():
  x = (np.random.default_rng(4).standard_normal(2048) * 3).astype(np.float32)
  x[5] = 0.5 * float(np.abs(x[:256]).max()) / 127 * 127  # a tie candidate
  np.testing.assert_array_equal(
    np.asarray(jc.int8().encode_rows(x[None], impl="jnp")[0]), _np_int8_sym(x, 256)
  )


def test_nonfinite_block_layout():
  x = np.ones(512, np.float32)
  x[7] = np.nan
  buf = np.asarray(jc.int8().encode_rows(x[None], impl="jnp")[0])
  assert (buf[:256] == 128).all() and (buf[256:512] != 128).any()
  assert buf[512:516].view("<u4")[0] == 0x7FC00000 and buf[516:520].view("<f4")[
    0
  ] == 1 / 127 * np.float32(1)


@pytest.mark.parametrize(
  "c",
  [
    jc.int8(rounding="stochastic"),
    jc.int2(rounding="stochastic"),
    jc.int4(symmetric=False, rounding="stochastic"),
    jc.hadamard(jc.int4(rounding="stochastic")),
  ],
  ids=str,
)
def test_stochastic_rounding(c):
  x = jnp.asarray(np.random.default_rng(5).standard_normal(1024), jnp.float32)
  k1, k2 = jax.random.key(1), jax.random.key(2)
  e1 = c.encode(x, key=k1)
  np.testing.assert_array_equal(e1.data, c.encode(x, key=k1).data)
  assert (e1.data != c.encode(x, key=k2).data).any()
  # One program (an eager vmap would compile each of the codec's ops on its own), x an
  # argument as in the eager calls above (XLA folds constants without flushing subnormals).
  draws = jax.jit(jax.vmap(lambda k, v: c.decode(c.encode(v, key=k)), in_axes=(0, None)))(
    jax.random.split(k1, 400), x
  )
  bound = np.asarray(c.error_bound(x))
  err = np.abs(np.asarray(draws, np.float64) - np.asarray(x, np.float64))
  assert (err <= bound).all()
  # Unbiased: the mean over 400 draws is within 5 standard errors (step/sqrt(12*400)).
  mean_err = np.abs(np.asarray(draws, np.float64).mean(0) - np.asarray(x, np.float64))
  assert (mean_err <= 5 * bound / math.sqrt(400) + 1e-6).mean() > 0.99
  with pytest.raises(ValueError, match="key"):
    c.encode(x)


def test_vmap_and_jit_row_api():
  c = jc.int4(block_size=64)
  x = jnp.asarray(np.random.default_rng(6).standard_normal((5, 2, 128)), jnp.float32)
  enc = jax.jit(jax.vmap(lambda r: c.encode_rows(r, impl="jnp")))(x)
  ref = jnp.stack([c.encode_rows(x[i], impl="jnp") for i in range(5)])
  np.testing.assert_array_equal(enc, ref)
  dec = jax.jit(jax.vmap(lambda b: c.decode_sum(b, 128, jnp.float32, impl="jnp")))(enc)
  np.testing.assert_array_equal(dec[3], c.decode_sum(enc[3], 128, jnp.float32, impl="jnp"))


@pytest.mark.parametrize(
  "c",
  [
    jc.int8(),
    jc.hadamard(jc.int4(block_size=128)),
    jc.error_bounded(1e-2, 64),
    jc.fp8("e5m2", 64),
    jc.int8(rounding="stochastic"),
  ],
  ids=str,
)
def test_shard_map_check_vma(c):
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("x",))
  x = jnp.asarray(np.random.default_rng(7).standard_normal((4, 2 * c.granule)), jnp.float32)

  def f(v, key):
    buf = c.encode_rows(v, key=jax.random.fold_in(key, jax.lax.axis_index("x")), impl="jnp")
    allbuf = jax.lax.all_gather(buf[0], "x")
    n = v.shape[1]
    return c.decode_rows(buf, n, v.dtype, impl="jnp"), c.decode_sum(allbuf, n, v.dtype, impl="jnp")[
      None
    ]

  dec, sums = jax.jit(
    jax.shard_map(
      f,
      mesh=mesh,
      in_specs=(jax.P("x"), jax.P()),
      out_specs=(jax.P("x"), jax.P("x")),
      check_vma=True,
    )
  )(x, KEY)
  assert dec.shape == x.shape
  np.testing.assert_allclose(np.asarray(sums[0]), np.asarray(dec).sum(0), rtol=1e-5, atol=1e-5)
  _ = sums


def test_bad_inputs():
  with pytest.raises(TypeError, match="int32.*float32"):
    jc.int8().encode(jnp.arange(256))
  with pytest.raises(TypeError, match="bool"):
    jc.fp8().encode_rows(jnp.zeros((1, 128), bool))
  np.testing.assert_array_equal(jc.none().decode(jc.none().encode(jnp.arange(7))), jnp.arange(7))
  with pytest.raises(ValueError, match="block_size.*power of two"):
    jc.int8(block_size=100)
  with pytest.raises(ValueError, match="block_size"):
    jc.int4(block_size=8192)
  with pytest.raises(ValueError, match="rounding.*nearest"):
    jc.int8(rounding="up")
  with pytest.raises(ValueError, match="fmt.*e4m3"):
    jc.fp8("e3m4")
  with pytest.raises(ValueError, match="abs_error"):
    jc.error_bounded(0.0)
  with pytest.raises(ValueError, match="abs_error"):
    jc.error_bounded(float("nan"))
  with pytest.raises(ValueError, match="size.*power of two"):
    jc.hadamard(jc.int8(), size=48)
  with pytest.raises(TypeError, match="inner"):
    jc.hadamard("int8")
  with pytest.raises(ValueError, match="dtype.*bfloat16, float16"):
    jc.cast(jnp.int8)
  with pytest.raises(ValueError, match="bits"):
    jc.IntCompressor(bits=9)
  with pytest.raises(ValueError, match="granule 256"):
    jc.int8().encode_rows(jnp.zeros((2, 300)))
  with pytest.raises(ValueError, match="granule"):
    jc.int8().decode_rows(jnp.zeros((2, 300), jnp.uint8), 300, jnp.float32)
  with pytest.raises(ValueError, match="buf must be uint8"):
    jc.int8().decode_rows(jnp.zeros((2, 100), jnp.uint8), 256, jnp.float32)
  with pytest.raises(ValueError, match="impl must be one of"):
    jc.int8().encode_rows(jnp.zeros((1, 256)), impl="cuda")
  with pytest.raises(TypeError, match="Payload"):
    jc.int8().decode(jnp.zeros(260, jnp.uint8))


def test_native_impl_unavailable_is_a_clear_error():
  c = jc.int8(rounding="stochastic")  # stochastic encode always runs jnp
  c.encode_rows(jnp.zeros((1, 256)), key=KEY, impl="native")
  if not native.available(jc.hadamard(jc.int8()), "decode", jnp.dtype(jnp.float16)):
    with pytest.raises(ValueError, match="impl='native'.*'jnp'"):
      jc.hadamard(jc.int8()).decode_rows(
        jnp.zeros((1, 260), jnp.uint8), 256, jnp.float16, impl="native"
      )


# ---- hadamard near float32's maximum ------------------------------------------------------
NEAR_MAX = [
  jc.hadamard(jc.int8(block_size=64), size=64),
  jc.hadamard(jc.int4(block_size=128)),
  jc.hadamard(jc.int8(block_size=256, symmetric=False), size=32),
  jc.hadamard(jc.fp8("e4m3", block_size=32), size=4096),
  jc.hadamard(jc.none(), size=256),
  jc.hadamard(jc.error_bounded(1e-2, block_size=64), size=64),
]


@functools.partial(jax.jit, static_argnums=(0, 2))
def _roundtrip_impl(c, x, impl):
  return c.decode(c.encode(x, impl=impl), impl=impl)


@pytest.mark.parametrize("c", NEAR_MAX, ids=str)
@pytest.mark.parametrize("v", [3e37, 3e38, -3e38], ids=str)
def test_hadamard_one_value_near_max(c, v):
  """A single finite value near float32's maximum decodes finite and within a finite bound.

  Regression: the rotation's butterflies ran unnormalised, so the inverse's intermediate sums
  reached sqrt(H) |x| and overflowed (3e37 decoded to +inf with a bound of ~1e35).
  """
  n = 2 * c.granule
  x = _data(7, n, -2, 0, 1.0).astype(np.float32)
  x[c.granule // 2 + 3] = v
  xd = jnp.asarray(x)
  bound = np.asarray(c.error_bound(xd), np.float64)
  assert np.isfinite(bound).all(), bound[~np.isfinite(bound)][:3]
  for impl in ("jnp", "native"):
    if impl == "native" and not native.available(c, "decode", jnp.float32):
      continue
    x_hat = np.asarray(_roundtrip_impl(c, xd, impl), np.float64)
    assert np.isfinite(x_hat).all(), (impl, np.flatnonzero(~np.isfinite(x_hat))[:5])
    err = np.abs(x_hat - x.astype(np.float64))
    assert (err <= bound).all(), (impl, err[err > bound][:3], bound[err > bound][:3])


@pytest.mark.parametrize(
  "c",
  [
    jc.hadamard(jc.int8(block_size=64), size=64),
    jc.hadamard(jc.fp8("e5m2", block_size=128), size=128),
    jc.hadamard(jc.int4(block_size=32), size=32),
  ],
  ids=str,
)
@settings(max_examples=12, deadline=None, derandomize=True, database=None)
@given(
  seed=st.integers(0, 2**31),
  exp=st.integers(-30, 38),
  spikes=st.integers(0, 3),
  spike=st.floats(1e30, float(np.finfo(np.float32).max)),
  mant=st.floats(0.1, 3.4),
)
def test_hadamard_bound_holds_up_to_float32_max(c, seed, exp, spikes, spike, mant):
  """|decode(encode(x)) - x| <= error_bound(x) for magnitudes up to float32's maximum.

  The bound may be inf only where the docstring says (block L2 norm within 2**-10 of
  float32's maximum, or |x_i| + bound_i within 2**-20 of it); for an int8/fp8 inner codec it
  is finite whenever every block's L2 norm is at most F32_MAX / 8.
  """
  rng = np.random.default_rng(seed)
  n = 2 * c.granule
  x = rng.standard_normal(n) * mant * 10.0**exp
  idx = rng.integers(0, n, spikes)
  x[idx] = spike * rng.choice([-1.0, 1.0], spikes)
  x = np.clip(x, -B_F32_MAX, B_F32_MAX).astype(np.float32)
  xd = jnp.asarray(x)
  x_hat = np.asarray(_roundtrip_impl(c, xd, "jnp"), np.float64)
  bound = np.asarray(c.error_bound(xd), np.float64)
  err = np.abs(x_hat - x.astype(np.float64))
  ok = np.isposinf(bound) | (err <= bound)
  assert ok.all(), (x[~ok][:3], x_hat[~ok][:3], bound[~ok][:3])
  norms = np.sqrt((x.astype(np.float64).reshape(-1, c.size) ** 2).sum(-1))
  small = np.repeat(norms <= B_F32_MAX / 8, c.size)
  if c.inner.kind in ("int", "fp8") and getattr(c.inner, "bits", 8) == 8:
    assert np.isfinite(bound[small]).all()


B_F32_MAX = float(np.finfo(np.float32).max)


@pytest.mark.parametrize(
  "c", [jc.hadamard(jc.int8(block_size=64), size=64), jc.hadamard(jc.int4(block_size=64))], ids=str
)
def test_hadamard_all_reduce_with_one_value_near_max(c):
  """all_reduce (one_shot, two_shot) with one 3e38 input keeps every sum finite and in bound.

  Regression: one_shot turned the block's sums non-finite, two_shot every sum of the
  re-encoded chunk.
  """
  from collectives_util import assert_within, eb, f64, mesh, per_rank, sum_bound

  import jcoccl

  m = mesh((8,), ("x",))
  x = np.array(jax.random.normal(jax.random.key(11), (8, 1024), jnp.float32))
  x[3, 300] = 3e38
  x = jnp.asarray(x)
  run = lambda alg: per_rank(
    m, lambda v: jcoccl.all_reduce(v, "x", compressor=c, algorithm=alg, min_bytes=0), x
  )
  one, two = run("one_shot"), run("two_shot")
  assert np.isfinite(np.asarray(one)).all() and np.isfinite(np.asarray(two)).all()
  bound = sum_bound(c, x, jnp.float32)
  assert np.isfinite(bound).all()
  assert_within(one[0], f64(x).sum(0), bound, "one_shot")
  # two_shot's first stage decodes the blocks one_shot decodes, in the same order; its second
  # quantization re-encodes one_shot's result.
  second = eb(c, one[0])
  assert np.isfinite(second).all()
  assert_within(two[0], f64(one[0]), second, "two_shot second quantization")
  assert_within(two[0], f64(x).sum(0), bound + second, "two_shot")


@pytest.mark.parametrize("n", [1, 17, 32, 33, 100, 255, 256, 1000])
def test_fit_sends_fewer_bytes_with_the_same_codes(n):
  """A codec fitted to a short message (Compressor.fit) decodes it to the bits of the
  zero-padded long block, NaN and Inf included; codecs whose codes the padding changes
  (asymmetric, stochastic, hadamard) and messages of a block or more keep the codec."""
  rng = np.random.default_rng(n)
  x = rng.standard_normal(n).astype(np.float32) * np.float32(10.0 ** rng.integers(-30, 30))
  if n > 40:
    x[[3, 11]] = [np.nan, -np.inf]
  for c in [jc.int8(), jc.int4(), jc.int3(block_size=512), jc.int2(), jc.fp8(), jc.fp8("e5m2")]:
    small, block = c.fit(n), max(32, 1 << (n - 1).bit_length())
    if block >= c.granule:
      assert small == c
      continue
    assert small.granule == block
    assert small.payload_nbytes(n, jnp.float32) < c.payload_nbytes(n, jnp.float32)
    got, want = small.decode(small.encode(x)), c.decode(c.encode(x))
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32))
  for c in [jc.int8(symmetric=False), jc.int4(rounding="stochastic"), jc.hadamard(jc.int4())]:
    assert c.fit(n) is c

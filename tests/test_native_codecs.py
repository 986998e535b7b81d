"""Native (C++/CUDA) codecs are bit-identical to the jnp specification (cuda/WIRE_FORMAT.md)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jcoccl import compressors as jc
from jcoccl._src.compressors import native
from jcoccl._src.native import _ffi

if _ffi.native_module("cpu") is None:
  pytest.skip(
    f"native module jcoccl._cpu is absent ({_ffi.native_import_error('cpu')})",
    allow_module_level=True,
  )

# Compiled as users do (tests/conftest.py): at its default level XLA:CPU contracts a*b + c
# into an FMA, which would move a jnp product that the spec left unguarded off the kernels'
# bits. The narrow dtypes add only exact conversions to that float32 arithmetic, so they
# compile at the suite's level (no FMA, half the compile time).
pytestmark = pytest.mark.optimized

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _level(dtype) -> tuple:
  """The marks of a case in ``dtype``: the narrow dtypes compile at the suite's level."""
  return () if dtype is jnp.float32 else (pytest.mark.unoptimized,)


CODECS = [
  jc.none(),
  jc.cast(jnp.bfloat16),
  jc.cast(jnp.float16),
  jc.int8(block_size=32),
  jc.int8(block_size=256),
  jc.int8(block_size=64, symmetric=False),
  jc.int4(block_size=32),
  jc.int4(block_size=128, symmetric=False),
  jc.int4(block_size=1024),
  jc.int2(block_size=64),
  jc.int2(block_size=32, symmetric=False),
  jc.int2(block_size=4096, symmetric=False),
  jc.int3(block_size=32),
  jc.int3(block_size=512, symmetric=False),
  jc.int5(),
  jc.int6(block_size=64, symmetric=False),
  jc.int7(),
  jc.fp8("e4m3", block_size=32),
  jc.fp8("e4m3", block_size=256),
  jc.fp8("e5m2", block_size=64),
  jc.hadamard(jc.int4(block_size=64), size=128),
  jc.hadamard(jc.int8(block_size=256), size=64),
  jc.hadamard(jc.fp8("e4m3", block_size=128), size=256),
  jc.hadamard(jc.int8(block_size=32, symmetric=False), size=32),
  jc.hadamard(jc.fp8("e4m3"), size=32),
  jc.hadamard(jc.none()),
  jc.hadamard(jc.cast(jnp.bfloat16), size=64),
  jc.error_bounded(1e-2, block_size=64),
  jc.error_bounded(1e-4, block_size=256),
  jc.error_bounded(0.5, block_size=32),
  jc.spike(jc.int4(block_size=32), k=1),
  jc.spike(jc.int3(block_size=64, symmetric=False), k=5),
  jc.spike(jc.int8(block_size=256), k=4),
  jc.spike(jc.int6(block_size=128), k=2),
  jc.spike(jc.int2(block_size=32, symmetric=False), k=8),
  jc.spike(jc.fp8("e4m3", block_size=64), k=3),
  jc.spike(jc.fp8("e5m2", block_size=512), k=16),
  jc.spike(jc.error_bounded(1e-2, block_size=32), k=31),
]


def _bits(a) -> np.ndarray:
  a = np.asarray(a)
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _assert_same(a, b, what: str) -> None:
  a, b = np.asarray(a), np.asarray(b)
  assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape, a.dtype, b.dtype)
  ba, bb = _bits(a), _bits(b)
  bad = np.argwhere(ba != bb)
  assert bad.size == 0, (
    f"{what}: {len(bad)} mismatches, first at {bad[:3].tolist()}: "
    f"{ba[tuple(bad[0])]:#x} vs {bb[tuple(bad[0])]:#x}"
  )


def _data(rows: int, n: int, dtype, seed: int) -> np.ndarray:
  """Random rows with outliers, zero/constant/subnormal/NaN/Inf/-0 blocks (32-element runs)."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((rows, n)).astype(np.float32) * np.float32(3.0)
  x[rng.random((rows, n)) < 0.01] *= np.float32(1e4)
  runs = x.reshape(rows, n // 32, 32)
  k = runs.shape[1]
  for r in range(rows):
    kind = rng.integers(0, 8, size=k)
    runs[r, kind == 0] = 0.0
    runs[r, kind == 1] = np.float32(rng.standard_normal())
    runs[r, kind == 2] *= np.float32(1e-39)
    if r % 3 == 0:
      sel = np.flatnonzero(kind == 3)[:1]
      runs[r, sel, 5] = np.nan
      sel = np.flatnonzero(kind == 4)[:2]
      runs[r, sel[:1], 7] = -np.inf
      runs[r, sel[1:], 9] = np.inf
    runs[r, kind == 5] = -0.0
    runs[r, kind == 6] *= np.float32(1e-3)
  return np.asarray(jnp.asarray(x).astype(dtype))


def _row_len(c) -> int:
  return max(c.granule, 256) * 2


@functools.partial(jax.jit, static_argnums=(0, 2, 3, 4))
def _both(c, x, n, dtype, nrows_list):
  """(jnp outputs, native outputs) of every row op on x, for each reduction row count."""
  out = []
  for impl in ("jnp", "native"):
    buf = c.encode_rows(x, impl=impl)
    dec = c.decode_rows(buf, n, dtype, impl=impl)
    ref_buf = out[0][0] if out else buf  # reductions read the same (spec) payload
    red = [
      (
        c.decode_sum(ref_buf[:k], n, dtype, impl=impl),
        c.decode_sum_encode(ref_buf[:k], n, dtype, impl=impl),
      )
      for k in nrows_list
    ]
    out.append((buf, dec, red))
  return out


def _bit_exact_cases() -> list:
  """Every codec in float32 and one narrow dtype, bfloat16 and float16 in turn along the list
  (both for none and cast, whose payload is that dtype): each family meets both. The narrow
  dtypes add an input conversion shared by every family to the float32 arithmetic;
  test_codec_fuzz.py checks every family's decoders in every dtype against the spec."""
  cases = []
  for i, c in enumerate(CODECS):
    narrow = DTYPES[1:] if c.kind in ("none", "cast") else [DTYPES[1 + i % 2]]
    cases += [(c, d) for d in (DTYPES[0], *narrow)]
  return [pytest.param(c, d, marks=_level(d)) for c, d in cases]


@pytest.mark.parametrize(
  "c,dtype",
  _bit_exact_cases(),
  ids=lambda v: jnp.dtype(v).name if not hasattr(v, "kind") else str(v),
)
def test_bit_exact(c, dtype):
  n = _row_len(c)
  for op in ("encode", "decode", "decode_sum", "decode_sum_encode"):
    assert native.available(c, op, dtype)
  x = jnp.asarray(_data(8, n, dtype, seed=n + len(str(c))))
  # Reductions of 8 rows in float32 and of 1..5 (by codec) in the narrow dtype: each codec
  # sums both counts; the rows add in float32 whatever the dtype, and 8 rows give the fold
  # the adds that an FMA could contract at the float32 cases' level. (A second count in one
  # program cost a quarter of the float32 compile.)
  few = 1 + len(str(c)) % 5
  nrows_list = (8,) if dtype is jnp.float32 else (few,)
  (rb, rd, rred), (gb, gd, gred) = _both(c, x, n, jnp.dtype(dtype), nrows_list)
  for nrows, (rs, rse), (gs, gse) in zip(nrows_list, rred, gred):
    ref, got = (rb, rd, rs, rse), (gb, gd, gs, gse)
    for what, a, b in zip(("encode", "decode", "decode_sum", "decode_sum_encode"), ref, got):
      _assert_same(b, a, f"{c} {jnp.dtype(dtype).name} nrows={nrows} {what}")


@pytest.mark.parametrize(
  "c",
  [
    jc.int4(block_size=128),
    jc.int8(symmetric=False),
    jc.fp8("e4m3", block_size=256),
    jc.cast(jnp.bfloat16),
    jc.hadamard(jc.int4(block_size=256)),
    jc.error_bounded(1e-2),
    jc.spike(jc.int4(block_size=256), k=4),
  ],
  ids=str,
)
@pytest.mark.parametrize("dtype", (DTYPES[0], DTYPES[2]), ids=lambda d: jnp.dtype(d).name)
@pytest.mark.unoptimized  # checks the kernels' tiling; FMA hazards: test_bit_exact
def test_rows_with_a_partial_last_tile(c, dtype):
  # The CPU kernels work in tiles of 4096 elements: a row of 3 tiles and 768 more elements
  # exercises the short last tile of every op (it once wrote past the end of the row).
  n = 3 * 4096 + 768
  x = jnp.asarray(_data(3, n, dtype, seed=11))
  (rb, rd, rred), (gb, gd, gred) = _both(c, x, n, jnp.dtype(dtype), (3,))
  for what, a, b in zip(
    ("encode", "decode", "decode_sum", "decode_sum_encode"), (rb, rd, *rred[0]), (gb, gd, *gred[0])
  ):
    _assert_same(b, a, f"{c} {jnp.dtype(dtype).name} n={n} {what}")


@pytest.mark.parametrize("c", [jc.int8(block_size=256), jc.int4(block_size=128)], ids=str)
@pytest.mark.unoptimized  # checks the kernels' result buffers; FMA hazards: test_bit_exact
def test_large_results(c):
  # Results of several MiB get a huge-page hint (madvise) before the kernels write them; the
  # rows end off a 2 MiB boundary, so the hinted range is strictly inside the buffer.
  n = (1 << 20) + 3 * 256
  x = jnp.asarray(_data(3, n, jnp.float32, seed=5))
  (rb, rd, rred), (gb, gd, gred) = _both(c, x, n, jnp.dtype(jnp.float32), (3,))
  for what, a, b in zip(
    ("encode", "decode", "decode_sum", "decode_sum_encode"), (rb, rd, *rred[0]), (gb, gd, *gred[0])
  ):
    _assert_same(b, a, f"{c} n={n} {what}")


@pytest.mark.parametrize(
  "c",
  [
    jc.int4(block_size=64, symmetric=False),
    jc.hadamard(jc.fp8("e5m2", block_size=32), size=64),
    jc.error_bounded(1e-3, block_size=32),
    jc.cast(jnp.float16),
  ],
  ids=str,
)
@pytest.mark.unoptimized  # checks the batching of the kernels; FMA hazards: test_bit_exact
def test_vmap(c):
  n = _row_len(c)
  x = jnp.asarray(_data(6, n, jnp.float32, seed=7)).reshape(2, 3, n)
  ops = {
    "encode": lambda v, i: c.encode_rows(v, impl=i),
    "decode": lambda b, i: c.decode_rows(b, n, jnp.bfloat16, impl=i),
    "decode_sum": lambda b, i: c.decode_sum(b, n, jnp.float32, impl=i),
    "decode_sum_encode": lambda b, i: c.decode_sum_encode(b, n, jnp.float16, impl=i),
  }
  # The reference is the vmapped spec; it must equal the per-slice spec.
  ref = jax.jit(jax.vmap(lambda v: ops["encode"](v, "jnp")))(x)
  per_slice = jax.jit(lambda v: ops["encode"](v, "jnp"))
  _assert_same(ref, jnp.stack([per_slice(v) for v in x]), f"vmap spec encode {c}")
  for name, op in ops.items():
    arg = x if name == "encode" else ref
    want = ref if name == "encode" else jax.jit(jax.vmap(lambda a: op(a, "jnp")))(arg)
    _assert_same(jax.vmap(lambda a: op(a, "native"))(arg), want, f"vmap {name} {c}")
    if name == "decode_sum":
      _assert_same(jax.jit(jax.vmap(lambda a: op(a, "native")))(arg), want, f"jit vmap {name} {c}")


def test_asym_zero_extremes_are_plus_zero():
  """Blocks whose min/max is a zero (or, under XLA:CPU's DAZ, a subnormal) store +0."""
  c = jc.int4(block_size=32, symmetric=False)
  tiny = np.float32(1e-39)
  blocks = [
    [0.0, -0.0],
    [-0.0, 0.0],
    [0.0, -tiny],
    [-tiny, 0.0, tiny],
    [-0.0, -tiny],
    [tiny, -0.0],
    [-0.0],
    [0.0, 1.0, -0.0],
    [-1.0, -0.0, -tiny],
  ]
  rng = np.random.default_rng(0)
  x = np.stack([rng.permutation(np.resize(np.float32(b), 32)) for b in blocks]).reshape(1, -1)
  n = x.shape[1]
  nb = n // 32
  start = n * 4 // 8 + 4 * nb
  outs = {
    "jit": jax.jit(lambda v: c.encode_rows(v, impl="jnp"))(x),
    "eager": c.encode_rows(jnp.asarray(x), impl="jnp"),
    "vmap": jax.vmap(lambda v: c.encode_rows(v, impl="jnp"))(x[None])[0],
    "transposed": jax.jit(lambda v: c.encode_rows(v.T.T * 1, impl="jnp"))(jnp.asarray(x)),
    "native": c.encode_rows(jnp.asarray(x), impl="native"),
  }
  for name, buf in outs.items():
    mins = np.asarray(buf)[0, start : start + 4 * nb].view(np.float32)
    scales = np.asarray(buf)[0, start - 4 * nb : start].view(np.float32)
    np.testing.assert_array_equal(mins.view(np.uint32)[:7], 0, err_msg=name)
    assert mins[7] == 0.0 and mins[8] == -1.0 and not np.signbit(scales).any(), name
    _assert_same(buf, outs["jit"], name)


def test_shard_map_check_vma():
  c = jc.hadamard(jc.int8(block_size=64), size=128)
  n = 256
  mesh = jax.make_mesh((8,), ("i",))
  x = jax.device_put(
    jnp.asarray(_data(16, n, jnp.float32, seed=3)), jax.NamedSharding(mesh, jax.P("i"))
  )

  def body(impl, v):
    buf = c.encode_rows(v, impl=impl)
    return (
      buf,
      c.decode_rows(buf, n, jnp.float32, impl=impl),
      c.decode_sum(buf, n, jnp.bfloat16, impl=impl)[None],
      c.decode_sum_encode(buf, n, jnp.float32, impl=impl)[None],
    )

  outs = []
  for impl in ("jnp", "native"):
    f = jax.shard_map(
      functools.partial(body, impl),
      mesh=mesh,
      in_specs=jax.P("i"),
      out_specs=jax.P("i"),
      check_vma=True,
    )
    outs.append(jax.jit(f)(x))
  for a, b in zip(*outs):
    _assert_same(b, a, "shard_map")


def test_code_around_a_codec_rounds_as_around_the_kernel():
  # Native and jnp training split at step 2 (tiny or small GPT, mesh 2,2,2, int8 on every
  # axis) with equal codec outputs: XLA:CPU fused a jnp decode_sum's tail into AdamW's
  # moment update and made an FMA of the other product than beside the custom call
  # (docs/numerics.md). The jnp row ops sit behind barriers now, so the code around a codec
  # compiles the same whichever implementation runs.
  n, codecs = 256, (jc.int8(), jc.fp8("e4m3"))
  x = jnp.asarray(np.random.default_rng(5).standard_normal((2, n)).astype(np.float32) * 1e-3)
  mu = jnp.asarray(np.random.default_rng(6).standard_normal(n).astype(np.float32) * 1e-4)
  bufs = [c.encode_rows(x, impl="native") for c in codecs]

  def around(impl, bufs, x, mu, clip):
    out = []
    for c, buf in zip(codecs, bufs):
      g = c.decode_sum(buf, n, jnp.float32, impl=impl) * clip
      residual = x[0] - c.decode_rows(buf, n, jnp.float32, impl=impl)[0] * clip
      out += [0.1 * g + 0.9 * mu, residual, c.encode_rows(x * clip + mu, impl=impl)]
    return out

  args = (bufs, x, mu, jnp.float32(0.7))
  want = jax.jit(functools.partial(around, "native"))(*args)
  got = jax.jit(functools.partial(around, "jnp"))(*args)
  for i, (a, b) in enumerate(zip(want, got)):
    _assert_same(b, a, f"{codecs[i // 3]} output {i % 3}")


def _all_bf16_as_f32() -> np.ndarray:
  return (np.arange(65536, dtype=np.uint32) << 16).view(np.float32)


@pytest.mark.parametrize(
  "c",
  [
    jc.fp8("e4m3", block_size=32),
    jc.fp8("e5m2", block_size=32),
    jc.cast(jnp.float16),
    jc.cast(jnp.bfloat16),
  ],
  ids=str,
)
def test_exhaustive_bf16_patterns(c):
  """Every bfloat16 bit pattern (as float32 and as bfloat16 input) times a few scales."""
  base = _all_bf16_as_f32()
  rng = np.random.default_rng(0)
  with np.errstate(over="ignore", invalid="ignore"):  # Inf/NaN patterns are the point
    rows = [
      base,
      base * np.float32(1.7),
      base * np.float32(3e-5),
      rng.permutation(base),
      (rng.integers(0, 2**32, 65536, dtype=np.uint64).astype(np.uint32)).view(np.float32),
    ]
  x = np.stack(rows)
  for dtype in (jnp.float32, jnp.bfloat16):
    xd = jnp.asarray(x).astype(dtype)
    n = xd.shape[1]
    f = jax.jit(
      lambda v, i: (lambda b: (b, c.decode_rows(b, n, dtype, impl=i)))(c.encode_rows(v, impl=i)),
      static_argnums=1,
    )
    (b0, d0), (b1, d1) = f(xd, "jnp"), f(xd, "native")
    _assert_same(b1, b0, f"{c} encode {jnp.dtype(dtype).name}")
    _assert_same(d1, d0, f"{c} decode {jnp.dtype(dtype).name}")


def test_bad_attributes_raise():
  x = jnp.ones((2, 64), jnp.float32)
  jc.int8(block_size=64).encode_rows(x, impl="native")  # registers the targets
  attrs = native.ffi_codec(jc.int8(block_size=64))
  attrs["bits"] = np.int32(9)
  call = jax.ffi.ffi_call("jcoccl_encode_rows", jax.ShapeDtypeStruct((2, 100), jnp.uint8))
  with pytest.raises(Exception, match="bits must be 2 to 8"):
    jax.block_until_ready(call(x, codec=attrs))


def test_bad_spike_attributes_raise():
  x = jnp.ones((2, 64), jnp.float32)
  c = jc.spike(jc.int8(block_size=64), k=2)
  c.encode_rows(x, impl="native")  # registers the targets
  call = jax.ffi.ffi_call("jcoccl_encode_rows", jax.ShapeDtypeStruct((2, 92), jnp.uint8))
  for change, msg in (
    ({"spike": np.int32(64)}, "spike must be 0 or in"),
    ({"hadamard": np.int32(64)}, "spike and hadamard do not combine"),
    ({"kind": np.int32(1)}, "spike needs an int, fp8 or error_bounded inner"),
  ):
    with pytest.raises(Exception, match=msg):
      jax.block_until_ready(call(x, codec={**native.ffi_codec(c), **change}))


def test_wrappers_inside_wrappers_are_not_native():
  # Flat kernel fields could not say which wrapper is outside: both orders run in jnp.
  for c in (
    jc.spike(jc.hadamard(jc.int4(block_size=64), size=64), k=2),
    jc.hadamard(jc.spike(jc.int4(block_size=64), k=2), size=64),
    jc.spike(jc.int4(rounding="stochastic"), k=2),
  ):
    assert not native.available(c, "decode", jnp.float32), c
  assert native.available(jc.spike(jc.int4(), k=2), "decode", jnp.float32)


def test_stochastic_not_native():
  c = jc.int8(rounding="stochastic")
  assert not native.available(c, "encode", jnp.float32)
  assert not native.available(jc.int8(), "encode", jnp.int32)

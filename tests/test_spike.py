"""spike(<inner>): reserved outliers exact, the rest within the inner codec's bound over the
narrowed block; far smaller errors than the inner codec alone on heavy-tailed data."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jcoccl
from jcoccl import compressors as jc


def _heavy(rows: int, n: int, seed: int = 0) -> np.ndarray:
  return np.random.default_rng(seed).standard_t(2, size=(rows, n)).astype(np.float32)


def test_spec_payload_and_errors():
  c = jc.parse("spike(int4:asym):k=8")
  assert c == jc.spike(jc.int4(symmetric=False), k=8) and str(c) == "spike(int4:asym):k=8"
  assert str(jc.spike(jc.int3())) == "spike(int3)" and jc.parse("spike(int3)").k == 4
  # Inner bytes plus a float32 value and a uint16 index per reserved value.
  for inner in (jc.int4(), jc.int3(block_size=64), jc.fp8()):
    n = 4 * inner.granule
    want = inner.payload_nbytes(n, jnp.float32) + 4 * 6 * 4
    assert jc.spike(inner).payload_nbytes(n, jnp.bfloat16) == want
  with pytest.raises(ValueError, match="k must be an int in 1..255"):
    jc.parse("spike(int4):k=256")
  with pytest.raises(ValueError, match="lossy blockwise inner codec"):
    jc.spike(jc.cast(jnp.bfloat16))
  with pytest.raises(TypeError, match="inner must be a jcoccl Compressor"):
    jc.spike("int4")


@pytest.mark.parametrize("inner", ["int8", "int4", "int3", "int2:asym"])
def test_outliers_cost_far_less_error_at_a_modest_byte_cost(inner):
  x = jnp.asarray(_heavy(8, 4096))
  base, sp = jc.parse(inner), jc.parse(f"spike({inner}):k=4")
  e_base = np.abs(np.asarray(base.decode_rows(base.encode_rows(x), 4096, jnp.float32) - x))
  y = sp.decode_rows(sp.encode_rows(x), 4096, jnp.float32)
  e_sp = np.abs(np.asarray(y - x))
  assert e_sp.max() < 0.25 * e_base.max(), (e_sp.max(), e_base.max())
  assert np.sqrt((e_sp**2).mean()) < 0.7 * np.sqrt((e_base**2).mean())
  extra = sp.payload_nbytes(4096, jnp.float32) / base.payload_nbytes(4096, jnp.float32) - 1
  assert extra <= 24 * 16 / base.payload_nbytes(4096, jnp.float32) + 1e-9
  # Within the documented bound, reserved values bit for bit.
  assert bool(jnp.all(jnp.abs(y - x) <= sp.error_bound(x)))
  top = np.argsort(-np.abs(np.asarray(x)).reshape(8, -1, base.granule), axis=-1)[..., :4]
  xb, yb = np.asarray(x).reshape(8, -1, base.granule), np.asarray(y).reshape(8, -1, base.granule)
  np.testing.assert_array_equal(
    np.take_along_axis(yb, top, -1).view(np.uint32), np.take_along_axis(xb, top, -1).view(np.uint32)
  )


def test_nonfinite_survive_and_garbage_decodes():
  c = jc.spike(jc.int4(block_size=32), k=2)
  x = jnp.arange(64, dtype=jnp.float32).at[3].set(jnp.nan).at[40].set(jnp.inf)
  y = c.decode(c.encode(x))
  assert bool(jnp.isnan(y[3])) and not bool(jnp.isfinite(y[40]))
  rng = np.random.default_rng(1)
  for _ in range(10):
    buf = jnp.asarray(rng.integers(0, 256, (2, c.payload_nbytes(64, jnp.float32)), np.uint8))
    assert c.decode_rows(buf, 64, jnp.float32).shape == (2, 64)


def test_passes_the_conformance_check():
  r = jc.check(jc.parse("spike(int3:asym):k=8"), dtypes=("float32", "bfloat16"), verbose=False)
  assert r, r.table()


def test_all_reduce_with_spike_is_the_codec_decoded_and_summed():
  mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  c = jc.parse("spike(int4):k=4")
  x = jnp.asarray(_heavy(4, 2048, seed=2))
  f = jax.jit(
    jax.shard_map(
      lambda v: jcoccl.all_reduce(v[0], "d", compressor=c, algorithm="one_shot", min_bytes=0)[None],
      mesh=mesh,
      in_specs=jax.P("d"),
      out_specs=jax.P("d"),
    )
  )
  got = np.asarray(f(x))
  want = np.asarray(c.decode_sum(c.encode_rows(x), 2048, jnp.float32))
  np.testing.assert_array_equal(got, np.broadcast_to(want, got.shape))


# ---- native kernels (C++ here; CUDA == C++ under the host shim: tests/test_cuda_shim.py) ----
_NATIVE = [
  jc.spike(jc.int4(block_size=32), k=1),
  jc.spike(jc.int2(block_size=64, symmetric=False), k=4),
  jc.spike(jc.int5(block_size=128), k=7),
  jc.spike(jc.int8(block_size=32), k=31),
  jc.spike(jc.fp8("e5m2", block_size=64), k=3),
  jc.spike(jc.error_bounded(1e-2, block_size=32), k=2),
]


def _adversarial(g: int, k: int) -> np.ndarray:
  """Rows of blocks of g that stress the reserving order and the bound: all-equal blocks,
  ties at the top, zeros of both signs, subnormals of distinct sizes (one order by bits,
  whatever the flush mode), a heavy outlier, NaN/Inf (fewer finite values than k), huge."""
  rng = np.random.default_rng(g + k)
  blocks = [
    np.full(g, 1.25, np.float32),
    np.where(np.arange(g) % 3 == 0, 7.0, rng.standard_normal(g)).astype(np.float32),
    np.where(np.arange(g) % 2 == 0, 0.0, -0.0).astype(np.float32),
    (rng.permutation(g) - g // 2).astype(np.float32) * np.float32(1e-42),
    (rng.standard_normal(g) * np.where(np.arange(g) == g // 3, 1e30, 1)).astype(np.float32),
    np.where(np.arange(g) < g - 1, np.nan, 1.0).astype(np.float32),
    np.where(np.arange(g) % 5 == 0, np.inf, rng.standard_normal(g)).astype(np.float32),
    np.clip(rng.standard_t(1, g) * 1e37, -3e38, 3e38).astype(np.float32),
  ]
  return np.stack([np.concatenate(blocks[i : i + 4]) for i in (0, 4)])


@pytest.mark.parametrize("c", _NATIVE, ids=str)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=str)
def test_native_is_the_jnp_spec_bit_for_bit(c, dtype):
  x = jnp.asarray(_adversarial(c.granule, c.k)).astype(dtype)  # float16: huge -> inf
  n = x.shape[1]

  def ops(impl, x):  # x an argument: XLA would fold a constant without flushing subnormals
    buf = c.encode_rows(x, impl=impl)
    return (
      buf,
      c.decode_rows(buf, n, dtype, impl=impl),
      c.decode_sum(buf, n, dtype, impl=impl),
      # Each impl reduces its own encode's rows: equal payloads (the first output) make this
      # the comparison of the two decode_sum_encode on one payload.
      c.decode_sum_encode(buf, n, dtype, impl=impl),
    )

  f = jax.jit(ops, static_argnums=0)
  for a, b in zip(f("jnp", x), f("native", x)):
    np.testing.assert_array_equal(np.asarray(b).view(np.uint8), np.asarray(a).view(np.uint8))


def test_reserving_order_magnitude_then_lower_index():
  # All-equal block: the first k indices; ties at the top: the lower indices first; the
  # subnormals by value; an unused slot (only one finite value) is +0 at index 0xFFFF.
  g, k = 32, 3
  x = np.zeros((4, g), np.float32)
  x[0] = 1.25
  x[1, [4, 9, 20, 30]] = [-5.0, 5.0, 5.0, 6.0]
  x[2, [3, 8, 12]] = [1e-44, -3e-44, 2e-44]
  x[3] = np.nan
  x[3, 17] = 2.0
  c = jc.spike(jc.int4(block_size=g), k=k)
  for impl in ("jnp", "native"):
    buf = np.asarray(c.encode_rows(jnp.asarray(x), impl=impl))
    p = jc.int4(block_size=g).payload_nbytes(g, jnp.float32)
    vals = buf[:, p : p + 4 * k].view(np.float32)
    idx = buf[:, p + 4 * k : p + 6 * k].view(np.uint16)
    np.testing.assert_array_equal(idx, [[0, 1, 2], [30, 4, 9], [8, 12, 3], [17, 0xFFFF, 0xFFFF]])
    np.testing.assert_array_equal(vals[:3], x[np.arange(3)[:, None], idx[:3]])
    assert vals[3].view(np.uint32).tolist() == [np.float32(2.0).view(np.uint32), 0, 0]


@pytest.mark.parametrize("c", _NATIVE, ids=str)
@pytest.mark.filterwarnings("ignore:invalid value encountered")
def test_bound_holds_on_adversarial_blocks(c):
  x = jnp.asarray(_adversarial(c.granule, c.k))
  bound = c.error_bound(x)
  for impl in ("jnp", "native"):
    y = c.decode_rows(c.encode_rows(x, impl=impl), x.shape[1], jnp.float32, impl=impl)
    finite = np.isfinite(np.asarray(bound))
    err = np.abs(np.asarray(y) - np.asarray(x))
    assert (err[finite] <= np.asarray(bound)[finite]).all(), impl
    # Non-finite inputs stay non-finite; every finite reserved-size block keeps its top k.
    assert not np.isfinite(np.asarray(y)[~np.isfinite(np.asarray(x))]).any()


def test_k_up_to_the_block_is_exact_except_the_last():
  # k = G - 1: every value but the smallest magnitude is reserved; the inner codec sees a
  # constant block (that value repeated), so it too decodes exactly for int8.
  c = jc.spike(jc.int8(block_size=32), k=31)
  x = jnp.asarray(np.random.default_rng(3).standard_t(1, (2, 64)).astype(np.float32))
  for impl in ("jnp", "native"):
    y = c.decode_rows(c.encode_rows(x, impl=impl), 64, jnp.float32, impl=impl)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
  with pytest.raises(ValueError, match="k must be an int in 1..31"):
    jc.spike(jc.int8(block_size=32), k=32)


@pytest.mark.parametrize(
  "c",
  [*_NATIVE, jc.spike(jc.int3(block_size=4096), k=4), jc.spike(jc.int7(), k=3)],
  ids=str,
)
def test_payload_sizes_are_the_documented_formula_and_the_encoded_size(c):
  for nblocks in (1, 2, 3, 5):
    n = nblocks * c.granule
    slots = c.k * nblocks
    inner = c.inner.payload_nbytes(n, jnp.float32)
    want = inner + 4 * slots + -(-2 * slots // 4) * 4
    for dtype in (jnp.float32, jnp.bfloat16):
      assert c.payload_nbytes(n, dtype) == want and want % 4 == 0
      x = jnp.ones((2, n), dtype)
      # The jnp encoder's shape (traced, not run: test_native_is_the_jnp_spec_bit_for_bit
      # shows its bytes are the native ones), and the native encoder's bytes.
      spec = jax.eval_shape(lambda z: c.encode_rows(z, impl="jnp"), x)
      assert spec.shape == (2, want), ("jnp", n)
      buf = c.encode_rows(x, impl="native")
      assert buf.shape == (2, want), ("native", n)
      assert not np.asarray(buf)[:, inner + 6 * slots :].any()  # zero padding


def test_corrupt_indices_decode_to_nan_blocks_alike():
  c = jc.spike(jc.int4(block_size=32), k=3)
  x = jnp.asarray(np.random.default_rng(5).standard_normal((1, 96)).astype(np.float32))
  buf = np.asarray(c.encode_rows(x)).copy()
  p = c.inner.payload_nbytes(96, jnp.float32) + 4 * 9
  idx = buf[0, p : p + 18].view(np.uint16)
  idx[0:3] = [5, 5, 0xFFFF]  # block 0: repeated
  idx[3:6] = [32, 1, 2]  # block 1: past the block
  idx[6:9] = [0xFFFF, 0xFFFF, 7]  # block 2: valid, one value
  buf[0, p - 4 * 9 + 4 * 8 : p - 4 * 9 + 4 * 9] = np.frombuffer(
    np.uint32(0xFFC12345).tobytes(), np.uint8
  )  # block 2's value: a NaN with a payload
  outs = [
    np.asarray(c.decode_rows(jnp.asarray(buf), 96, jnp.float32, impl=i)) for i in ("jnp", "native")
  ]
  np.testing.assert_array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32))
  y = outs[0][0]
  assert (y[:64].view(np.uint32) == 0x7FC00000).all()
  assert y[64 + 7].view(np.uint32) == 0x7FC00000 and np.isfinite(np.delete(y[64:], 7)).all()


def test_fused_backend_runs_spike_natively():
  from jcoccl._src.engine import fused_comms

  mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  c = jc.parse("spike(int4:block=64):k=2")
  x = jnp.asarray(_heavy(4, 1024, seed=4))

  def run(backend):
    return jax.jit(
      jax.shard_map(
        lambda v: jcoccl.all_reduce(v[0], "d", compressor=c, backend=backend, min_bytes=0)[None],
        mesh=mesh,
        in_specs=jax.P("d"),
        out_specs=jax.P("d"),
      )
    )(x)

  jcoccl.init(mesh)
  try:
    got = np.asarray(run("fused"))
  finally:
    fused_comms.shutdown()
  np.testing.assert_array_equal(got.view(np.uint32), np.asarray(run("xla")).view(np.uint32))

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

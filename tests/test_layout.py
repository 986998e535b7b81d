"""The row layout (jcoccl/_src/compressors/layout.py): padding, slices, rows of a message, batches."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jcoccl import compressors as jc
from jcoccl._src.compressors import layout as L
from jcoccl._src.compressors import rows as R


@pytest.mark.parametrize("length", [0, 1, 31, 32, 33, 1000, 1024])
@pytest.mark.parametrize("multiple", [1, 32, 96])
def test_padded_len_is_the_smallest_positive_multiple(length, multiple):
  p = L.padded_len(length, multiple)
  assert p % multiple == 0 and p >= max(length, 1) and p - multiple < max(length, 1)


@pytest.mark.parametrize(
  "length,unit,chunks", [(1000, 32, 1), (1000, 32, 4), (100, 32, 8), (1, 32, 3), (4096, 256, 64)]
)
def test_row_layout_pads_to_whole_slices_of_whole_units(length, unit, chunks):
  lay = L.RowLayout.of(length, unit, chunks)
  units = -(-length // unit)
  assert lay.slices == min(chunks, max(units, 1))
  assert lay.padded % (lay.slices * unit) == 0 and lay.width % unit == 0
  assert lay.padded - lay.slices * unit < max(length, 1)
  x = jnp.arange(1, length + 1, dtype=jnp.float32)[None]
  padded = lay.pad(x)
  assert padded.shape == (1, lay.padded)
  np.testing.assert_array_equal(np.asarray(lay.unpad(padded)), np.asarray(x))
  assert not np.any(np.asarray(padded[:, length:]))


def test_too_many_slices_raise():
  with pytest.raises(ValueError, match="at most 64"):
    L.RowLayout.of(65 * 32, 32, 65)


def test_lcm_and_granule_rows():
  assert L.lcm(32, 128, 1) == 128 and L.lcm(96, 64) == 192 and L.lcm() == 1
  assert L.granule_rows(4096, 4, 32) == 1024 and L.granule_rows(1000, 4, 32) == 224
  assert L.granule_rows(4, 4, 32) == 32


@pytest.mark.parametrize(
  "shape,dim,n", [((8, 6), 0, 4), ((4, 6), 1, 3), ((2, 4, 3), 1, 2), ((6,), 0, 6)]
)
def test_to_rows_from_rows_roundtrip(shape, dim, n):
  x = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape)
  rows, block = L.to_rows(x, dim, n)
  assert rows.shape == (n, x.size // n)
  for j in range(n):  # row j is block j along dim
    want = jnp.take(x, jnp.arange(j * block[0], (j + 1) * block[0]), axis=dim)
    np.testing.assert_array_equal(np.asarray(L.from_rows(rows[j], block, dim)), np.asarray(want))
  back = L.from_rows(rows, block, dim)  # [n, *block with dim in place]
  np.testing.assert_array_equal(np.asarray(jnp.concatenate(list(back), axis=dim)), np.asarray(x))


@pytest.mark.parametrize("chunks", [2, 3, 5])
def test_chunked_slicing_equals_unchunked(chunks):
  """Slices cut at granule boundaries: a blockwise codec round trip is bitwise the same."""
  c = jc.int4(block_size=32)
  x = jax.random.normal(jax.random.key(0), (3, 1000), jnp.float32) * 7
  lay = L.RowLayout.of(1000, c.granule, chunks)
  rows = lay.pad(x)

  def roundtrip(s: jax.Array, i: int) -> jax.Array:
    del i
    return c.decode_rows(c.encode_rows(s), s.shape[-1], s.dtype)

  sliced = L.chunked(roundtrip, rows, lay.slices)
  np.testing.assert_array_equal(
    np.asarray(sliced).view(np.uint32), np.asarray(roundtrip(rows, 0)).view(np.uint32)
  )
  seen = []
  L.chunked(lambda s, i: seen.append(s.shape[-1]) or s, rows, lay.slices)
  assert seen == [lay.width] * lay.slices and lay.width % c.granule == 0


def test_slice_major_and_batch_interleave_roundtrip():
  x = jnp.arange(2 * 3 * 24, dtype=jnp.float32).reshape(2, 3, 24)
  y = L.slice_major(x[0], 4)
  assert y.shape == (4, 3, 6)
  np.testing.assert_array_equal(np.asarray(y[1]), np.asarray(x[0][:, 6:12]))
  np.testing.assert_array_equal(np.asarray(L.from_slice_major(y)), np.asarray(x[0]))
  flat = L.slice_major(x[0, 0], 4)
  assert flat.shape == (4, 6)
  np.testing.assert_array_equal(np.asarray(L.from_slice_major(flat)), np.asarray(x[0, 0]))
  mixed = R.interleave(x, 4)  # [3, 4 slices * 2 messages * 6]
  assert mixed.shape == (3, 48)
  np.testing.assert_array_equal(np.asarray(mixed[:, 6:12]), np.asarray(x[1][:, :6]))
  np.testing.assert_array_equal(np.asarray(R.deinterleave(mixed, 2, 4)), np.asarray(x))
  np.testing.assert_array_equal(np.asarray(L.rank_rows(x, 4)), np.asarray(x).reshape(2, 3, 4, 6))

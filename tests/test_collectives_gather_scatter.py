"""jcoccl.all_gather / reduce_scatter / all_to_all / ppermute against their lax equivalents."""

import jax.numpy as jnp
import numpy as np
import pytest
from collectives_util import (
  DTYPES,
  LOSSY,
  assert_within,
  bits,
  eb,
  f64,
  host_rand,
  mesh,
  per_rank,
  sum_bound,
)
from jax import lax

import jcoccl

EXACT_MESHES = [
  ((1,), ("x",), "x"),
  ((2,), ("x",), "x"),
  ((8,), ("x",), "x"),
  ((2, 4), ("a", "b"), ("a", "b")),
  ((2, 2, 2), ("a", "b", "c"), ("a", "c")),
]


@pytest.mark.parametrize("shape,names,axes", EXACT_MESHES)
def test_exact_paths_are_lax(shape, names, axes):
  m = mesh(shape, names)
  n = int(np.prod([shape[names.index(a)] for a in (axes if isinstance(axes, tuple) else (axes,))]))
  x = host_rand((int(np.prod(shape)), n * 2, 3), jnp.bfloat16)
  pairs = [
    (
      lambda v: jcoccl.all_gather(v, axes, axis=1, compressor="none", min_bytes=0),
      lambda v: lax.all_gather(v, axes, axis=1),
    ),
    (
      lambda v: jcoccl.reduce_scatter(v, axes, tiled=True, compressor=None),
      lambda v: lax.psum_scatter(v, axes, tiled=True),
    ),
    (
      lambda v: jcoccl.all_to_all(v, axes, 0, 1, tiled=True, compressor="none", min_bytes=0),
      lambda v: lax.all_to_all(v, axes, 0, 1, tiled=True),
    ),
    (
      lambda v: jcoccl.ppermute(v, axes, [(i, (i + 1) % n) for i in range(n)]),
      lambda v: lax.ppermute(v, axes, [(i, (i + 1) % n) for i in range(n)]),
    ),
  ]
  for j, l in pairs:
    np.testing.assert_array_equal(bits(per_rank(m, j, x)), bits(per_rank(m, l, x)))


CASES = [
  (name, dt)
  for i, name in enumerate(LOSSY)
  for dt in (["f32", "bf16", "f16"] if i % 2 == 1 else ["f32", "f16"])
]


@pytest.mark.parametrize("cname,dname", CASES)
def test_lossy_all_four_ops(cname, dname):
  c, dtype = LOSSY[cname], DTYPES[dname]
  m = mesh((4,), ("x",))
  x = host_rand((4, 4, 3, 25), dtype, seed=11)  # per rank [4, 3, 25]; 75-element rows (padding)
  kw = dict(compressor=c, min_bytes=0)
  xs = f64(x)
  # x is a host array (its slices compile nothing), and since a codec's error_bound reads
  # its input as one flat row, x_r[j : j + 1]'s bound is x_r[j]'s: two error_bound programs
  # per case ([4, 3, 25] and [3, 25]) instead of three.
  # all_gather (axis=1, tiled): every rank gets every rank's x within eb.
  ag = per_rank(m, lambda v: jcoccl.all_gather(v, "x", axis=1, tiled=True, **kw), x)
  want = per_rank(m, lambda v: lax.all_gather(v, "x", axis=1, tiled=True), x)
  assert ag.shape == want.shape and ag.dtype == want.dtype
  bound = np.concatenate([eb(c, x[r]) for r in range(4)], axis=1)
  for r in range(4):
    assert_within(ag[r], f64(want[r]), bound, "all_gather")
  # reduce_scatter (non-tiled over dim 0): rank j gets sum_r x_r[j].
  rs = per_rank(m, lambda v: jcoccl.reduce_scatter(v, "x", scatter_dimension=0, **kw), x)
  for j in range(4):
    assert_within(rs[j], xs[:, j].sum(0), sum_bound(c, x[:, j], dtype), "reduce_scatter")
  # all_to_all (split 0, concat 2, tiled): rank j gets [x_0[j] | x_1[j] | ...] on axis 2.
  a2 = per_rank(m, lambda v: jcoccl.all_to_all(v, "x", 0, 2, tiled=True, **kw), x)
  want = per_rank(m, lambda v: lax.all_to_all(v, "x", 0, 2, tiled=True), x)
  assert a2.shape == want.shape
  for j in range(4):
    bound = np.concatenate([eb(c, x[r, j])[None] for r in range(4)], axis=2)
    assert_within(a2[j], f64(want[j]), bound, "all_to_all")
  # ppermute: a shift that leaves rank 0 without a sender (zeros, as lax).
  perm = [(0, 1), (1, 2), (2, 3)]
  pp = per_rank(m, lambda v: jcoccl.ppermute(v, "x", perm, **kw), x)
  want = per_rank(m, lambda v: lax.ppermute(v, "x", perm), x)
  np.testing.assert_array_equal(bits(pp[0]), bits(want[0]))
  for s, d in perm:
    assert_within(pp[d], xs[s], eb(c, x[s]), "ppermute")


@pytest.mark.parametrize("axis,tiled", [(0, False), (2, False), (1, True), (-1, True)])
def test_all_gather_layouts(axis, tiled):
  c = LOSSY["bf16"]
  m = mesh((2, 4), ("a", "b"))
  x = host_rand((8, 3, 5), jnp.float32, seed=4)
  got = per_rank(
    m, lambda v: jcoccl.all_gather(v, "b", axis=axis, tiled=tiled, compressor=c, min_bytes=0), x
  )
  want = per_rank(m, lambda v: lax.all_gather(v, "b", axis=axis, tiled=tiled), x)
  assert got.shape == want.shape
  assert_within(got, f64(want), 2.0**-8 * np.abs(f64(want)))


@pytest.mark.parametrize("dim,tiled,chunks", [(1, True, 1), (2, False, 2), (0, True, 3)])
def test_reduce_scatter_layouts_and_chunks(dim, tiled, chunks):
  c = LOSSY["int8"]
  m = mesh((2, 4), ("a", "b"))
  shape = [8, 8, 4]
  shape[dim] = 4 if not tiled else 8
  x = host_rand((8, *shape), jnp.float32, seed=6)
  got = per_rank(
    m,
    lambda v: jcoccl.reduce_scatter(
      v, ("b",), scatter_dimension=dim, tiled=tiled, compressor=c, chunks=chunks, min_bytes=0
    ),
    x,
  )
  want = per_rank(m, lambda v: lax.psum_scatter(v, "b", scatter_dimension=dim, tiled=tiled), x)
  assert got.shape == want.shape
  one = per_rank(
    m,
    lambda v: jcoccl.reduce_scatter(
      v, "b", scatter_dimension=dim, tiled=tiled, compressor=c, min_bytes=0
    ),
    x,
  )
  np.testing.assert_array_equal(bits(got), bits(one))  # chunking keeps the blocks
  err = np.abs(f64(got) - f64(want)).max()
  assert err < 4 * 2 * np.abs(f64(x)).max() / 127


def test_all_to_all_non_tiled_and_tuple_axes():
  c = LOSSY["fp8"]
  m = mesh((2, 2, 2), ("a", "b", "c"))
  x = host_rand((8, 5, 4, 32), jnp.float32, seed=8)
  f = lambda v: jcoccl.all_to_all(v, ("a", "c"), 1, 2, compressor=c, min_bytes=0)
  got = per_rank(m, f, x)
  want = per_rank(m, lambda v: lax.all_to_all(v, ("a", "c"), 1, 2), x)
  assert got.shape == want.shape
  assert_within(got, f64(want), 2 * np.abs(f64(x)).max() * 2.0**-4)

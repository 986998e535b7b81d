"""jcoccl.all_reduce against lax.psum: exact path bit-exact, lossy within the compressors'
error bounds, bitwise identical across ranks, chunking, hierarchical, threshold, NaN."""

import jax
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
from jax.sharding import PartitionSpec as P

import jcoccl
from jcoccl import compressors as jc

MESHES = [
  ((1,), ("x",)),
  ((2,), ("x",)),
  ((8,), ("x",)),
  ((2, 4), ("a", "b")),
  ((2, 2, 2), ("a", "b", "c")),
]


@pytest.mark.parametrize("shape,names", MESHES)
@pytest.mark.parametrize("comp", [None, "none"])
def test_exact_path_is_lax_psum(shape, names, comp):
  m = mesh(shape, names)
  n = int(np.prod(shape))
  x = {"w": host_rand((n, 5, 3), jnp.float32), "b": host_rand((n, 7), jnp.bfloat16, seed=1)}
  axes = names if len(names) > 1 else names[0]
  got = per_rank(m, lambda v: jcoccl.all_reduce(v, axes, compressor=comp, min_bytes=0), x)
  want = per_rank(m, lambda v: lax.psum(v, axes), x)
  for k in x:
    np.testing.assert_array_equal(bits(got[k]), bits(want[k]))


def _check_identical_across_ranks(y):
  y = np.asarray(y)
  for r in range(1, y.shape[0]):
    np.testing.assert_array_equal(bits(y[r]), bits(y[0]))


CASES = [
  (name, dt)
  for i, name in enumerate(LOSSY)
  for dt in (["f32", "bf16", "f16"] if i % 2 == 0 else ["f32", "bf16"])
]


@pytest.mark.parametrize("cname,dname", CASES)
def test_lossy_one_and_two_shot_within_bounds(cname, dname):
  c, dtype = LOSSY[cname], DTYPES[dname]
  m = mesh((4,), ("x",))
  x = host_rand((4, 300), dtype, seed=3)  # 300: not a multiple of the blocks (padding)
  one = per_rank(
    m, lambda v: jcoccl.all_reduce(v, "x", compressor=c, algorithm="one_shot", min_bytes=0), x
  )
  two = per_rank(
    m, lambda v: jcoccl.all_reduce(v, "x", compressor=c, algorithm="two_shot", min_bytes=0), x
  )
  assert one.dtype == dtype and one.shape == x.shape
  _check_identical_across_ranks(one)
  _check_identical_across_ranks(two)
  exact = f64(x).sum(0)
  assert_within(one[0], exact, sum_bound(c, x, dtype), "one_shot")
  # two_shot's first stage decodes the same blocks in the same order as one_shot, so its
  # second quantization re-encodes exactly one_shot's result.
  assert_within(two[0], f64(one[0]), eb(c, one[0]), "two_shot second quantization")


@pytest.mark.parametrize(
  "c", [jc.int4(block_size=32, rounding="stochastic"), jc.hadamard(jc.int3(rounding="stochastic"))]
)
def test_stochastic_one_and_two_shot_unbiased_within_bounds(c):
  """Stochastic rounding in both algorithms: one result on every rank, within the bounds
  (two_shot's second quantization rounds on a stream of its own), and unbiased: the mean
  over 64 keys is within 5 standard errors (the draws' own) of the exact sum."""
  m, k = mesh((4,), ("x",)), 64
  x = host_rand((4, 256), jnp.float32, seed=4)
  spec = P("x")

  def make(algorithm):
    body = lambda v, key: jcoccl.all_reduce(
      v[0], "x", compressor=c, algorithm=algorithm, min_bytes=0, key=key
    )[None]
    return jax.jit(jax.shard_map(body, mesh=m, in_specs=(spec, P()), out_specs=spec))

  one, two = make("one_shot"), make("two_shot")
  exact = f64(x).sum(0)
  bound = sum_bound(c, x, jnp.float32)
  draws = []
  for i in range(k):
    key = jax.random.key(i)
    a, b = np.asarray(one(x, key)), np.asarray(two(x, key))
    _check_identical_across_ranks(a)
    _check_identical_across_ranks(b)
    assert_within(a[0], exact, bound, "one_shot")
    # The first stage draws the same bits as one_shot's: two_shot re-encodes its result.
    assert_within(b[0], f64(a[0]), eb(c, a[0]), "two_shot second quantization")
    draws.append(f64(b[0]))
  # Against the draws' own spread (round-to-nearest, deterministic, would have none), plus
  # float32's rounding of the sums.
  sd = np.std(draws, 0, ddof=1)
  mean_err = np.abs(np.mean(draws, 0) - exact)
  fold = 8 * 2.0**-24 * np.abs(f64(x)).sum(0)
  assert (mean_err <= 5 * sd / np.sqrt(k) + fold).mean() > 0.99


def test_stochastic_hierarchical_one_result_unbiased():
  """Stochastic levels in hierarchical: every rank of both levels gets the same sum (the
  final gather encodes each reduced shard alike in every outer group), and the mean over
  32 keys is within 5 standard errors (the draws' own) of the exact sum."""
  c = jc.int4(block_size=32, rounding="stochastic")
  m, k = mesh((2, 2), ("a", "b")), 32
  x = host_rand((4, 256), jnp.float32, seed=6)
  body = lambda v, key: jcoccl.all_reduce(
    v[0], ("a", "b"), compressor=(c, c), algorithm="hierarchical", min_bytes=0, key=key
  )[None]
  spec = P(("a", "b"))
  f = jax.jit(jax.shard_map(body, mesh=m, in_specs=(spec, P()), out_specs=spec))
  draws = []
  for i in range(k):
    y = np.asarray(f(x, jax.random.key(i)))
    _check_identical_across_ranks(y)
    draws.append(f64(y[0]))
  exact = f64(x).sum(0)
  sd = np.std(draws, 0, ddof=1)
  fold = 8 * 2.0**-24 * np.abs(f64(x)).sum(0)
  assert (np.abs(np.mean(draws, 0) - exact) <= 5 * sd / np.sqrt(k) + fold).mean() > 0.99


@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot"])
@pytest.mark.parametrize("chunks", [2, 3])
def test_chunks_bitwise_equal_to_unchunked(algorithm, chunks):
  c = LOSSY["int4a"]
  m = mesh((4,), ("x",))
  x = host_rand((4, 1000), jnp.float32, seed=5)
  run = lambda k: per_rank(
    m,
    lambda v: jcoccl.all_reduce(v, "x", compressor=c, algorithm=algorithm, chunks=k, min_bytes=0),
    x,
  )
  np.testing.assert_array_equal(bits(run(chunks)), bits(run(1)))


@pytest.mark.parametrize(
  "shape,names,axes",
  [((2, 4), ("a", "b"), ("a", "b")), ((2, 2, 2), ("a", "b", "c"), ("b", "c")), ((8,), ("x",), "x")],
)
def test_tuple_axes_and_auto(shape, names, axes):
  c = LOSSY["int8"]
  m = mesh(shape, names)
  x = host_rand((8, 4, 64), jnp.float32, seed=7)
  got = per_rank(m, lambda v: jcoccl.all_reduce(v, axes, compressor=c, min_bytes=0), x)
  want = per_rank(m, lambda v: lax.psum(v, axes), x)
  # The group of rank r sums the ranks sharing its other coordinates; bound per group.
  ax = axes if isinstance(axes, tuple) else (axes,)
  idx = np.arange(8).reshape(shape)
  keep = [i for i, nm in enumerate(names) if nm not in ax]
  moved = np.moveaxis(idx, keep, list(range(len(keep)))).reshape(
    -1, np.prod([shape[names.index(a)] for a in ax])
  )
  for group in moved:
    assert_within(got[group[0]], f64(want[group[0]]), sum_bound(c, x[group], jnp.float32))
    for r in group[1:]:
      np.testing.assert_array_equal(bits(got[r]), bits(got[group[0]]))


def test_hierarchical_is_rs_ar_ag_composition():
  c_in, c_out = jc.int8(block_size=64), jc.int4(block_size=64, symmetric=False)
  m = mesh((2, 4), ("node", "gpu"))
  x = host_rand((8, 4 * 256), jnp.float32, seed=9)

  def hier(v):
    return jcoccl.all_reduce(
      v, ("node", "gpu"), compressor={"node": c_out, "gpu": c_in}, min_bytes=0
    )

  def composed(v):
    s = jcoccl.reduce_scatter(v, "gpu", tiled=True, compressor=c_in, min_bytes=0)
    s = jcoccl.all_reduce(s, "node", compressor=c_out, algorithm="one_shot", min_bytes=0)
    return jcoccl.all_gather(s, "gpu", tiled=True, compressor=c_in, min_bytes=0)

  got, want = per_rank(m, hier, x), per_rank(m, composed, x)
  np.testing.assert_array_equal(bits(got), bits(want))
  _check_identical_across_ranks(got)
  rel = np.abs(f64(got[0]) - f64(x).sum(0)).max() / np.abs(f64(x).sum(0)).max()
  assert rel < 0.2  # sanity only: each stage is checked against its bound elsewhere


def test_hierarchical_pair_with_exact_level():
  m = mesh((2, 4), ("node", "gpu"))
  x = host_rand((8, 512), jnp.float32, seed=2)
  c = jc.cast("bfloat16")
  got = per_rank(
    m,
    lambda v: jcoccl.all_reduce(
      v, ("node", "gpu"), compressor=(None, c), algorithm="hierarchical", min_bytes=0
    ),
    x,
  )
  _check_identical_across_ranks(got)
  # bf16 RS inside each node, exact psum across nodes, bf16 re-encode in the gather.
  err = np.abs(f64(got[0]) - f64(x).sum(0))
  assert err.max() < 2.0**-7 * 4 * np.abs(f64(x)).sum(0).max()


def test_min_bytes_threshold_and_default():
  m = mesh((4,), ("x",))
  x = host_rand((4, 256), jnp.float32)
  want = per_rank(m, lambda v: lax.psum(v, "x"), x)
  small = per_rank(m, lambda v: jcoccl.all_reduce(v, "x", compressor="int8"), x)
  np.testing.assert_array_equal(bits(small), bits(want))  # 1 KiB < 4 MiB default
  try:
    jcoccl.set_default_min_bytes(0)
    comp = per_rank(m, lambda v: jcoccl.all_reduce(v, "x", compressor="int8"), x)
  finally:
    jcoccl.set_default_min_bytes(None)
  assert not np.array_equal(bits(comp), bits(want))
  assert jcoccl.default_min_bytes() == 4 * 1024 * 1024


def test_min_bytes_env(monkeypatch):
  """The environment gives the default, read once (and again on reload)."""
  monkeypatch.setenv("JCOCCL_MIN_BYTES", "123")
  try:
    jcoccl.set_config_defaults(reload=True)
    assert jcoccl.default_min_bytes() == 123
    monkeypatch.setenv("JCOCCL_MIN_BYTES", "abc")
    with pytest.raises(ValueError, match="JCOCCL_MIN_BYTES"):
      jcoccl.set_config_defaults(reload=True)
  finally:
    monkeypatch.delenv("JCOCCL_MIN_BYTES")
    jcoccl.set_config_defaults(reload=True)


@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot"])
def test_nan_inf_survive(algorithm):
  m = mesh((4,), ("x",))
  x = np.array(host_rand((4, 256), jnp.float32))
  x[1, 10] = np.nan
  x[2, 200] = np.inf
  y = per_rank(
    m, lambda v: jcoccl.all_reduce(v, "x", compressor="int8", algorithm=algorithm, min_bytes=0), x
  )
  assert np.isnan(np.asarray(y)[:, 10]).all()
  assert (~np.isfinite(np.asarray(y)[:, 200])).all()


def test_integer_dtype():
  m = mesh((2,), ("x",))
  xi = jnp.arange(8, dtype=jnp.int32).reshape(2, 4)
  with pytest.raises(TypeError, match="int32"):
    per_rank(m, lambda v: jcoccl.all_reduce(v, "x", compressor="int8", min_bytes=0), xi)
  y = per_rank(m, lambda v: jcoccl.all_reduce(v, "x", compressor="none", min_bytes=0), xi)
  np.testing.assert_array_equal(np.asarray(y), np.tile(np.asarray(xi).sum(0), (2, 1)))


def test_cost_model():
  from jcoccl._src.ops import auto_model

  assert auto_model.choose_all_reduce(64 * 1024, 8, 0.26) == "one_shot"
  assert auto_model.choose_all_reduce(64 << 20, 8, 0.26) == "two_shot"
  assert auto_model.choose_all_reduce(64 << 20, 2, 0.26) == "one_shot"

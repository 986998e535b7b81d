"""Cases from JAX's own shard_map tests, each against what lax itself does there: inputs
unreduced over the collective's axes (psum_scatter sums them; all_gather(to="reduced")
keeps other axes unreduced; the gathers, exchanges and permutes raise lax's error), bad
arguments (an unbound axis name, a `zip` perm, repeated or out-of-range pairs, axis
indices: lax's exception type and message first, its text read from lax on the same call,
so that the tests follow JAX's versions), arguments lax accepts (an empty axis tuple,
negative perm indices) and a vmap of a shard_map whose collective's operand is an integer
array."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from collectives_util import P, bits, rand
from jax import lax
from jax.sharding import AxisType

import jcoccl
from jcoccl import compressors as jc

INT8 = jc.int8(block_size=32)


def _explicit(shape, names):
  n = int(np.prod(shape))
  return jax.make_mesh(
    shape, names, axis_types=(AxisType.Explicit,) * len(names), devices=jax.devices()[:n]
  )


def _operands(mesh_x):
  """a [16, 64] split over its columns, b [64, 256] over its rows: a @ b is unreduced."""
  a = jax.device_put(np.asarray(rand((16, 64), jnp.float32, seed=1)), P(None, "x"))
  b = jax.device_put(np.asarray(rand((64, 256), jnp.float32, seed=2)), P("x", None))
  return a, b


def test_unreduced_psum_scatter_as_lax():
  """reduce_scatter of a value unreduced over "x" (einsum partial sums), as
  lax.psum_scatter: typed varying over "x" (out_specs P("x") accepted), exact bitwise
  without a compressor; with int8 each device's partial is its compressed operand (bitwise
  the same call on the partials passed as a varying input); the gradient is lax's
  (the transpose is all_gather(to="reduced"))."""
  m = _explicit((8,), ("x",))
  with jax.set_mesh(m):
    a, b = _operands(m)

    def prog(rs):
      def f(a, b):
        z = jnp.einsum("mk,kn->mn", a, b, out_sharding=P(unreduced={"x"}))
        return jax.shard_map(rs, in_specs=P(unreduced={"x"}), out_specs=P("x"))(z)

      return f

    lax_rs = lambda v: lax.psum_scatter(v, "x", scatter_dimension=0, tiled=True)
    jc_rs = lambda **k: lambda v: jcoccl.reduce_scatter(v, "x", tiled=True, min_bytes=0, **k)
    want = jax.jit(prog(lax_rs))(a, b)
    exact = jax.jit(prog(jc_rs()))(a, b)
    got = jax.jit(prog(jc_rs(compressor=INT8)))(a, b)
    assert exact.sharding == want.sharding == got.sharding
    np.testing.assert_array_equal(bits(exact), bits(want))
    # The same partials as a varying input ([8 devices x 16, 256], one block per device).
    parts = jax.jit(
      jax.shard_map(lambda a, b: a @ b, in_specs=(P(None, "x"), P("x", None)), out_specs=P("x"))
    )(a, b)
    same = jax.jit(jax.shard_map(jc_rs(compressor=INT8), in_specs=P("x"), out_specs=P("x")))(parts)
    np.testing.assert_array_equal(bits(got), bits(same))
    assert not np.array_equal(bits(got), bits(want))  # it did compress
    for rs in (jc_rs(), jc_rs(compressor=INT8)):
      loss = lambda fn: jax.jit(jax.grad(lambda a, b: prog(fn)(a, b).sum(), argnums=(0, 1)))
      g, g_lax = loss(rs)(a, b), loss(lax_rs)(a, b)
      for x, y in zip(g, g_lax):
        assert x.sharding == y.sharding
        np.testing.assert_array_equal(bits(x), bits(y))


def test_unreduced_input_through_all_gather_to_reduced_as_lax():
  """all_gather(to="reduced") over "y" of a value unreduced over "x": lax's result and
  type (unreduced over "x", reduced over "y"), with or without a compressor."""
  m = _explicit((4, 2), ("x", "y"))
  with jax.set_mesh(m):
    a = jax.device_put(np.asarray(rand((8, 64), jnp.float32, seed=3)), P(None, "x"))
    b = jax.device_put(np.asarray(rand((64, 32), jnp.float32, seed=4)), P("x", None))

    def prog(ag):
      def f(a, b):
        z = jnp.einsum("mk,kn->mn", a, b, out_sharding=P(unreduced={"x"}))
        z = jax.reshard(z, P("y", unreduced={"x"}))
        out = P(None, unreduced={"x"}, reduced={"y"})
        return jax.shard_map(ag, in_specs=P("y", unreduced={"x"}), out_specs=out)(z)

      # The type as traced; the values summed over "x" (an unreduced array has no host copy).
      return jax.eval_shape(f, a, b).sharding, jax.jit(lambda a, b: jax.reshard(f(a, b), P()))

    lax_ag = lambda v: lax.all_gather(v, "y", axis=0, tiled=True, to="reduced")
    want_type, want = prog(lax_ag)
    assert want_type.spec == P(None, None, unreduced={"x"}, reduced={"y"})
    try:
      expected = bits(want(a, b))
    except ValueError as e:
      # jax 0.12.1 fails to run lax's own program (shard_map's lowering indexes the
      # PartitionSpec of a reduced output); as lax, then, jcoccl raises that error.
      expected = e
    for c in (None, INT8):
      got_type, got = prog(
        lambda v: jcoccl.all_gather(v, "y", tiled=True, to="reduced", compressor=c, min_bytes=0)
      )
      assert got_type == want_type
      if isinstance(expected, ValueError):
        with pytest.raises(ValueError) as raised:
          got(a, b)
        assert str(raised.value).splitlines()[0] == str(expected).splitlines()[0]
      else:
        np.testing.assert_array_equal(bits(got(a, b)), expected)


@pytest.mark.parametrize("op", ["all_gather", "all_to_all", "ppermute"])
def test_unreduced_input_of_other_collectives_raises_lax_error(op):
  calls = {
    "all_gather": (
      lambda v: lax.all_gather(v, "x", tiled=True),
      lambda v: jcoccl.all_gather(v, "x", tiled=True, compressor=INT8, min_bytes=0),
    ),
    "all_to_all": (
      lambda v: lax.all_to_all(v, "x", 0, 0, tiled=True),
      lambda v: jcoccl.all_to_all(v, "x", 0, 0, tiled=True, compressor=INT8, min_bytes=0),
    ),
    "ppermute": (
      lambda v: lax.ppermute(v, "x", [(0, 1)]),
      lambda v: jcoccl.ppermute(v, "x", [(0, 1)], compressor=INT8, min_bytes=0),
    ),
  }
  m = _explicit((8,), ("x",))
  errors = []
  with jax.set_mesh(m):
    a, b = _operands(m)
    for fn in calls[op]:

      def f(a, b, fn=fn):
        z = jnp.einsum("mk,kn->mn", a, b, out_sharding=P(unreduced={"x"}))
        return jax.shard_map(fn, in_specs=P(unreduced={"x"}), out_specs=P("x"))(z)

      with pytest.raises(ValueError) as e:
        jax.jit(f)(a, b)
      errors.append(str(e.value))
  assert errors[1] == errors[0]
  assert "unreduced" in errors[0]


# Bad calls: (where, lax's call, jcoccl's call). "jit": under jit without a shard_map (no axis
# is bound); "smap": inside a shard_map over a (4,) mesh axis "y" of a [32, 64] array.
def _pairs(*pairs):
  yield from pairs


_BAD = {
  "psum_unbound": (
    "jit",
    lambda v: lax.psum(v, "x"),
    lambda v, **k: jcoccl.all_reduce(v, "x", **k),
  ),
  "all_gather_unbound": (
    "jit",
    lambda v: lax.all_gather(v, "x"),
    lambda v, **k: jcoccl.all_gather(v, "x", **k),
  ),
  "all_gather_wrong_name": (
    "smap",
    lambda v: lax.all_gather(v, "x"),
    lambda v, **k: jcoccl.all_gather(v, "x", **k),
  ),
  "psum_scatter_wrong_name": (
    "smap",
    lambda v: lax.psum_scatter(v, "x", tiled=True),
    lambda v, **k: jcoccl.reduce_scatter(v, "x", tiled=True, **k),
  ),
  "all_to_all_wrong_name": (
    "smap",
    lambda v: lax.all_to_all(v, "x", 0, 0, tiled=True),
    lambda v, **k: jcoccl.all_to_all(v, "x", 0, 0, tiled=True, **k),
  ),
  "all_gather_axis": (
    "smap",
    lambda v: lax.all_gather(v, "y", axis=3),
    lambda v, **k: jcoccl.all_gather(v, "y", axis=3, **k),
  ),
  "all_gather_tiled_axis": (
    "smap",
    lambda v: lax.all_gather(v, "y", axis=-3, tiled=True),
    lambda v, **k: jcoccl.all_gather(v, "y", axis=-3, tiled=True, **k),
  ),
  "all_gather_to": (
    "smap",
    lambda v: lax.all_gather(v, "y", to="replicated"),
    lambda v, **k: jcoccl.all_gather(v, "y", to="replicated", **k),
  ),
  "all_gather_float_axis": (
    "smap",
    lambda v: lax.all_gather(v, "y", axis=1.0),
    lambda v, **k: jcoccl.all_gather(v, "y", axis=1.0, **k),
  ),
  "psum_scatter_unbound": (
    "jit",
    lambda v: lax.psum_scatter(v, "x", tiled=True),
    lambda v, **k: jcoccl.reduce_scatter(v, "x", tiled=True, **k),
  ),
  "psum_scatter_dimension": (
    "smap",
    lambda v: lax.psum_scatter(v, "y", scatter_dimension=2, tiled=True),
    lambda v, **k: jcoccl.reduce_scatter(v, "y", scatter_dimension=2, tiled=True, **k),
  ),
  "psum_scatter_not_divisible": (
    "smap",
    lambda v: lax.psum_scatter(v[:3], "y", tiled=True),
    lambda v, **k: jcoccl.reduce_scatter(v[:3], "y", tiled=True, **k),
  ),
  "psum_scatter_untiled_size": (
    "smap",
    lambda v: lax.psum_scatter(v, "y"),
    lambda v, **k: jcoccl.reduce_scatter(v, "y", **k),
  ),
  "psum_scatter_scalar": (
    "smap",
    lambda v: lax.psum_scatter(v.sum(), "y", tiled=True),
    lambda v, **k: jcoccl.reduce_scatter(v.sum(), "y", tiled=True, **k),
  ),
  "all_to_all_unbound": (
    "jit",
    lambda v: lax.all_to_all(v, "x", 0, 0, tiled=True),
    lambda v, **k: jcoccl.all_to_all(v, "x", 0, 0, tiled=True, **k),
  ),
  "all_to_all_split_axis": (
    "smap",
    lambda v: lax.all_to_all(v, "y", 2, 0, tiled=True),
    lambda v, **k: jcoccl.all_to_all(v, "y", 2, 0, tiled=True, **k),
  ),
  "all_to_all_concat_axis": (
    "smap",
    lambda v: lax.all_to_all(v, "y", 0, -3, tiled=True),
    lambda v, **k: jcoccl.all_to_all(v, "y", 0, -3, tiled=True, **k),
  ),
  "all_to_all_not_divisible": (
    "smap",
    lambda v: lax.all_to_all(v[:3], "y", 0, 0, tiled=True),
    lambda v, **k: jcoccl.all_to_all(v[:3], "y", 0, 0, tiled=True, **k),
  ),
  "all_to_all_untiled_size": (
    "smap",
    lambda v: lax.all_to_all(v, "y", 0, 0),
    lambda v, **k: jcoccl.all_to_all(v, "y", 0, 0, **k),
  ),
  "ppermute_unbound": (
    "jit",
    lambda v: lax.ppermute(v, "x", [(0, 1)]),
    lambda v, **k: jcoccl.ppermute(v, "x", [(0, 1)], **k),
  ),
  "ppermute_zip": (
    "smap",
    lambda v: lax.ppermute(v, "y", zip([0, 1], [1, 0])),
    lambda v, **k: jcoccl.ppermute(v, "y", zip([0, 1], [1, 0]), **k),
  ),
  "ppermute_generator": (
    "smap",
    lambda v: lax.ppermute(v, "y", _pairs((0, 1))),
    lambda v, **k: jcoccl.ppermute(v, "y", _pairs((0, 1)), **k),
  ),
  "ppermute_array": (
    "smap",
    lambda v: lax.ppermute(v, "y", np.array([[0, 1]])),
    lambda v, **k: jcoccl.ppermute(v, "y", np.array([[0, 1]]), **k),
  ),
  "ppermute_repeated_source": (
    "smap",
    lambda v: lax.ppermute(v, "y", [(0, 1), (0, 2)]),
    lambda v, **k: jcoccl.ppermute(v, "y", [(0, 1), (0, 2)], **k),
  ),
  "ppermute_repeated_destination_mod_n": (
    "smap",
    lambda v: lax.ppermute(v, "y", [(0, 1), (2, -3)]),
    lambda v, **k: jcoccl.ppermute(v, "y", [(0, 1), (2, -3)], **k),
  ),
  "ppermute_out_of_range": (
    "smap",
    lambda v: lax.ppermute(v, "y", [(0, 4)]),
    lambda v, **k: jcoccl.ppermute(v, "y", [(0, 4)], **k),
  ),
  "ppermute_below_range": (
    "smap",
    lambda v: lax.ppermute(v, "y", [(-5, 0)]),
    lambda v, **k: jcoccl.ppermute(v, "y", [(-5, 0)], **k),
  ),
  "ppermute_float_index": (
    "smap",
    lambda v: lax.ppermute(v, "y", [(0.0, 1)]),
    lambda v, **k: jcoccl.ppermute(v, "y", [(0.0, 1)], **k),
  ),
  "ppermute_triple": (
    "smap",
    lambda v: lax.ppermute(v, "y", [(0, 1, 2)]),
    lambda v, **k: jcoccl.ppermute(v, "y", [(0, 1, 2)], **k),
  ),
}


@pytest.fixture(scope="module")
def y4():
  """A (4,) mesh "y" and a float32 [32, 64] array split over it."""
  m = jax.make_mesh((4,), ("y",), devices=jax.devices()[:4])
  return m, jax.device_put(rand((32, 64), jnp.float32, seed=5), jax.NamedSharding(m, P("y")))


def _error(fn, where, m, x):
  """What jit(fn) raises on x (None if it runs): under jit alone or inside a shard_map."""
  if where == "smap":
    fn = jax.shard_map(fn, mesh=m, in_specs=P("y"), out_specs=P("y"))
  try:
    jax.jit(fn)(x)
  except Exception as e:
    return e
  return None


@pytest.mark.parametrize("case", list(_BAD))
def test_bad_call_raises_lax_error(case, y4):
  """The error lax raises for the call (its type; its message first), exact or compressed,
  with jcoccl's words after: which argument, what is accepted."""
  where, lax_fn, jc_fn = _BAD[case]
  want = _error(lax_fn, where, *y4)
  assert want is not None, f"lax accepts {case}"
  for kw in ({}, dict(compressor="int8", min_bytes=0)):
    got = _error(lambda v, kw=kw: jc_fn(v, **kw), where, *y4)
    assert isinstance(got, type(want)), (case, kw, repr(got), repr(want))
    assert str(got).startswith(str(want)), (case, kw, str(got), str(want))
    assert len(str(got)) > len(str(want)) + 10, f"no jcoccl hint after lax's words: {got}"


@pytest.mark.parametrize("op", ["psum", "ppermute"])
def test_wrong_axis_name_inside_shard_map(op, y4):
  """An axis name the shard_map's mesh lacks: lax's psum and ppermute fail an internal
  assertion there in JAX 0.11 (no answer to give a user), so jcoccl's error is a NameError
  in lax's words for an unbound name (lax's own, where lax gives one)."""
  lax_fn, jc_fn = {
    "psum": (lambda v: lax.psum(v, "x"), lambda v: jcoccl.all_reduce(v, "x", compressor="int8")),
    "ppermute": (
      lambda v: lax.ppermute(v, "x", [(0, 1)]),
      lambda v: jcoccl.ppermute(v, "x", [(0, 1)], compressor="int8"),
    ),
  }[op]
  want, got = _error(lax_fn, "smap", *y4), _error(jc_fn, "smap", *y4)
  assert isinstance(got, NameError) and isinstance(got, ValueError)
  if isinstance(want, AssertionError):
    assert str(got).startswith("unbound axis name: x\n"), str(got)
  else:
    assert isinstance(got, type(want)) and str(got).startswith(str(want))
  assert "axis_name 'x'" in str(got)


def test_jax_shard_map_tests_error_text():
  """The texts JAX's shard_map tests assert (test_psum_not_under_shmap_error,
  test_ppermute_zip_error), run through jcoccl."""
  with pytest.raises(
    NameError,
    match="Found an unbound axis name: x. To fix this, please call psum under `jax.shard_map`",
  ):
    jax.jit(lambda v: jcoccl.all_reduce(v, "x", compressor="int8"))(jnp.arange(8.0))
  with jax.set_mesh(_explicit((2,), ("x",))):
    arr = jax.device_put(np.arange(8), P("x"))
    f = jax.shard_map(lambda v: jcoccl.ppermute(v, "x", zip([0, 1], [1, 0])), out_specs=P("x"))
    with pytest.raises(TypeError, match="`perm` passed to `jax.lax.ppermute` must be a list"):
      f(arr)


def test_calls_lax_accepts_run_as_lax(y4):
  """An empty axis tuple (every op: the lax op over no axis), ppermute pairs lax reads
  modulo the group (negative indices), as numpy ints or lists, and tiled=1: jcoccl's
  results are lax's."""
  m, x = y4
  perms = ([(-1, 0), (0, -3)], [[np.int64(3), np.int32(0)]], ((0, 1), (1, 2), (2, 3), (3, 0)))

  def body(ops):
    psum, ag, rs, a2a, pp = ops
    return lambda v: (
      psum(v, ()),
      ag(v, (), tiled=True),
      rs(v, (), tiled=True),
      a2a(v, ()),
      pp(v, (), [(0, 0)]),
      *(pp(v, "y", p) for p in perms),
      ag(v, "y", tiled=1),
      rs(v, "y", tiled=1),
    )

  lax_ops = (
    lax.psum,
    lax.all_gather,
    lax.psum_scatter,
    lambda v, a: lax.all_to_all(v, a, 0, 0, tiled=True),
    lax.ppermute,
  )
  k = dict(compressor=INT8, min_bytes=0)
  jc_ops = (
    lambda v, a: jcoccl.all_reduce(v, a, **k),
    lambda v, a, tiled: jcoccl.all_gather(v, a, tiled=tiled, **k if a == () else {}),
    lambda v, a, tiled: jcoccl.reduce_scatter(v, a, tiled=tiled, **k if a == () else {}),
    lambda v, a: jcoccl.all_to_all(v, a, 0, 0, tiled=True, **k),
    lambda v, a, p: jcoccl.ppermute(v, a, p),  # exact: bitwise lax's
  )
  run = lambda ops: jax.jit(jax.shard_map(body(ops), mesh=m, in_specs=P("y"), out_specs=P("y")))(x)
  want, got = run(lax_ops), run(jc_ops)
  for i, (g, w) in enumerate(zip(got, want)):
    assert g.shape == w.shape, i
    np.testing.assert_array_equal(bits(g), bits(w), err_msg=str(i))


def test_vmap_of_a_shard_map_psum_of_integers_as_lax():
  """JAX's test_vmap_shmap_psum: an int32 array summed over "y" inside a vmapped
  shard_map. The exact op, a pytree with a compressor (the integer leaf goes exactly) and
  jcoccl.compress with an int8 policy give lax's values and output sharding."""
  m = _explicit((2, 2), ("x", "y"))
  with jax.set_mesh(m):
    arr = jax.device_put(jnp.arange(16, dtype=jnp.int32).reshape(2, 8), P("x", "y"))
    smap = lambda body: jax.shard_map(body, in_specs=P("y"), out_specs=P(None))
    lax_f = smap(lambda v: lax.psum(v, "y"))
    want = jax.vmap(lax_f)(arr)
    runs = {
      "exact": jax.vmap(smap(lambda v: jcoccl.all_reduce(v, "y"))),
      "tree": jax.vmap(
        smap(lambda v: jcoccl.all_reduce([v], "y", compressor=INT8, min_bytes=0)[0])
      ),
      "compress": jax.vmap(jcoccl.compress(lax_f, {"y": {"all_reduce": "int8", "min_bytes": 0}})),
    }
    for name, f in runs.items():
      for g in (f, jax.jit(f)):
        got = g(arr)
        assert got.dtype == want.dtype and got.sharding == want.sharding, name
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert want.sharding.spec == P("x", None)


def _vmapped_int32(m, op):
  """JAX's test_vmap_shmap_psum for ``op``: an int32 [2, 8] array over ("x", "y"), vmapped
  over its rows (split over "x"), the collective over "y" (size 2) inside the shard_map.
  Returns the lax program and jcoccl's (a pytree with int8, whose integer leaf goes
  exactly; jcoccl.compress of the lax program with an int8 policy)."""
  lax_body, out = {
    "psum": (lambda v: lax.psum(v, "y"), P(None)),
    "all_gather": (lambda v: lax.all_gather(v, "y", tiled=True), P("y")),
    "psum_scatter": (lambda v: lax.psum_scatter(v, "y", tiled=True), P("y")),
    "all_to_all": (lambda v: lax.all_to_all(v, "y", 0, 0, tiled=True), P("y")),
    "ppermute": (lambda v: lax.ppermute(v, "y", [(0, 1), (1, 0)]), P("y")),
  }[op]
  name = {"psum": "all_reduce", "psum_scatter": "reduce_scatter"}.get(op, op)
  jc = getattr(jcoccl, name)
  args = {
    "psum": (),
    "all_gather": (),
    "psum_scatter": (),
    "all_to_all": (0, 0),
    "ppermute": ([(0, 1), (1, 0)],),
  }[op]
  kw = dict(tiled=True) if op in ("all_gather", "psum_scatter", "all_to_all") else {}
  smap = lambda body: jax.shard_map(body, in_specs=P("y"), out_specs=out)
  lax_f = smap(lax_body)
  tree = smap(lambda v: jc([v], "y", *args, compressor=INT8, min_bytes=0, **kw)[0])
  comp = jcoccl.compress(lax_f, {"y": {name: "int8", "min_bytes": 0}})
  return lax_f, {"tree": tree, "compress": comp}


@pytest.mark.parametrize("op", ["all_gather", "psum_scatter", "all_to_all", "ppermute"])
def test_vmap_of_a_shard_map_collective_of_integers_as_lax(op):
  """The other ops in JAX's test_vmap_shmap_psum: the same outcome as lax's, values
  bitwise and output sharding, or lax's error where lax itself fails (JAX 0.11's
  psum_scatter there)."""
  m = _explicit((2, 2), ("x", "y"))
  with jax.set_mesh(m):
    arr = jax.device_put(jnp.arange(16, dtype=jnp.int32).reshape(2, 8), P("x", "y"))
    lax_f, runs = _vmapped_int32(m, op)
    try:
      want = jax.jit(jax.vmap(lax_f))(arr)
    except Exception as e:
      want = e
    for name, f in runs.items():
      if isinstance(want, Exception):
        with pytest.raises(type(want)) as got:
          jax.jit(jax.vmap(f))(arr)
        assert str(got.value) == str(want), name
        continue
      got = jax.jit(jax.vmap(f))(arr)
      assert got.dtype == want.dtype and got.sharding == want.sharding, name
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_decode_sum_of_rows_split_over_an_explicit_mesh_axis(codec):
  """The fold of issue 35 item 8 ("slicing on sharded dims where out dim (1) is not
  divisible by mesh axes (2)"): payload rows split over an explicit mesh axis of 2 devices
  sum as the same rows whole, bitwise: eager, jitted and vmapped over a split batch. The
  none codec's payload is a bitcast, split as its operand is; int32 for it (exact)."""
  c = jc.parse(codec)
  dtype = jnp.int32 if codec == "none" else jnp.float32
  x = np.asarray(rand((2, 2, 256), jnp.float32, seed=6) * 100).astype(dtype)
  bufs = np.stack([np.asarray(c.encode_rows(jnp.asarray(r))) for r in x])
  fold = lambda b: c.decode_sum(b, 256, dtype)
  want = np.stack([np.asarray(fold(jnp.asarray(b))) for b in bufs])
  with jax.set_mesh(_explicit((2, 2), ("x", "y"))):
    if codec == "none":
      split = c.encode_rows(jax.device_put(x[0], P("x")))
      assert jax.typeof(split).sharding.spec[0] == "x"
    else:
      split = jax.device_put(bufs[0], P("x"))
    for got in (fold(split), jax.jit(fold)(split)):
      np.testing.assert_array_equal(bits(got), bits(want[0]))
    got = jax.jit(jax.vmap(fold))(jax.device_put(bufs, P(None, "x")))
    np.testing.assert_array_equal(bits(got), bits(want))

"""Cases from JAX's own shard_map tests, each against what lax itself does there: inputs
unreduced over the collective's axes (psum_scatter sums them; all_gather(to="reduced")
keeps other axes unreduced; the gathers, exchanges and permutes raise lax's error), a
`zip` iterator as a ppermute perm (TypeError), unbound axis names (NameError) and a vmap
of a shard_map whose psum operand is an integer array."""

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
    for c in (None, INT8):
      got_type, got = prog(
        lambda v: jcoccl.all_gather(v, "y", tiled=True, to="reduced", compressor=c, min_bytes=0)
      )
      assert got_type == want_type
      np.testing.assert_array_equal(bits(got(a, b)), bits(want(a, b)))


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


def test_zip_perm_is_a_type_error_as_lax():
  m = _explicit((2,), ("x",))
  with jax.set_mesh(m):
    arr = jax.device_put(np.arange(8.0, dtype=np.float32), P("x"))
    for fn in (
      lambda v, p: lax.ppermute(v, "x", p),
      lambda v, p: jcoccl.ppermute(v, "x", p),
      lambda v, p: jcoccl.ppermute(v, "x", p, compressor=INT8, min_bytes=0),
    ):
      f = jax.shard_map(lambda v: fn(v, zip([0, 1], [1, 0])), out_specs=P("x"))
      with pytest.raises(TypeError, match="`perm` passed to .* must be a list or a tuple"):
        f(arr)
    # A list of the same pairs runs.
    got = jax.shard_map(lambda v: jcoccl.ppermute(v, "x", [(0, 1), (1, 0)]), out_specs=P("x"))(arr)
    np.testing.assert_array_equal(np.asarray(got), np.r_[np.arange(4.0, 8), np.arange(4.0)])


_EVERY_OP = {
  "psum": (lambda v: lax.psum(v, "x"), lambda v: jcoccl.all_reduce(v, "x", compressor=INT8)),
  "all_gather": (lambda v: lax.all_gather(v, "x"), lambda v: jcoccl.all_gather(v, "x")),
  "psum_scatter": (
    lambda v: lax.psum_scatter(v, "x", tiled=True),
    lambda v: jcoccl.reduce_scatter(v, "x", tiled=True, compressor=INT8),
  ),
  "all_to_all": (
    lambda v: lax.all_to_all(v, "x", 0, 0, tiled=True),
    lambda v: jcoccl.all_to_all(v, "x", 0, 0, tiled=True),
  ),
  "ppermute": (
    lambda v: lax.ppermute(v, "x", [(0, 1)]),
    lambda v: jcoccl.ppermute(v, "x", [(0, 1)], compressor=INT8),
  ),
}


@pytest.mark.parametrize("op", list(_EVERY_OP))
def test_unbound_axis_name_is_a_name_error_as_lax(op):
  """An axis name bound nowhere (jit without shard_map): NameError naming it, as lax's.
  Inside a shard_map whose mesh lacks the name jcoccl's is a NameError too (lax's psum and
  ppermute fail an internal assertion there)."""
  x = jnp.arange(16.0, dtype=jnp.float32)
  lax_fn, jc_fn = _EVERY_OP[op]
  for fn in (lax_fn, jc_fn):
    with pytest.raises(NameError, match="unbound axis name: x"):
      jax.jit(fn)(x)
  with jax.set_mesh(_explicit((2,), ("y",))):
    f = jax.jit(jax.shard_map(jc_fn, in_specs=P("y"), out_specs=P("y")))
    with pytest.raises(NameError, match="'x'"):
      f(jax.device_put(x, P("y")))


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

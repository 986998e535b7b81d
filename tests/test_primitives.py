"""The collectives as JAX primitives: readable jaxprs, the duals table, jvp, vmap, remat,
scan, hessian, and the drop-in cases of lax users."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from collectives_util import P, assert_within, bits, eb, f64, host_rand, mesh
from jax import lax

import jcoccl
from jcoccl import compressors as jc
from jcoccl._src.ops import primitives

INT8 = jc.int8(block_size=32)
PERM = [(0, 1), (1, 2), (2, 3), (3, 0)]

# op name -> (jcoccl call, the lax op with the same semantics), over axis "b" of size 4.
OPS = {
  "all_reduce": (lambda v, **k: jcoccl.all_reduce(v, "b", **k), lambda v: lax.psum(v, "b")),
  "all_gather": (
    lambda v, **k: jcoccl.all_gather(v, "b", axis=1, tiled=True, **k),
    lambda v: lax.all_gather(v, "b", axis=1, tiled=True),
  ),
  "reduce_scatter": (
    lambda v, **k: jcoccl.reduce_scatter(v, "b", scatter_dimension=1, tiled=True, **k),
    lambda v: lax.psum_scatter(v, "b", scatter_dimension=1, tiled=True),
  ),
  "all_to_all": (
    lambda v, **k: jcoccl.all_to_all(v, "b", 1, 0, tiled=True, **k),
    lambda v: lax.all_to_all(v, "b", 1, 0, tiled=True),
  ),
  "ppermute": (
    lambda v, **k: jcoccl.ppermute(v, "b", PERM, **k),
    lambda v: lax.ppermute(v, "b", PERM),
  ),
}
_M = {}


def _mesh():
  if "m" not in _M:
    _M["m"] = mesh((2, 4), ("a", "b"))
  return _M["m"]


def _smap(body, check_vma=True, out_specs=None):
  spec = P(("a", "b"))
  return jax.shard_map(
    body,
    mesh=_mesh(),
    in_specs=spec,
    out_specs=spec if out_specs is None else out_specs,
    check_vma=check_vma,
  )


def _eqns(jaxpr):
  """Every equation, recursively through sub-jaxprs."""
  for e in jaxpr.eqns:
    yield e
    for v in e.params.values():
      subs = v if isinstance(v, tuple) else (v,)
      for s in subs:
        inner = getattr(s, "jaxpr", s)
        if hasattr(inner, "eqns"):
          yield from _eqns(inner)


def _names(fn, *args):
  return [e.primitive.name for e in _eqns(jax.make_jaxpr(fn)(*args).jaxpr)]


def test_jaxpr_shows_one_readable_equation_per_call():
  x = host_rand((8, 8, 64), jnp.float32, seed=1)
  body = lambda v: jcoccl.all_reduce(v, "b", compressor="int8", algorithm="two_shot", min_bytes=0)
  jaxpr = jax.make_jaxpr(_smap(body, out_specs=P("a")))(x)  # invariant over "b"
  inner = [e for e in _eqns(jaxpr.jaxpr) if e.primitive.name != "shard_map"]
  assert [e.primitive.name for e in inner] == ["jcoccl_all_reduce"]
  text = str(jaxpr)
  for part in (
    "jcoccl_all_reduce[",
    "algorithm=two_shot",
    "axes=('b',)",
    "compressor=int8",
    "grad_compressor=int8",
    "backend=xla",
    "chunks=1",
    "min_bytes=0",
  ):
    assert part in text, part
  hash(tuple(sorted(inner[0].params.items())))  # params are hashable
  for name, (j, _) in OPS.items():
    out_specs = P("a") if name == "all_reduce" else None
    names = _names(_smap(lambda v: j(v, compressor=INT8, min_bytes=0), out_specs=out_specs), x)
    assert names == ["shard_map", f"jcoccl_{name}"], names


def test_duals_table():
  assert primitives.DUALS == {
    "all_reduce": "all_reduce",
    "all_gather": "reduce_scatter",
    "reduce_scatter": "all_gather",
    "all_to_all": "all_to_all",
    "ppermute": "ppermute",
  }
  x = host_rand((8, 8, 64), jnp.float32, seed=2)
  for name, (j, _) in OPS.items():
    loss = lambda v: jnp.sum(
      _smap(lambda u: j(u, compressor=INT8, min_bytes=0), check_vma=False)(v) ** 2
    )
    names = _names(jax.grad(loss), x)
    dual = primitives.DUALS[name]
    assert names.count(f"jcoccl_{dual}") == (2 if dual == name else 1), (name, names)
  # The dual's parameters: swapped axes, inverted permutation.
  a2a = lambda v: jcoccl.all_to_all(v, "b", 1, 0, tiled=True, compressor=INT8, min_bytes=0)
  eq = [
    e
    for e in _eqns(jax.make_jaxpr(jax.grad(lambda v: jnp.sum(_smap(a2a)(v) ** 2)))(x).jaxpr)
    if e.primitive.name == "jcoccl_all_to_all"
  ]
  assert [(e.params["split_axis"], e.params["concat_axis"]) for e in eq] == [(1, 0), (0, 1)]
  pp = lambda v: jcoccl.ppermute(v, "b", PERM, compressor=INT8, min_bytes=0)
  eq = [
    e
    for e in _eqns(jax.make_jaxpr(jax.grad(lambda v: jnp.sum(_smap(pp)(v) ** 2)))(x).jaxpr)
    if e.primitive.name == "jcoccl_ppermute"
  ]
  assert [e.params["perm"] for e in eq] == [tuple(PERM), tuple((d, s) for s, d in PERM)]


@pytest.mark.parametrize("op", list(OPS))
def test_jvp_matches_lax(op):
  """The tangent goes through the same collective with grad_compressor: exact (None) is
  lax's jvp bit for bit; int8 is the compressed op applied to the tangent."""
  j, l = OPS[op]
  x, t = host_rand((8, 8, 64), jnp.float32, seed=3), host_rand((8, 8, 64), jnp.float32, seed=4)
  f = lambda **k: jax.jit(
    lambda a, b: jax.jvp(_smap(lambda v: j(v, compressor=INT8, min_bytes=0, **k)), (a,), (b,))
  )
  y, ty = f(grad_compressor=None)(x, t)
  _, lty = jax.jit(lambda a, b: jax.jvp(_smap(l), (a,), (b,)))(x, t)
  np.testing.assert_array_equal(bits(ty), bits(lty))
  direct = jax.jit(_smap(lambda v: j(v, compressor=INT8, min_bytes=0)))
  np.testing.assert_array_equal(bits(y), bits(direct(x)))
  y2, ty2 = f()(x, t)
  np.testing.assert_array_equal(bits(y2), bits(y))
  np.testing.assert_array_equal(bits(ty2), bits(direct(t)))


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("chunks", [1, 2])
def test_vmap_is_bitwise_a_loop_of_single_calls(op, chunks):
  j, _ = OPS[op]
  x = host_rand((8, 3, 2, 64), jnp.float32, seed=5)  # per rank: a batch of 3 [2, 64] messages
  call = lambda v: j(v, compressor=INT8, min_bytes=0, chunks=chunks)
  batched = jax.jit(_smap(lambda v: jax.vmap(call)(v[0])[None]))
  names = _names(_smap(lambda v: jax.vmap(call)(v[0])[None]), x)
  assert names.count(f"jcoccl_{op}") == 1  # one batched call, not one per element
  single = jax.jit(_smap(lambda v: call(v[0])[None]))
  got = batched(x)
  for i in range(3):
    np.testing.assert_array_equal(bits(got[:, i]), bits(single(x[:, i])))


def test_vmap_of_vmap_and_of_grad():
  x = host_rand((8, 2, 3, 64), jnp.float32, seed=6)
  call = lambda v: jcoccl.all_reduce(v, "b", compressor=INT8, min_bytes=0)
  two = jax.jit(_smap(lambda v: jax.vmap(jax.vmap(call))(v[0])[None]))(x)
  one = jax.jit(_smap(lambda v: call(v[0])[None]))
  for i in range(2):
    for k in range(3):
      np.testing.assert_array_equal(bits(two[:, i, k]), bits(one(x[:, i, k])))
  grad = lambda v: jax.grad(lambda u: jnp.sum(jnp.sin(call(u))))(v)
  gb = jax.jit(_smap(lambda v: jax.vmap(grad)(v[0])[None]))(x[:, 0])
  g1 = jax.jit(_smap(lambda v: grad(v[0])[None]))
  for k in range(3):
    np.testing.assert_array_equal(bits(gb[:, k]), bits(g1(x[:, 0, k])))


def test_remat_and_scan():
  x = host_rand((8, 4, 128), jnp.float32, seed=7)
  call = lambda v: jnp.sin(jcoccl.all_reduce(v, "b", compressor=INT8, min_bytes=0))

  def loss(fn):
    return lambda a: jnp.sum(_smap(lambda v: fn(v[0])[None])(a))

  g = jax.jit(jax.grad(loss(call)))(x)
  gr = jax.jit(jax.grad(loss(jax.checkpoint(call))))(x)
  np.testing.assert_array_equal(bits(g), bits(gr))

  ys = jax.jit(_smap(lambda v: lax.scan(lambda c, r: (c, call(r)), 0.0, v[0])[1][None]))(x)
  one = jax.jit(_smap(lambda v: call(v[0])[None]))
  for i in range(4):
    np.testing.assert_array_equal(bits(ys[:, i]), bits(one(x[:, i])))
  gs = jax.jit(
    jax.grad(
      lambda a: jnp.sum(_smap(lambda v: lax.scan(lambda c, r: (c, call(r)), 0.0, v[0])[1][None])(a))
    )
  )(x)
  np.testing.assert_array_equal(bits(gs), bits(g))


def test_hessian_through_a_native_codec():
  """Second-order AD: the tangent of an int8 all_reduce is an exact one with
  grad_compressor=None, so the hessian of sum(y**2) is lax's bit for bit."""
  x = host_rand((8, 32), jnp.float32, seed=8)
  m = mesh((8,), ("d",))

  def loss(body):
    return lambda a: jnp.sum(
      jax.shard_map(lambda v: body(v) ** 2, mesh=m, in_specs=P("d"), out_specs=P("d"))(a)
    )

  h = jax.jit(
    jax.hessian(
      loss(lambda v: jcoccl.all_reduce(v, "d", compressor=INT8, grad_compressor=None, min_bytes=0))
    )
  )(x)
  hl = jax.jit(jax.hessian(loss(lambda v: lax.psum(v, "d"))))(x)
  np.testing.assert_array_equal(bits(h), bits(hl))
  h8 = jax.jit(
    jax.hessian(loss(lambda v: jcoccl.all_reduce(v, "d", compressor=INT8, min_bytes=0)))
  )(x)
  assert np.isfinite(np.asarray(h8)).all() and h8.shape == (8, 32, 8, 32)


# ----------------------------------------------------------------------------------------
# Drop-in cases.


def test_vmap_axis_name_runs_exactly():
  v = host_rand((4, 64), jnp.float32, seed=9)
  got = jax.vmap(
    lambda r: jcoccl.all_reduce(r, "b", compressor="int8", min_bytes=0), axis_name="b"
  )(v)
  want = jax.vmap(lambda r: lax.psum(r, "b"), axis_name="b")(v)
  np.testing.assert_array_equal(bits(got), bits(want))
  got = jax.vmap(
    lambda r: jcoccl.all_gather(r, "b", compressor="int8", min_bytes=0), axis_name="b"
  )(v)
  want = jax.vmap(lambda r: lax.all_gather(r, "b"), axis_name="b")(v)
  np.testing.assert_array_equal(bits(got), bits(want))
  got = jax.vmap(
    lambda r: jcoccl.ppermute(r, "b", PERM, compressor="int8", min_bytes=0), axis_name="b"
  )(v)
  want = jax.vmap(lambda r: lax.ppermute(r, "b", PERM), axis_name="b")(v)
  np.testing.assert_array_equal(bits(got), bits(want))


def test_unbound_axis_name_is_a_name_error():
  x = host_rand((8, 64), jnp.float32)
  for j in (
    lambda v: jcoccl.all_reduce(v, "nope", compressor="int8"),
    lambda v: jcoccl.all_gather(v, "nope"),
    lambda v: jcoccl.ppermute(v, "nope", [(0, 1)]),
  ):
    with pytest.raises(NameError, match="nope"):
      jax.jit(jax.shard_map(j, mesh=mesh((8,), ("d",)), in_specs=P("d"), out_specs=P("d")))(x)
    with pytest.raises(NameError):
      j(x)


@pytest.mark.parametrize("dtype", ["int32", "bool", "float64"])
def test_exact_compressor_on_other_dtypes_is_lax(dtype):
  with jax.enable_x64(dtype == "float64"):
    x = (jnp.arange(8 * 8 * 64) % 5).reshape(8, 8, 64).astype(dtype)
    assert x.dtype == np.dtype(dtype)
    for name, (j, l) in OPS.items():
      if dtype == "bool" and name in ("all_reduce", "reduce_scatter"):
        continue  # lax sums no bools either
      got = jax.jit(_smap(lambda v: j(v, compressor="none", min_bytes=0)))(x)
      want = jax.jit(_smap(l))(x)
      assert got.dtype == want.dtype
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_pytree_with_integer_leaves_compresses_only_the_floats():
  x = host_rand((8, 8, 64), jnp.float32, seed=10)
  step = jnp.arange(8, dtype=jnp.int32).reshape(8, 1, 1) * jnp.ones((1, 8, 64), jnp.int32)
  tree = {"g": x, "step": step}
  got = jax.jit(_smap(lambda t: jcoccl.all_reduce(t, "b", compressor=INT8, min_bytes=0)))(tree)
  lone = jax.jit(_smap(lambda v: jcoccl.all_reduce(v, "b", compressor=INT8, min_bytes=0)))(x)
  want_step = jax.jit(_smap(lambda v: lax.psum(v, "b")))(step)
  np.testing.assert_array_equal(bits(got["g"]), bits(lone))
  np.testing.assert_array_equal(np.asarray(got["step"]), np.asarray(want_step))
  with pytest.raises(TypeError, match="int32"):  # a lone integer array is a mistake
    jax.jit(_smap(lambda v: jcoccl.all_reduce(v, "b", compressor=INT8, min_bytes=0)))(step)


def test_all_gather_to_invarying():
  x = host_rand((8, 8, 64), jnp.float32, seed=11)
  for c, exact in ((None, True), (INT8, False)):
    body = lambda v: jcoccl.all_gather(
      v, "b", axis=0, tiled=True, to="invarying", compressor=c, min_bytes=0
    )
    got = jax.jit(_smap(body, out_specs=P("a")))(x)  # typed invariant over "b"
    plain = jax.jit(
      _smap(lambda v: jcoccl.all_gather(v, "b", axis=0, tiled=True, compressor=c, min_bytes=0))
    )(x)
    # Rank (a, b)'s gather is plain's block 4a + b; the invariant result holds b = 0's.
    np.testing.assert_array_equal(
      bits(got), bits(plain.reshape(2, 4, 4, 8, 64)[:, 0].reshape(8, 8, 64))
    )
    loss = lambda to: (
      lambda a: jnp.sum(
        jnp.sin(
          _smap(
            lambda v: jcoccl.all_gather(
              v, "b", axis=0, tiled=True, to=to, compressor=c, min_bytes=0
            ),
            out_specs=P("a"),
          )(a)
        )
      )
    )
    g = jax.jit(jax.grad(loss("invarying")))(x)
    gl = jax.jit(
      jax.grad(
        lambda a: jnp.sum(
          jnp.sin(
            _smap(
              lambda v: lax.all_gather(v, "b", axis=0, tiled=True, to="invarying"), out_specs=P("a")
            )(a)
          )
        )
      )
    )(x)
    if exact:
      np.testing.assert_array_equal(bits(g), bits(gl))
    else:  # cos of a decoded value: |d cos| <= |x - decoded| <= the int8 bound
      bound = np.concatenate([eb(INT8, x[r]) for r in range(8)]).reshape(x.shape)
      assert_within(g, f64(gl), bound, "all_gather to=invarying grad")


def test_axis_index_groups_run_the_exact_lax_op():
  m = mesh((8,), ("d",))
  groups = [[0, 1, 2, 3], [4, 5, 6, 7]]
  x = host_rand((8, 64), jnp.float32, seed=12)
  run = lambda body: jax.jit(
    jax.shard_map(
      lambda v: body(v[0])[None], mesh=m, in_specs=P("d"), out_specs=P("d"), check_vma=False
    )
  )(x)
  cases = [
    (
      lambda v: jcoccl.all_reduce(v, "d", compressor="int8", axis_index_groups=groups),
      lambda v: lax.psum(v, "d", axis_index_groups=groups),
    ),
    (
      lambda v: jcoccl.all_gather(v, "d", compressor="int8", axis_index_groups=groups),
      lambda v: lax.all_gather(v, "d", axis_index_groups=groups),
    ),
  ]
  for j, l in cases:
    try:
      want = run(l)
    except NotImplementedError:
      with pytest.raises(NotImplementedError):
        run(j)
      continue
    np.testing.assert_array_equal(bits(run(j)), bits(want))


def test_partial_auto_shard_map_ppermute():
  """shard_map over "i" with "j" left Auto and a sharding constraint inside."""
  m = jax.make_mesh((4, 2), ("i", "j"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  x = host_rand((8, 256), jnp.float32, seed=13)
  perm = [(k, k + 1) for k in range(3)]  # rank 0 receives nothing: zeros

  def run(fn):
    body = lambda v: fn(lax.with_sharding_constraint(v, P(None, "j")))
    return jax.jit(
      jax.shard_map(body, mesh=m, in_specs=P("i"), out_specs=P("i"), axis_names={"i"})
    )(x)

  want = run(lambda v: lax.ppermute(v, "i", perm))
  np.testing.assert_array_equal(bits(run(lambda v: jcoccl.ppermute(v, "i", perm))), bits(want))
  got = run(lambda v: jcoccl.ppermute(v, "i", perm, compressor=INT8, min_bytes=0))
  np.testing.assert_array_equal(f64(got[:2]), 0.0)
  bound = np.concatenate([eb(INT8, x[2 * r : 2 * r + 2]) for r in range(3)])
  assert_within(got[2:], f64(want[2:]), bound, "partial-auto ppermute")


def test_unreduced_input_as_lax_psum():
  """A value unreduced over "x" (an einsum's partial sums) is summed as lax.psum sums it:
  exactly without a compressor, within int8's one_shot bound with one; its cotangent is
  typed reduced, as lax's."""
  mesh_x = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
  a_np = np.asarray(host_rand((16, 64), jnp.float32, seed=14))
  b_np = np.asarray(host_rand((64, 256), jnp.float32, seed=15))
  c = jc.int8()

  def prog(fn):
    def f(a, b):
      part = jnp.einsum("mk,kn->mn", a, b, out_sharding=P(unreduced={"x"}))
      return jax.shard_map(fn, in_specs=P(unreduced={"x"}), out_specs=P())(part)

    return f

  with jax.set_mesh(mesh_x):
    a = jax.device_put(a_np, P(None, "x"))
    b = jax.device_put(b_np, P("x", None))
    want = jax.jit(prog(lambda v: lax.psum(v, "x")))(a, b)
    exact = jax.jit(prog(lambda v: jcoccl.all_reduce(v, "x", min_bytes=0)))(a, b)
    np.testing.assert_array_equal(bits(exact), bits(want))
    ar8 = lambda v: jcoccl.all_reduce(v, "x", compressor=c, algorithm="one_shot", min_bytes=0)
    got = jax.jit(prog(ar8))(a, b)
    loss = lambda fn: jax.jit(jax.grad(lambda a, b: jnp.sum(jnp.sin(prog(fn)(a, b)))))
    ga = loss(ar8)(a, b)
    ga_lax = loss(lambda v: lax.psum(v, "x"))(a, b)
  parts = np.stack(
    [a_np[:, 8 * r : 8 * r + 8].astype(np.float64) @ b_np[8 * r : 8 * r + 8] for r in range(8)]
  )
  # Each device's partial comes from a float32 matmul, not the float64 one above: bound
  # its rounding too (8 products summed: 8 eps of the |a| |b| products, generously).
  mm = (
    np.stack(
      [
        np.abs(a_np[:, 8 * r : 8 * r + 8]).astype(np.float64) @ np.abs(b_np[8 * r : 8 * r + 8])
        for r in range(8)
      ]
    )
    * 8
    * 2.0**-24
  )
  per = np.stack([eb(c, jnp.asarray(p, jnp.float32)) for p in parts])
  bound = (per + mm).sum(0) + 8 * 2.0**-24 * (np.abs(parts).sum(0) + per.sum(0))
  assert_within(got, f64(want), bound + mm.sum(0), "unreduced int8 all_reduce")
  # d/da sum(sin(y)) = cos(y) @ b.T: |cos(y) - cos(y')| <= |y - y'|.
  gbound = (bound + mm.sum(0)) @ np.abs(b_np).T.astype(np.float64)
  gbound += 64 * 2.0**-24 * (np.ones_like(bound) @ np.abs(b_np).T)  # matmul rounding
  assert_within(ga, f64(ga_lax), gbound, "unreduced int8 all_reduce grad")


def test_vmap_with_a_key_is_a_loop_of_single_calls():
  """Stochastic rounding draws its random stream per call: vmap with a key runs one call
  per element (mapped or shared key), each bitwise the single call."""
  c = jc.int8(block_size=32, rounding="stochastic")
  x = host_rand((8, 3, 64), jnp.float32, seed=16)
  keys = jax.random.split(jax.random.key(5), 3)
  call = lambda v, k: jcoccl.all_reduce(v, "b", compressor=c, min_bytes=0, key=k)
  got = jax.jit(_smap(lambda v: jax.vmap(call)(v[0], keys)[None]))(x)
  shared = jax.jit(_smap(lambda v: jax.vmap(call, (0, None))(v[0], keys[0])[None]))(x)
  # The single call takes its key as an argument: one program for all six calls.
  spec = P(("a", "b"))
  single = jax.jit(
    jax.shard_map(
      lambda v, k: call(v[0], k)[None], mesh=_mesh(), in_specs=(spec, P()), out_specs=spec
    )
  )
  for i in range(3):
    np.testing.assert_array_equal(bits(got[:, i]), bits(single(x[:, i], keys[i])))
    np.testing.assert_array_equal(bits(shared[:, i]), bits(single(x[:, i], keys[0])))


def test_vmap_with_spmd_axis_name_as_lax():
  """vmap of a shard_map over "b" with the batch sharded over "a" (spmd_axis_name): each
  element bitwise its own call, as lax.psum's."""
  m = jax.make_mesh((2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  x = host_rand((2, 4 * 64), jnp.float32, seed=17)
  for body in (
    lambda v: lax.psum(v, "b"),
    lambda v: jcoccl.all_reduce(v, "b", compressor=INT8, min_bytes=0),
  ):
    f = jax.shard_map(body, mesh=m, in_specs=P("b"), out_specs=P())
    got = jax.jit(jax.vmap(f, spmd_axis_name="a"))(x)
    for i in range(2):
      np.testing.assert_array_equal(bits(got[i]), bits(jax.jit(f)(x[i])))


def test_reduced_input_keeps_its_type():
  """A value reduced over "y" summed over "x": the result stays reduced over "y", so
  out_specs=P(reduced={"y"}) is accepted, as for lax.psum; exact bitwise, int8 within
  its one_shot bound."""
  m = jax.make_mesh((4, 2), ("x", "y"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  x_np = np.asarray(host_rand((8, 256), jnp.float32, seed=18))
  c = jc.int8()
  with jax.set_mesh(m):
    x = jax.device_put(x_np, P("x", reduced={"y"}))
    run = lambda fn: jax.jit(
      jax.shard_map(fn, in_specs=P("x", reduced={"y"}), out_specs=P(None, reduced={"y"}))
    )(x)
    want = run(lambda v: lax.psum(v, "x"))
    exact = run(lambda v: jcoccl.all_reduce(v, "x", min_bytes=0))
    got = run(lambda v: jcoccl.all_reduce(v, "x", compressor=c, algorithm="one_shot", min_bytes=0))
    assert jax.typeof(got).sharding.spec.reduced == frozenset({"y"})
  np.testing.assert_array_equal(bits(exact), bits(want))
  rows = x_np.reshape(4, 2, 256).astype(np.float64)
  per = np.stack([eb(c, jnp.asarray(r, jnp.float32)) for r in rows])
  bound = per.sum(0) + 4 * 2.0**-24 * (np.abs(rows).sum(0) + per.sum(0))
  assert_within(got, rows.sum(0), bound, "reduced-input int8 all_reduce")

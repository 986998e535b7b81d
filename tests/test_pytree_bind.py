"""One equation per pytree call: each collective given a pytree binds ONE jcoccl_<op>
equation for its compressed leaves (as lax.psum binds a whole pytree once), on both
backends, under jvp, grad and vmap, with results bitwise equal to one call per leaf."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from collectives_util import P, bits, mesh, rand
from jax import lax

import jcoccl
from jcoccl import compressors as jc
from jcoccl._src.engine import fused_comms
from jcoccl._src.native import _ffi

INT8 = jc.int8(block_size=32)
PERM = [(0, 1), (1, 2), (2, 3), (3, 0)]

# op name -> the jcoccl call over axis "b" (size 4) of a (2, 4) mesh ("a", "b").
OPS = {
  "all_reduce": lambda v, **k: jcoccl.all_reduce(v, "b", **k),
  "all_gather": lambda v, **k: jcoccl.all_gather(v, "b", axis=1, tiled=True, **k),
  "reduce_scatter": lambda v, **k: jcoccl.reduce_scatter(
    v, "b", scatter_dimension=1, tiled=True, **k
  ),
  "all_to_all": lambda v, **k: jcoccl.all_to_all(v, "b", 1, 0, tiled=True, **k),
  "ppermute": lambda v, **k: jcoccl.ppermute(v, "b", PERM, **k),
}
# Three float leaves of different shapes and dtypes (all divisible as the ops need).
SHAPES = ((8, 8, 64), (8, 4, 32), (8, 8, 16))
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float32)
_M = {}


def _mesh():
  if "m" not in _M:
    _M["m"] = mesh((2, 4), ("a", "b"))
  return _M["m"]


def _leaves(seed=0):
  return [rand(s, d, seed=seed + i) for i, (s, d) in enumerate(zip(SHAPES, DTYPES))]


def _smap(body, name, n, check_vma=True):
  spec = P(("a", "b"))
  out = P("a") if name == "all_reduce" and check_vma else spec
  return jax.shard_map(
    body,
    mesh=_mesh(),
    in_specs=(spec,) * n,
    out_specs=(out,) * n,
    check_vma=check_vma,
  )


def _tree_call(name, check_vma=True, **kw):
  """(a, b, c) -> the op on the tuple pytree, inside shard_map."""
  return _smap(lambda *v: tuple(OPS[name](v, **kw)), name, 3, check_vma)


def _leaf_call(name, check_vma=True, **kw):
  return _smap(lambda v: (OPS[name](v, **kw),), name, 1, check_vma)


def _eqns(jaxpr):
  for e in jaxpr.eqns:
    yield e
    for v in e.params.values():
      for s in v if isinstance(v, tuple) else (v,):
        inner = getattr(s, "jaxpr", s)
        if hasattr(inner, "eqns"):
          yield from _eqns(inner)


def _count(fn, *args, prefix="jcoccl_"):
  names = [e.primitive.name for e in _eqns(jax.make_jaxpr(fn)(*args).jaxpr)]
  return sum(n.startswith(prefix) for n in names), names


@pytest.mark.parametrize("name", list(OPS))
def test_one_equation_per_pytree_call_bitwise_per_leaf(name):
  xs = _leaves()
  kw = dict(compressor=INT8, min_bytes=0, backend="xla")
  f = _tree_call(name, **kw)
  count, names = _count(f, *xs)
  assert count == 1, names
  got = jax.jit(f)(*xs)
  for x, g in zip(xs, got):
    (want,) = jax.jit(_leaf_call(name, **kw))(x)
    np.testing.assert_array_equal(bits(g), bits(want))


@pytest.mark.parametrize("name", list(OPS))
def test_grad_and_jvp_bind_one_equation_each(name):
  """The transpose (the dual collective) and the tangent (the op with grad_compressor) of
  a pytree call are one equation each, bitwise the per-leaf ones."""
  xs, ts = _leaves(1), _leaves(7)
  kw = dict(compressor=INT8, min_bytes=0)
  f = _tree_call(name, check_vma=False, **kw)
  loss = lambda *v: sum(jnp.sum(jnp.sin(y.astype(jnp.float32))) for y in f(*v))
  grad = jax.grad(loss, argnums=(0, 1, 2))
  count, names = _count(grad, *xs)
  assert count == 2, names  # the forward op and its dual
  jvp = lambda *v: jax.jvp(f, tuple(v[:3]), tuple(v[3:]))
  count, names = _count(jvp, *xs, *ts)
  assert count == 2, names  # the op on the primals and on the tangents
  got_g = jax.jit(grad)(*xs)
  got_t = jax.jit(jvp)(*xs, *ts)[1]
  for i, (x, t) in enumerate(zip(xs, ts)):
    one = _leaf_call(name, check_vma=False, **kw)
    l1 = lambda v: jnp.sum(jnp.sin(one(v)[0].astype(jnp.float32)))
    np.testing.assert_array_equal(bits(got_g[i]), bits(jax.jit(jax.grad(l1))(x)))
    (want_t,) = jax.jit(lambda a, b: jax.jvp(one, (a,), (b,))[1])(x, t)
    np.testing.assert_array_equal(bits(got_t[i]), bits(want_t))


@pytest.mark.parametrize("name", list(OPS))
def test_vmap_of_a_pytree_call(name):
  """vmap with one mapped and one unmapped leaf: one equation, each leaf bitwise its own
  vmapped (or plain) call."""
  xs = _leaves(3)
  batched = jnp.stack([xs[0], xs[0] * 2, xs[0] - 1], axis=1)  # [8, 3, 8, 64]
  kw = dict(compressor=INT8, min_bytes=0)
  inner = lambda a, c: tuple(OPS[name]([a, c], **kw))
  vm = jax.vmap(inner, in_axes=(0, None), out_axes=(0, None))
  spec = P(("a", "b"))
  out = P("a") if name == "all_reduce" else spec
  f = jax.shard_map(
    lambda a, c: _vm_body(vm, a, c),
    mesh=_mesh(),
    in_specs=(spec, spec),
    out_specs=(out, out),
  )
  count, names = _count(f, batched, xs[2])
  assert count == 1, names
  got_a, got_c = jax.jit(f)(batched, xs[2])
  (want_c,) = jax.jit(_leaf_call(name, **kw))(xs[2])
  np.testing.assert_array_equal(bits(got_c), bits(want_c))
  for i in range(3):
    (want,) = jax.jit(_leaf_call(name, **kw))(batched[:, i])
    np.testing.assert_array_equal(bits(got_a[:, i]), bits(want))


def _vm_body(vm, a, c):
  """a: [1, 3, ...] per device -> vmapped over its axis 1, c unmapped."""
  ya, yc = vm(jnp.moveaxis(a, 1, 0), c)
  return jnp.moveaxis(ya, 0, 1), yc


def test_exact_leaves_go_to_lax_and_the_rest_bind_once():
  """An integer leaf takes the exact lax op; the float leaves share one equation, the one
  under min_bytes as an exact operand of it (its cotangent still compresses), which
  prints per operand."""
  x, y = rand((8, 8, 64), jnp.float32, seed=4), rand((8, 8, 64), jnp.bfloat16, seed=5)
  small = rand((8, 2), jnp.float32, seed=6)
  step = jnp.arange(8 * 4, dtype=jnp.int32).reshape(8, 4)
  tree = {"x": x, "y": y, "small": small, "step": step}
  spec = P(("a", "b"))
  body = lambda t: jcoccl.all_reduce(t, "b", compressor=INT8, min_bytes=1024, algorithm="auto")
  f = jax.shard_map(body, mesh=_mesh(), in_specs=(spec,), out_specs=P("a"))
  jaxpr = jax.make_jaxpr(f)(tree)
  names = [e.primitive.name for e in _eqns(jaxpr.jaxpr)]
  assert names.count("jcoccl_all_reduce") == 1, names
  assert names.count("psum_invariant") + names.count("psum") == 1, names
  assert f"compressor=per_leaf(none, {INT8}, {INT8})" in str(jaxpr)  # leaves small, x, y
  got = jax.jit(f)(tree)
  lone = lambda v: jax.jit(
    jax.shard_map(
      lambda u: jcoccl.all_reduce(u, "b", compressor=INT8, min_bytes=1024),
      mesh=_mesh(),
      in_specs=(spec,),
      out_specs=P("a"),
    )
  )(v)
  exact = lambda v: jax.jit(
    jax.shard_map(lambda u: lax.psum(u, "b"), mesh=_mesh(), in_specs=(spec,), out_specs=P("a"))
  )(v)
  np.testing.assert_array_equal(bits(got["x"]), bits(lone(x)))
  np.testing.assert_array_equal(bits(got["y"]), bits(lone(y)))
  np.testing.assert_array_equal(bits(got["small"]), bits(exact(small)))
  np.testing.assert_array_equal(np.asarray(got["step"]), np.asarray(exact(step)))


def test_operands_that_differ_print_per_leaf():
  x, y = rand((8, 8, 64), jnp.float32, seed=8), rand((8, 8, 64), jnp.float32, seed=9)
  spec = P(("a", "b"))
  body = lambda a, b: tuple(
    jcoccl.all_gather([a, b], "b", axis=1, tiled=True, compressor=INT8, min_bytes=0)
  )
  f = jax.shard_map(body, mesh=_mesh(), in_specs=(spec, spec), out_specs=(spec, spec))
  text = str(jax.make_jaxpr(f)(x, y))
  assert "compressor=int8" in text and "axis=1" in text
  body3 = lambda a, b: tuple(
    jcoccl.all_gather([a, b[:, :, 0]], "b", axis=-1, tiled=True, compressor=INT8, min_bytes=0)
  )
  f3 = jax.shard_map(body3, mesh=_mesh(), in_specs=(spec, spec), out_specs=(spec, spec))
  text = str(jax.make_jaxpr(f3)(x, y))
  assert "axis=per_leaf(2, 1)" in text, text


@pytest.mark.skipif(_ffi.native_module("cpu") is None, reason="jcoccl._cpu is not built")
@pytest.mark.parametrize("name", list(OPS))
def test_fused_backend_binds_once_per_pytree(name):
  fused_comms.shutdown()
  jcoccl.init(_mesh())
  try:
    xs = [x.astype(jnp.float32) for x in _leaves(11)]
    kw = dict(compressor=INT8, min_bytes=0, backend="fused")
    f = _tree_call(name, **kw)
    count, names = _count(f, *xs)
    assert count == 1, names
    got = jax.jit(f)(*xs)
    for x, g in zip(xs, got):
      (fused,) = jax.jit(_leaf_call(name, **kw))(x)
      (xla,) = jax.jit(_leaf_call(name, compressor=INT8, min_bytes=0, backend="xla"))(x)
      np.testing.assert_array_equal(bits(g), bits(fused))
      np.testing.assert_array_equal(bits(g), bits(xla))
  finally:
    fused_comms.shutdown()

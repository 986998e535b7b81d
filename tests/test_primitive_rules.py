"""Each rule of the jcoccl primitives called on its own (as JAX tests lax's rules): abstract
eval, lowering, jvp, transpose and batching, with the parameters of a real equation.
Everything here is traced, nothing compiles."""

import jax
import jax.numpy as jnp
import numpy as np
from collectives_util import P, mesh
from jax.interpreters import ad

import jcoccl
from jcoccl._src import _compat
from jcoccl._src.base import config
from jcoccl._src.base.reason import Reason
from jcoccl._src.ops import rules
from jcoccl._src.ops.op_spec import op

X = np.ones((8, 4, 64), np.float32)  # local (1, 4, 64) over mesh (a=2, b=4)
INT8 = "int8:block=32"
SPEC = P(("a", "b"))  # every operand and result, unless given
_M = {}


def _mesh():
  if "m" not in _M:
    _M["m"] = mesh((2, 4), ("a", "b"))
  return _M["m"]


def _trace(body, *args, out_specs=SPEC, check_vma=True):
  spec = SPEC
  f = jax.shard_map(
    body,
    mesh=_mesh(),
    in_specs=(spec,) * len(args),
    out_specs=out_specs,
    check_vma=check_vma,
  )
  return jax.make_jaxpr(f)(*args).jaxpr


def _eqns(jaxpr):
  for e in jaxpr.eqns:
    yield e
    for v in e.params.values():
      for sub in v if isinstance(v, (tuple, list)) else (v,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from _eqns(inner)


def _inside(fn):
  """``fn()`` run where the mesh axes are bound (inside a shard_map being traced)."""
  got = []
  _trace(lambda v: (got.append(fn()), v)[1], X)
  return got[0]


def _ours(jaxpr):
  return [e for e in _eqns(jaxpr) if e.primitive.name.startswith("jcoccl_")]


def _eqn(call, out_specs=SPEC):
  (e,) = _ours(_trace(call, X, out_specs=out_specs))
  return e


def _all_reduce(**kw):
  return lambda v: jcoccl.all_reduce(v, "b", compressor=INT8, min_bytes=0, **kw)


def _all_gather(v):
  return jcoccl.all_gather(v, "b", axis=2, tiled=True, compressor=INT8, min_bytes=0)


def test_abstract_eval_types_each_operand_as_lax():
  e = _eqn(_all_reduce(algorithm="two_shot"), P("a"))
  aval = e.invars[0].aval
  (out,), axes = rules.abstract_eval(op("all_reduce"), aval, **e.params)
  assert (out.shape, out.dtype, axes) == (aval.shape, aval.dtype, ("b",))
  assert _compat.aval_vma(out) == _compat.aval_vma(aval) - {
    "b"
  }  # the sum is invariant over the axis, as psum's
  g = _eqn(_all_gather)
  (out,), _ = _inside(lambda: rules.abstract_eval(op("all_gather"), aval, **g.params))
  assert out.shape == (1, 4, 256) and _compat.aval_vma(out) == _compat.aval_vma(aval)
  params = {**e.params, "residual": True}
  outs, _ = rules.abstract_eval(op("all_reduce"), aval, aval, **params)
  assert [o.dtype for o in outs] == [aval.dtype] * 2 + [jnp.float32] * 2  # + residuals


def test_lower_traces_the_backends_forward():
  e = _eqn(_all_reduce(algorithm="two_shot"), P("a"))
  assert isinstance(e.params["reason"], Reason) and isinstance(e.params["config"], config.Config)
  jaxpr = _trace(lambda v: rules.lower(op("all_reduce"), v, **e.params)[0], X, out_specs=P("a"))
  names = [x.primitive.name for x in _eqns(jaxpr)]
  assert not _ours(jaxpr) and {"all_to_all", "all_gather_invariant"} <= set(names), names


def test_jvp_sends_the_tangent_with_the_grad_compressor():
  e = _eqn(_all_reduce(grad_compressor="int4:block=32"), P("a"))
  o = op("all_reduce")

  def body(v, t):
    ys, ts = rules.jvp(o, [v], [t], **e.params)
    return ys[0] + ts[0]

  eqns = _ours(_trace(body, X, X, out_specs=P("a")))
  assert [x.params["compressor"] for x in eqns] == [INT8, "int4:block=32"]
  zero = ad.Zero(e.invars[0].aval.to_tangent_aval())
  jaxpr = _trace(lambda v: rules.jvp(o, [v], [zero], **e.params)[0][0], X, out_specs=P("a"))
  assert len(_ours(jaxpr)) == 1  # no tangent: nothing more is sent


def test_transpose_is_the_dual_or_no_communication():
  g = _eqn(_all_gather)
  aval = g.invars[0].aval
  body = lambda ct: rules.transpose(op("all_gather"), [ct], ad.UndefinedPrimal(aval), **g.params)[0]
  ct = np.ones((8, 4, 256), np.float32)
  assert [x.primitive.name for x in _ours(_trace(body, ct))] == ["jcoccl_reduce_scatter"]
  e = _eqn(_all_reduce(), P("a"))
  aval = e.invars[0].aval

  def invariant(ct):
    ct = jax.lax.psum(ct, "b")  # invariant over "b", as the all_reduce's cotangent is
    return rules.transpose(op("all_reduce"), [ct], ad.UndefinedPrimal(aval), **e.params)[0]

  assert not _ours(_trace(invariant, X))  # lax.psum's transpose: a broadcast


def test_batch_adds_rows_to_one_equation():
  e = _eqn(_all_reduce(), P("a"))

  def body(v):
    outs, dims = rules.batch(op("all_reduce"), [jnp.stack([v, v, v])], [0], **e.params)
    assert dims == [0]
    return outs[0][1]

  (b,) = _ours(_trace(body, X, out_specs=P("a")))
  assert b.params["batch"] == 1 and b.invars[0].aval.shape == (3, 1, 4, 64)

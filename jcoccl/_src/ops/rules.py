"""The rules of the ``jcoccl_<op>`` primitives, one top-level function each (as
``jax/_src/lax/parallel.py`` writes psum's), applied per operand. Each takes the op's
:class:`jcoccl._src.ops.op_spec.Op` first; :func:`define` binds it and registers them.

  :func:`abstract_eval`: shape and dtype from :attr:`Op.out_shape`; varying manual axes as
    lax's collectives type them (all_reduce removes ``axes``, the others keep the input's);
    a named-axis effect per axis, as lax's collectives have.
  :func:`lower`: :attr:`Op.forward` (the chosen algorithm on the chosen backend) traced and
    lowered in place, the leaves bucketed (:mod:`jcoccl._src.ops.lowering`).
  :func:`jvp`: the same collective applied to the tangent with ``grad_compressor``
    (straight-through: the codec's rounding has no derivative of its own).
  :func:`transpose`: the dual collective, looked up in :data:`jcoccl._src.ops.op_spec.DUALS`,
    on the cotangent with ``grad_compressor``; all_reduce under check_vma transposes as
    lax.psum does, to a broadcast of the invariant cotangent (no communication).
  :func:`batch`: the mapped axis becomes more rows of the backend's row API (``vmap(f)(x)[i]``
    is bitwise ``f(x[i])``: :func:`jcoccl._src.compressors.rows.run_batched`). Calls with a PRNG key
    are unrolled per batch element instead (their random streams are drawn per call).

The derivative rules and lowering run under the :class:`jcoccl._src.base.config.Config` the
equation captured (its ``config`` parameter).

Example:
  >>> p = define(op_spec.op("all_reduce"))  # doctest: +SKIP
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jcoccl._src import _compat
from jcoccl._src.base import config as _config
from jcoccl._src.base.axes import match_vma
from jcoccl._src.ops import op_spec
from jcoccl._src.ops.driver import apply
from jcoccl._src.ops.lowering import lower_leaves
from jcoccl._src.ops.op_spec import DUALS, Op
from jcoccl._src.ops.params import leaf_params, merge_params, unwrap_key


def split(args: Sequence[Any], key_type: Any) -> tuple[list, list]:
  """An equation's operands as (arrays, PRNG key operands).

  Example:
    >>> split([1, 2, 3], "raw")
    ([1, 2], [3])
  """
  n = len(args) - (key_type is not None)
  return list(args[:n]), list(args[n:])


# A derivative's collective rounds with its own stream: the call's key folded with this, so
# a stochastic codec works under jax.grad / jax.jvp with the one key the caller passed.
_DERIVATIVE_STREAM = 1


def derivative_key(keys: Sequence[Any], key_type: Any) -> Any:
  """The PRNG key of a call's tangent or cotangent collective: None without a key, else
  the call's key folded with :data:`_DERIVATIVE_STREAM`.

  Example:
    >>> derivative_key([], None) is None
    True
  """
  if key_type is None:
    return None
  return jax.random.fold_in(unwrap_key(tuple(keys), key_type), _DERIVATIVE_STREAM)


def batched(fn: Callable, xs: Sequence[jax.Array], nbs: Sequence[int]) -> list:
  """``fn`` (a list of leaves -> a list of results) vmapped over each leaf's ``nbs[i]``
  leading batch axes (a leaf with fewer is not mapped by the inner vmaps)."""
  for k in reversed(range(max(nbs, default=0))):
    dims = [0 if nb > k else None for nb in nbs]
    fn = jax.vmap(fn, in_axes=(dims,), out_axes=dims)
  return fn(list(xs))


def abstract_eval(o: Op, *avals: Any, key_type: Any, **params: Any) -> tuple[list, tuple]:
  """(output avals, the axes of the named-axis effects): the results, then with the
  ``residual`` parameter the encoder's residuals (float32, shaped like the inputs)."""
  xs, _ = split(avals, key_type)
  outs = []
  for i, aval in enumerate(xs):
    lp = leaf_params(params, i)
    nb = lp["batch"]
    shape = aval.shape[:nb] + tuple(o.out_shape(aval.shape[nb:], lp))
    vin, axes = _compat.aval_vma(aval), set(lp["axes"])
    # A sum of an unreduced input is no longer unreduced over axes; psum_scatter's
    # result varies over them, as lax types it.
    vma = vin - axes if o.reduces(lp) else vin | (axes & _compat.aval_unreduced_only(aval))
    outs.append(_compat.collective_aval(aval, shape, vma, lp["axes"]))
  if params.get("residual"):
    f32 = jnp.dtype(jnp.float32)
    outs += [_compat.collective_aval(a, a.shape, _compat.aval_vma(a)).update(dtype=f32) for a in xs]
  return outs, params["axes"]


def lower(o: Op, *args: Any, key_type: Any, config: Any, reason: Any = None, **params: Any) -> list:
  """The equation's forward, traced in place of it under its captured ``config``."""
  del reason  # what explain reads; not the wire's
  xs, keys = split(args, key_type)
  key = unwrap_key(tuple(keys), key_type)
  with _config.using(config):
    return lower_leaves(o, xs, key, [leaf_params(params, i) for i in range(len(xs))])


def jvp(o: Op, primals: Sequence[Any], tangents: Sequence[Any], **params: Any) -> tuple:
  """(outputs, output tangents): each live tangent through the op with ``grad_compressor``
  (:attr:`Op.tangent_args`); a residual output's tangent is zero."""
  with _config.using(params["config"]):
    ys = op_spec.primitive(o.name).bind(*primals, **params)
    key = derivative_key(split(primals, params["key_type"])[1], params["key_type"])
    # The residual's tangent is zero: straight-through, decode(encode(y)) moves as y does.
    n = len(ys) // 2 if params.get("residual") else len(ys)
    live = [i for i in range(n) if not _compat.is_zero_cotangent(tangents[i])]
    touts = [_compat.zero_tangent_of(y) for y in ys]
    if live:
      lps = [leaf_params(params, i) for i in live]
      args = [o.tangent_args(lp) for lp in lps]
      ts = [_compat.instantiate_zero(tangents[i]) for i in live]
      got = batched(lambda vs: apply(o.name, vs, key, args), ts, [lp["batch"] for lp in lps])
      for i, t in zip(live, got):
        touts[i] = t
    return ys, touts


def transpose(o: Op, cts: Sequence[Any], *args: Any, key_type: Any, **params: Any) -> list:
  """The cotangent of each linear operand: through the dual op (:data:`DUALS`) with
  ``grad_compressor``, or without communication where lax's transpose has none (an
  invariant cotangent of a reduction; an unreduced input)."""
  with _config.using(params["config"]):
    xs, keys = split(args, key_type)
    res: list = [None] * len(xs)
    dual_idx = []
    for i, (x, ct) in enumerate(zip(xs, cts)):
      if not _compat.is_linear_input(x):
        continue
      aval, lp = _compat.undefined_aval(x), leaf_params(params, i)
      if _compat.is_zero_cotangent(ct):
        res[i] = _compat.zero_like_aval(aval)
        continue
      vma, nb = _compat.aval_vma(aval), [lp["batch"]]
      if set(lp["axes"]) & _compat.aval_unreduced(aval):
        fn = o.unreduced_transpose  # plan binds an unreduced input only for ops with one
        assert fn is not None
        res[i] = batched(lambda v, lp=lp, fn=fn: [fn(v[0], lp)], [ct], nb)[0]
      elif o.reduces(lp) and set(lp["axes"]) <= vma and o.invariant_transpose is not None:
        fn = o.invariant_transpose
        out = batched(lambda v, lp=lp, fn=fn: [fn(v[0], lp)], [ct], nb)[0]
        res[i] = match_vma(out, vma)
      else:
        dual_idx.append(i)
    if dual_idx:
      lps = [leaf_params(params, i) for i in dual_idx]
      dargs = [o.dual_args(lp) for lp in lps]
      got = batched(
        lambda vs: apply(DUALS[o.name], vs, derivative_key(keys, key_type), dargs),
        [cts[i] for i in dual_idx],
        [lp["batch"] for lp in lps],
      )
      for i, g in zip(dual_idx, got):
        res[i] = match_vma(g, _compat.aval_vma(_compat.undefined_aval(xs[i])))
    return res + [None] * len(keys)


def batch(
  o: Op, args: Sequence[Any], dims: Sequence[Any], *, key_type: Any, **params: Any
) -> tuple[list, list]:
  """(outputs, their batch dims): a mapped operand's axis moved first and counted in its
  ``batch`` parameter (one equation); with a PRNG key, one equation per batch element."""
  p = op_spec.primitive(o.name)
  xs, keys = split(args, key_type)
  xds, kds = dims[: len(xs)], dims[len(xs) :]
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
  if keys:
    # Per-call random streams: one call per batch element.
    def take(a: Any, d: Any, i: int) -> Any:
      return a if d is None else jax.lax.index_in_dim(a, i, d, keepdims=False)

    outs = [
      p.bind(
        *(take(x, d, i) for x, d in zip(xs, xds)),
        *(take(k, d, i) for k, d in zip(keys, kds)),
        key_type=key_type,
        **params,
      )
      for i in range(size)
    ]
    return [jnp.stack([o_[j] for o_ in outs]) for j in range(len(outs[0]))], [0] * len(outs[0])
  new_xs, lps = [], []
  for i, (x, d) in enumerate(zip(xs, xds)):
    lp = leaf_params(params, i)
    if d is not None:
      x, lp = jnp.moveaxis(x, d, 0), {**lp, "batch": lp["batch"] + 1}
    new_xs.append(x)
    lps.append(lp)
  outs = p.bind(*new_xs, key_type=key_type, **merge_params(lps))
  out_dims = [None if d is None else 0 for d in xds]
  return outs, out_dims * (len(outs) // len(out_dims))


def define(o: Op) -> Any:
  """The primitive ``jcoccl_<o.name>`` with these rules for ``o``."""
  p = _compat.new_primitive(f"jcoccl_{o.name}")
  _compat.define_collective(
    p,
    abstract_eval=functools.partial(abstract_eval, o),
    lower=functools.partial(lower, o),
    jvp=functools.partial(jvp, o),
    transpose=functools.partial(transpose, o),
    batch=functools.partial(batch, o),
  )
  return p

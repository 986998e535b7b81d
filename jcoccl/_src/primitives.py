"""The five collectives as JAX primitives, and the one table of their duals.

Each op module (all_reduce.py, all_gather.py, ...) describes its collective with an
:class:`Op` and registers it here; this module turns it into a primitive named
``jcoccl_<op>`` with:

  abstract evaluation: shape and dtype from :attr:`Op.out_shape`; varying manual axes as
    lax's collectives type them (all_reduce removes ``axes``, the others keep the input's);
    a named-axis effect per axis, as lax's collectives have.
  lowering: :attr:`Op.forward` (the chosen algorithm on the chosen backend) traced and
    lowered in place, inside shard_map's manual lowering context.
  jvp: the same collective applied to the tangent with ``grad_compressor``
    (straight-through: the codec's rounding has no derivative of its own).
  transpose: the dual collective, looked up in :data:`DUALS`, on the cotangent with
    ``grad_compressor``; all_reduce under check_vma transposes as lax.psum does, to a
    broadcast of the invariant cotangent (no communication).
  batching: the mapped axis becomes more rows of the backend's row API (every row is
    padded to whole codec blocks and slices, so each batch element is encoded, sent and
    decoded exactly as on its own: ``vmap(f)(x)[i]`` is bitwise ``f(x[i])``; the rows are
    :mod:`jcoccl._src.layout`'s :func:`~jcoccl._src.layout.run_batched`). Calls with
    a PRNG key are unrolled per batch element instead (their random streams are drawn per
    call).

Parameters are hashable and print as what goes on the wire, e.g.
``jcoccl_all_reduce[algorithm=two_shot axes=('d',) backend=xla ... compressor=int8 ...]``.

Example:
  >>> DUALS["all_gather"]
  'reduce_scatter'
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jcoccl._src import _common as C
from jcoccl._src import _compat

# The dual (transpose) of each collective: the op that carries cotangents back.
DUALS = {
  "all_reduce": "all_reduce",
  "all_gather": "reduce_scatter",
  "reduce_scatter": "all_gather",
  "all_to_all": "all_to_all",
  "ppermute": "ppermute",
}


@dataclasses.dataclass(frozen=True)
class Op:
  """One collective's rules (see the module docstring).

  Attributes:
    name: the op (a key of :data:`DUALS`).
    out_shape: ``(element shape, params) -> element output shape``.
    reduces: ``params -> bool``: the output is invariant over ``axes`` (all_reduce;
      all_gather with ``to="invarying"``).
    forward: ``(x, key, **params) -> y``: the collective on ``x``, which has
      ``params["batch"]`` leading batch axes; ``key`` is a PRNG key or None.
    leaf: ``(x, key, **args) -> y``: the public op on one array (checks, threshold,
      backend choice, then binds the primitive or calls the exact lax op).
    tangent_args: ``params -> args`` of ``leaf`` for the tangent (grad compressor).
    dual_args: ``params -> args`` of the dual op's ``leaf`` for the cotangent.
    invariant_transpose: ``(ct, params) -> ct_x`` where the output is invariant over
      ``axes`` under check_vma and so is the cotangent: no communication is needed (lax's
      psum: a broadcast; all_gather to="invarying": this rank's block).
  """

  name: str
  out_shape: Callable[..., tuple]
  reduces: Callable[[dict], bool]
  forward: Callable[..., Any]
  leaf: Callable[..., Any]
  tangent_args: Callable[[dict], dict]
  dual_args: Callable[[dict], dict]
  invariant_transpose: Callable[..., Any] | None = None


_OPS: dict[str, Op] = {}
_PRIMS: dict[str, Any] = {}


def op(name: str) -> Op:
  """The registered :class:`Op` ``name`` (its module is imported on first use)."""
  if name not in _OPS:
    importlib.import_module(f"jcoccl._src.{name}")
  return _OPS[name]


def primitive(name: str) -> Any:
  """The primitive ``jcoccl_<name>``."""
  op(name)
  return _PRIMS[name]


# ----------------------------------------------------------------------------------------
# Compressor parameters: spec strings (hashable, readable), "none" for the exact path.


def spec_of(c: Any) -> Any:
  """A compressor (or None, or a per-level pair) as its spec string(s)."""
  if isinstance(c, tuple):
    return tuple(spec_of(x) for x in c)
  return "none" if c is None else str(c)


@functools.cache
def load(spec: Any) -> Any:
  """Inverse of :func:`spec_of`."""
  if isinstance(spec, tuple):
    return tuple(load(s) for s in spec)
  return C.resolve_compressor(spec)


def grad_args(params: dict, **op_args: Any) -> dict:
  """Leaf arguments of the collective a tangent or cotangent goes through.

  Both run with the call's ``grad_compressor`` (for the compressed path too) and the
  backend, chunks and threshold the call was given; ``op_args`` are what the op itself
  needs (its axis arguments, possibly swapped for the dual).

  Args:
    params: the primitive's parameters.
    **op_args: op-specific leaf arguments, added as they are.

  Returns:
    Keyword arguments for the dual's or the op's own ``leaf`` function.

  Example:
    >>> p = dict(axes=("d",), grad_compressor="none", backend_arg="auto", chunks=1,
    ...          min_bytes=None)
    >>> grad_args(p, tiled=True)["compressor"] is None
    True
  """
  gc = load(params["grad_compressor"])
  return dict(
    axes=params["axes"],
    compressor=gc,
    grad_compressor=gc,
    backend=params["backend_arg"],
    chunks=params["chunks"],
    min_bytes=params["min_bytes"],
    **op_args,
  )


# ----------------------------------------------------------------------------------------
# PRNG keys travel as raw key data (primitive operands of a plain dtype).


def key_operand(key: Any) -> tuple[tuple, Any]:
  """(operands, key_type param) for ``key``: None, a raw uint32 key or a typed key."""
  if key is None:
    return (), None
  key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    return (jax.random.key_data(key),), str(jax.random.key_impl(key))
  return (key,), "raw"


def _unwrap_key(keys: tuple, key_type: Any) -> Any:
  if key_type is None:
    return None
  if key_type == "raw":
    return keys[0]
  return jax.random.wrap_key_data(keys[0], impl=key_type)


# ----------------------------------------------------------------------------------------
# Rules.


def bind(name: str, x: jax.Array, key: Any, **params: Any) -> jax.Array:
  """Binds ``jcoccl_<name>`` on ``x`` (``params`` as the op module builds them)."""
  keys, key_type = key_operand(key)
  return primitive(name).bind(x, *keys, key_type=key_type, batch=0, **params)


def _batched(fn: Callable, x: jax.Array, nb: int) -> jax.Array:
  for _ in range(nb):
    fn = jax.vmap(fn)
  return fn(x)


def _make(o: Op) -> Any:
  p = _compat.new_primitive(f"jcoccl_{o.name}")

  def abstract_eval(aval, *key_avals, **params):
    nb = params["batch"]
    shape = aval.shape[:nb] + tuple(o.out_shape(aval.shape[nb:], params))
    vin = _compat.aval_vma(aval)
    if o.reduces(params):
      return (
        _compat.collective_aval(aval, shape, vin - set(params["axes"]), params["axes"]),
        params["axes"],
      )
    return _compat.collective_aval(aval, shape, vin), params["axes"]

  def lower(x, *keys, key_type, **params):
    return o.forward(x, _unwrap_key(keys, key_type), **params)

  def jvp(primals, tangents, **params):
    y = p.bind(*primals, **params)
    t = tangents[0]
    if _compat.is_zero_cotangent(t):
      return y, _compat.zero_tangent_of(y)
    args = o.tangent_args(params)
    ty = _batched(lambda v: o.leaf(v, None, **args), _compat.instantiate_zero(t), params["batch"])
    return y, ty

  def transpose(ct, x, *keys, **params):
    aval = _compat.undefined_aval(x)
    rest = [None] * len(keys)
    if _compat.is_zero_cotangent(ct):
      return [_compat.zero_like_aval(aval)] + rest
    vma = _compat.aval_vma(aval)
    unreduced = set(params["axes"]) & _compat.aval_unreduced(aval)
    if unreduced:
      # lax.psum of an unreduced value transposes to the cotangent typed reduced.
      out = _batched(
        lambda v: jax.lax.pcast(v, tuple(sorted(unreduced)), to="reduced"), ct, params["batch"]
      )
      return [out] + rest
    if o.reduces(params) and set(params["axes"]) <= vma:
      out = _batched(lambda v: o.invariant_transpose(v, params), ct, params["batch"])
      return [C.match_vma(out, vma)] + rest
    dual = op(DUALS[o.name])
    args = o.dual_args(params)
    out = _batched(lambda v: dual.leaf(v, None, **args), ct, params["batch"])
    return [C.match_vma(out, vma)] + rest

  def batch(args, dims, **params):
    x, keys = args[0], args[1:]
    xd, kds = dims[0], dims[1:]
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    if keys or xd is None:
      # Per-call random streams: one call per batch element.
      def take(a, d, i):
        return a if d is None else jax.lax.index_in_dim(a, i, d, keepdims=False)

      outs = [
        p.bind(take(x, xd, i), *(take(k, d, i) for k, d in zip(keys, kds)), **params)
        for i in range(size)
      ]
      return jnp.stack(outs), 0
    x = jnp.moveaxis(x, xd, 0)
    return p.bind(x, **{**params, "batch": params["batch"] + 1}), 0

  _compat.define_collective(
    p, abstract_eval=abstract_eval, lower=lower, jvp=jvp, transpose=transpose, batch=batch
  )
  return p


def register(o: Op) -> None:
  """Registers ``o`` and defines its primitive."""
  if o.name not in DUALS:
    raise ValueError(f"op must be one of {tuple(DUALS)}, got {o.name!r}")
  _OPS[o.name] = o
  _PRIMS[o.name] = _make(o)

"""``jcoccl.compress(f, policy)``: the lax collectives of an existing program run as jcoccl ops.

``f`` is traced to a jaxpr and re-evaluated by an interpreter that binds every equation as
it is, except:

* a lax collective whose mesh axes the policy gives a compressor for runs as the jcoccl op
  (``psum``/``psum_invariant`` -> :func:`jcoccl.all_reduce`, ``all_gather`` ->
  :func:`jcoccl.all_gather`, ``reduce_scatter`` (``lax.psum_scatter``) ->
  :func:`jcoccl.reduce_scatter`, ``all_to_all`` -> :func:`jcoccl.all_to_all`,
  ``ppermute`` -> :func:`jcoccl.ppermute`) with the same axis, dimension, ``tiled`` and
  permutation arguments, plus the policy's ``min_bytes`` (and ``algorithm`` for all_reduce);
* a ``shard_map`` is re-emitted with ``jax.shard_map`` (same mesh, specs, manual axes and
  ``check_vma``) over the interpreted body;
* the bodies of ``jit``, ``closed_call``, ``scan``, ``while``, ``cond`` and ``checkpoint``
  (remat) equations are interpreted too and rebound with the same parameters.

Everything else (arithmetic, ``pvary``/``pcast``, RNG, sharding constraints) is bound
unchanged, and a program in which the policy rewrites nothing is ``f`` itself.

Rules:

* **Several axes** (``lax.psum(x, ("data", "tensor"))``): compressed only when every axis
  resolves to the same compressor and the same options (``min_bytes``, ``algorithm``);
  otherwise exact. One axis's compressor (and its error bound) is never applied to traffic
  over another axis that the policy keeps exact or compresses differently.
* **Ops the policy does not name** (compressor ``None`` for the axis and op) stay the lax
  equation, bitwise.
* **Left as lax**: collectives with ``axis_index_groups``, over positional (pmap) axes, of
  dtypes other than float32/bfloat16/float16 (the codecs' inputs), ``all_gather_invariant``
  (its result type differs from jcoccl.all_gather's), ``pmax``/``pmin`` and the other lax
  collectives, and collectives inside ``custom_jvp``/``custom_vjp`` functions: a custom rule
  defines the derivative of exactly the function it was written for, so the function and
  its rule are kept together, both as written.
* The policy is a :class:`jcoccl.Policy` and nothing more: compressors, ``min_bytes`` and
  ``algorithm``. A TOML file with the training switches of ``models/`` (``error_feedback``,
  ``zero``, ``nodes``: state carried across steps, a sharded optimizer, which a rewrite of
  the collectives cannot add) is refused like any jcoccl.Policy refuses them, with a message
  naming ``models.recipe``; ``models.recipe.Recipe.from_toml(path).policy`` is the jcoccl
  part of such a file.
* Gradients: collectives that AD produced inside ``f`` (``jax.grad`` in a training step)
  are equations like any other and are rewritten by op and axis; differentiating the
  compressed function uses the jcoccl ops' own transposes (their ``grad_compressor``
  defaults to the forward compressor).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax

from jcoccl._src import _compat
from jcoccl._src.compressors.compressor_args import is_float, stochastic_codec
from jcoccl._src.integrations.interpret import eval_jaxpr
from jcoccl._src.ops.all_gather import all_gather
from jcoccl._src.ops.all_reduce import all_reduce
from jcoccl._src.ops.all_to_all import all_to_all
from jcoccl._src.ops.ppermute import ppermute
from jcoccl._src.ops.reduce_scatter import reduce_scatter
from jcoccl.policy import WILDCARD, Policy

# lax primitive -> the policy's (and jcoccl's) op name.
_OPS = {
  "psum": "all_reduce",
  "psum_invariant": "all_reduce",
  "all_gather": "all_gather",
  "reduce_scatter": "reduce_scatter",
  "all_to_all": "all_to_all",
  "ppermute": "ppermute",
}
# Equations whose sub-programs are interpreted: primitive -> parameters holding them.
_CLOSED = {
  "jit": ("jaxpr",),
  "pjit": ("jaxpr",),
  "closed_call": ("call_jaxpr",),
  "core_call": ("call_jaxpr",),
  "scan": ("jaxpr",),
  "while": ("cond_jaxpr", "body_jaxpr"),
  "cond": ("branches",),
}
_REMAT = ("remat2", "checkpoint", "remat")


def compress(f: Callable[..., Any], policy: Any) -> Callable[..., Any]:
  """``f`` with its lax collectives run as jcoccl ops with the policy's compressors.

  ``f`` is any function whose collectives are ``jax.lax`` ones inside ``jax.shard_map``
  (a training step, a model's forward pass), or a function called inside a shard_map body.
  The result takes the same arguments and returns the same structure; it composes with
  ``jax.jit``, ``jax.grad`` and ``jax.vmap``. Each call traces ``f`` once to find its
  collectives, so wrap the result in ``jax.jit`` for repeated use. Arguments are traced as
  arrays: bind non-array (static) arguments with ``functools.partial`` first. The rules
  (several axes, ops left as lax, custom derivatives) are in :mod:`jcoccl._src.integrations.compress`.

  Args:
    f: the function to rewrite.
    policy: a :class:`jcoccl.Policy`, a mapping ``{axis: {op: spec, ...}}`` (as
      :meth:`Policy.from_dict`) or the path of a TOML policy file (as
      :meth:`Policy.from_toml`: compressors and options, no training switches; for a
      ``models/configs/*.toml`` with them pass ``models.recipe.Recipe.from_toml(path).policy``).
      Axis ``"*"`` applies to every mesh axis not named.

  Returns:
    The compressed function. At trace time it raises ValueError if the policy names an axis
    that none of ``f``'s shard_map meshes (or the enclosing one) has.

  Raises:
    TypeError: ``f`` is not callable, or ``policy`` is none of the accepted types.
    ValueError: the policy file or mapping is malformed (the message names the entry), or
      an entry rounds stochastically (it needs a PRNG key per call, which ``f`` lacks).

  Example:
    >>> def step(x):                                                  # doctest: +SKIP
    ...   return jax.shard_map(lambda v: jax.lax.psum(v, "data"), mesh=mesh,
    ...                        in_specs=P("data"), out_specs=P())(x)
    >>> fast = jax.jit(jcoccl.compress(step, {"data": {"all_reduce": "int8",
    ...                                                 "min_bytes": 0}}))
    >>> fast(x)    # psum over 'data' is jcoccl.all_reduce(..., compressor=int8)
  """
  if not callable(f):
    raise TypeError(
      f"compress: f must be a callable (the function to rewrite), got {type(f).__name__} {f!r}"
    )
  pol = as_policy(policy)
  _refuse_stochastic(pol)

  @functools.wraps(f)
  def compressed(*args: Any, **kwargs: Any) -> Any:
    flat, tree = jax.tree.flatten((args, kwargs))

    def call(*leaves: Any) -> Any:
      a, kw = jax.tree.unflatten(tree, leaves)
      return f(*a, **kw)

    closed, out_shape = jax.make_jaxpr(call, return_shape=True)(*flat)
    _check_axes(pol, _mesh_axes(closed.jaxpr) | _enclosing_axes())
    if not _rewrites(closed.jaxpr, pol):
      return f(*args, **kwargs)
    outs = _eval(closed.jaxpr, closed.consts, flat, pol)
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

  return compressed


def _refuse_stochastic(pol: Policy) -> None:
  """ValueError for a stochastic-rounding entry: it draws from a PRNG key per call, and
  the rewritten function takes f's arguments, no key."""
  for axis, ap in sorted(pol.axes.items()):
    for op, c in sorted(ap.compressors.items()):
      if stochastic_codec(c) is not None:
        raise ValueError(
          f"policy: {axis}.{op} = {c} rounds stochastically, which needs a PRNG key per "
          "call, and jcoccl.compress's function takes none. Use a round-to-nearest codec, "
          f"or call jcoccl.{op}(..., key=) in the shard_map body"
        )


def as_policy(policy: Any) -> Policy:
  """The Policy that ``policy`` gives.

  Args:
    policy: a Policy, a mapping ``{axis: {op or option: value}}`` or a TOML file's path
      (``error_feedback``, ``zero`` and ``nodes`` there are refused: they are models/'
      training switches).

  Returns:
    A :class:`jcoccl.Policy` (errors in a mapping or file name the entry).

  Example:
    >>> as_policy({"data": {"all_reduce": "int8"}}).compressor("data", "all_reduce")
  """
  if isinstance(policy, Policy):
    return policy
  if isinstance(policy, Mapping):
    return Policy.from_dict(policy)
  if isinstance(policy, (str, os.PathLike)):
    return Policy.from_toml(os.fspath(policy))
  raise TypeError(
    f"compress: policy must be a jcoccl.Policy, a mapping {{axis: {{op: spec}}}} "
    f"or the path of a TOML policy file, got {type(policy).__name__} {policy!r}"
  )


# -- which collectives are rewritten ------------------------------------------------------


def _axes_of(name: str, params: Mapping[str, Any]) -> tuple | None:
  axes = params.get("axes" if name.startswith("psum") else "axis_name")
  axes = axes if isinstance(axes, (tuple, list)) else (axes,)
  if not axes or not all(isinstance(a, str) for a in axes):
    return None
  return tuple(axes)


def _choice(eqn: Any, pol: Policy) -> tuple[tuple, Any, dict] | None:
  """(axes, compressor, options) for a collective the policy compresses, else None."""
  name = eqn.primitive.name
  op = _OPS.get(name)
  if op is None or eqn.params.get("axis_index_groups") is not None:
    return None
  axes = _axes_of(name, eqn.params)
  if axes is None:
    return None
  comps = [pol.compressor(a, op) for a in axes]
  opts = [_options(pol, a, op) for a in axes]
  if comps[0] is None or any(c != comps[0] for c in comps) or any(o != opts[0] for o in opts):
    return None
  return axes, comps[0], opts[0]


def _options(pol: Policy, axis: str, op: str) -> dict:
  # The policy's algorithm is an all_reduce algorithm; the other ops take none.
  opts = pol.options(axis, op)
  return opts if op == "all_reduce" else {k: v for k, v in opts.items() if k != "algorithm"}


def _sub_jaxprs(eqn: Any) -> Iterator[Any]:
  """The open jaxprs of the sub-programs that the interpreter descends into."""
  name = eqn.primitive.name
  if name == "shard_map" or name in _REMAT:
    yield eqn.params["jaxpr"]
  for key in _CLOSED.get(name, ()):
    v = eqn.params[key]
    for c in v if isinstance(v, (tuple, list)) else (v,):
      yield c.jaxpr


def _rewrites(jaxpr: Any, pol: Policy) -> bool:
  """Whether the interpreter would replace any collective of ``jaxpr``."""
  return any(
    _choice(e, pol) is not None or any(_rewrites(j, pol) for j in _sub_jaxprs(e))
    for e in jaxpr.eqns
  )


def _mesh_axes(jaxpr: Any) -> set:
  out = set()
  for e in jaxpr.eqns:
    if e.primitive.name == "shard_map":
      out |= set(e.params["mesh"].axis_names)
    for j in _sub_jaxprs(e):
      out |= _mesh_axes(j)
  return out


def _enclosing_axes() -> set:
  mesh = jax.sharding.get_abstract_mesh()
  return set() if mesh is None or mesh.empty else set(mesh.axis_names)


def _check_axes(pol: Policy, mesh_axes: set) -> None:
  unknown = [a for a in pol.axes if a != WILDCARD and a not in mesh_axes]
  if mesh_axes and unknown:
    raise ValueError(
      f"compress: policy names axis {unknown[0]!r}, which the mesh of f's "
      f"shard_map does not have (its axes: {', '.join(sorted(mesh_axes))}); "
      f"use those names, or '*' for every axis"
    )


# -- the interpreter --------------------------------------------------------------------------


def _eval(jaxpr: Any, consts: Any, args: Any, pol: Policy) -> list:
  return eval_jaxpr(jaxpr, consts, args, lambda eqn, invals: _eval_eqn(eqn, invals, pol))


def _eval_eqn(eqn: Any, invals: list, pol: Policy) -> list:
  prim, name = eqn.primitive, eqn.primitive.name
  choice = _choice(eqn, pol)
  if choice is not None:
    return _collective(eqn, invals, *choice)
  if any(_rewrites(j, pol) for j in _sub_jaxprs(eqn)):
    if name == "shard_map":
      return _shard_map(eqn, invals, pol)
    if name in _REMAT:
      return _remat(eqn, invals, pol)
    params = dict(eqn.params)
    for key in _CLOSED[name]:
      v = params[key]
      params[key] = (
        type(v)(_closed(c, pol) for c in v) if isinstance(v, (tuple, list)) else _closed(v, pol)
      )
    eqn_params = prim.get_bind_params(params)
  else:
    eqn_params = prim.get_bind_params(eqn.params)
  out = prim.bind(*invals, **eqn_params)
  return list(out) if prim.multiple_results else [out]


def _closed(c: Any, pol: Policy) -> Any:
  """A sub-program with the same input types, its collectives rewritten."""
  if not _rewrites(c.jaxpr, pol):
    return c
  return _compat.trace_closed_jaxpr(lambda *a: _eval(c.jaxpr, c.consts, a, pol), c.in_avals)


def _shard_map(eqn: Any, invals: list, pol: Policy) -> list:
  p, body = eqn.params, eqn.params["jaxpr"]
  if body.constvars:
    raise NotImplementedError("compress: a shard_map body with constants")
  manual = p.get("newly_manual_axes", p.get("manual_axes"))
  f = jax.shard_map(
    lambda *a: tuple(_eval(body, (), a, pol)),
    mesh=p["mesh"],
    in_specs=tuple(p["in_specs"]),
    out_specs=tuple(p["out_specs"]),
    axis_names=set(manual),
    check_vma=p["check_vma"],
  )
  return list(f(*invals))


def _remat(eqn: Any, invals: list, pol: Policy) -> list:
  p, body = eqn.params, eqn.params["jaxpr"]
  f = jax.checkpoint(
    lambda *a: _eval(body, (), a, pol), prevent_cse=p["prevent_cse"], policy=p["policy"]
  )
  return list(f(*invals))


def _collective(eqn: Any, invals: list, axes: tuple, comp: Any, opts: dict) -> list:
  """The jcoccl op for a lax collective: its float operands in one call (one equation, as
  the lax equation was one), the others through the lax op."""
  name, p = eqn.primitive.name, eqn.params
  op = _OPS[name]
  outs: list = [None] * len(invals)
  floats = [i for i, x in enumerate(invals) if is_float(x.dtype)]
  for i, x in enumerate(invals):
    if i not in floats:
      y = eqn.primitive.bind(x, **eqn.primitive.get_bind_params(dict(p)))
      outs[i] = y[0] if eqn.primitive.multiple_results else y
  if not floats:
    return outs
  xs = [invals[i] for i in floats]
  if op == "all_reduce":
    ys = all_reduce(xs, axes, compressor=comp, **opts)
  elif op == "all_gather":
    ys = all_gather(
      xs, axes, axis=p["all_gather_dimension"], tiled=p["tiled"], compressor=comp, **opts
    )
  elif op == "reduce_scatter":
    ys = reduce_scatter(
      xs,
      axes,
      scatter_dimension=p["scatter_dimension"],
      tiled=p["tiled"],
      compressor=comp,
      **opts,
    )
  elif op == "all_to_all":
    ys = all_to_all(
      xs,
      p["axis_name"],
      p["split_axis"],
      p["concat_axis"],
      tiled=p["tiled"],
      compressor=comp,
      **opts,
    )
  else:
    ys = ppermute(xs, axes, [tuple(pair) for pair in p["perm"]], compressor=comp, **opts)
  for i, y in zip(floats, ys):
    outs[i] = y
  return outs

"""The generic driver every collective shares: each leaf of a call planned (checks, the
exact lax op off the mesh or uncompressed, threshold, backend, slices), then ONE
``jcoccl_<op>`` equation bound for all the leaves that need it (as ``lax.psum`` binds a
pytree once).

A leaf's parameters carry its :class:`jcoccl._src.base.reason.Reason` (``reason=``); a leaf
that takes the lax op is marked ``jcoccl.exact`` with its reason instead, so
:func:`jcoccl.explain` reads every decision from the program.

Example:
  >>> ys = apply("all_reduce", [g], None, [dict(axes=("x",), compressor=None,  # doctest: +SKIP
  ...     grad_compressor=None, backend="auto", chunks=1, min_bytes=None)])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jcoccl._src import _compat
from jcoccl._src.base import config as _config
from jcoccl._src.base import residual as R
from jcoccl._src.base.axes import ensure_varying, group_size, off_mesh
from jcoccl._src.base.lax_errors import lax_errors
from jcoccl._src.base.reason import exact as mark_exact
from jcoccl._src.base.reason import exact_scope, reason
from jcoccl._src.compressors import layout as L
from jcoccl._src.compressors.threshold import skip_reason, warn_default_threshold
from jcoccl._src.native import _backend
from jcoccl._src.ops.op_spec import Op, op, primitive
from jcoccl._src.ops.params import key_operand, merge_params, spec_of


@dataclasses.dataclass(frozen=True)
class Exact:
  """A leaf that took the exact lax op: its result."""

  value: Any


@dataclasses.dataclass(frozen=True)
class Bound:
  """A leaf for the primitive: its (varying-typed) operand and its parameters."""

  x: Any
  params: dict


def plan(
  o: Op,
  x: Any,
  *,
  axes: tuple,
  compressor: Any,
  grad_compressor: Any,
  backend: str,
  chunks: int,
  min_bytes: Any,
  strict: bool = True,
  residual: bool = False,
  **op_args: Any,
) -> Exact | Bound:
  """One leaf through the pipeline every collective shares (arguments already
  canonicalised): the op's checks; the exact lax op off the mesh or when neither
  direction compresses; else the settled compressor, the backend, a trace-time check of
  the slices, and the operand typed varying over ``axes``.

  Args:
    o: the op's spec.
    x: one array.
    axes, compressor, grad_compressor, backend, chunks, min_bytes: the call's, resolved.
    strict: a lone array (a non-float dtype with a lossy compressor raises TypeError)
      rather than a pytree leaf (such a leaf goes exactly).
    residual: the op returns its encoder's residual too (:mod:`jcoccl._src.base.residual`):
      a leaf whose forward goes exactly takes the lax op (backward included), and the
      xla backend runs it (the fused engine returns no residual).
    **op_args: the op's own arguments (``o.check`` normalises them).

  Returns:
    :class:`Exact` with the lax result, or :class:`Bound` for the primitive.
  """
  x = jnp.asarray(x)
  # A call that fails these checks gets lax's error for the same call where lax has one
  # (one name as the caller most likely wrote it: lax's words quote it).
  named = axes[0] if len(axes) == 1 else axes
  with lax_errors(o.name, o.exact, x, named, **op_args):
    n = group_size(axes)  # validates the axis names
    op_args = o.check(x, n, axes, **op_args)
  if off_mesh(axes):
    why = "a jax.vmap axis (off the mesh): nothing crosses a wire"
    return _exact(o, x, axes, op_args, compressor, why)
  unreduced = set(axes) & _compat.unreduced_axes(x)
  if residual and (o.back is None or unreduced):
    what = "x is unreduced" if o.back is not None else f"{o.name} has no encoder residual"
    raise ValueError(f"residual: {what}; call {o.name} without residual=")
  runs_on = _residual_backend(backend) if residual else backend
  if unreduced and o.unreduced_transpose is None:
    return _exact(o, x, axes, op_args, compressor, "x is unreduced: lax's op")
  if unreduced and unreduced != set(axes):
    raise ValueError(
      f"{o.name} over {axes}: x is unreduced over {sorted(unreduced)} only; "
      "sum over the unreduced and the other axes in two calls"
    )
  c = o.effective(x, compressor, min_bytes, strict)
  if c is None:
    warn_default_threshold(o.name, axes, x, compressor, min_bytes)
  gc = o.grad_for(x, grad_compressor)
  _backend.validate(o.name, backend)
  if c is None and (gc is None or residual):
    why = _skipped(x, compressor, min_bytes, strict) or "no compressor named"
    return _exact(o, x, axes, op_args, compressor, why)
  c, call = o.settle(x, c, axes, chunks=chunks, residual=residual, **op_args)
  chunks = call.pop("chunks", chunks)  # all_reduce's auto may chunk
  decision = call.pop("decision", None)  # all_reduce's: why auto chose so
  if residual and c is None:  # auto_exact chose the lax op
    why = "the exact op is predicted faster"
    return _exact(o, x, axes, op_args, compressor, why, decision)
  name = "xla"
  if c is not None:
    name = _backend.resolve(o.name, runs_on, axes, compressor=c, dtype=x.dtype, **call)[0]
    L.slices(chunks, o.row_length(x.size, n), o.unit(c, axes, **call))  # fail at trace time
  algo, why = call.get("algorithm", ""), "compressed"
  if c is None and algo != "exact":  # forward under the threshold, backward compressed
    algo = "exact" if algo else ""
    why = _skipped(x, compressor, min_bytes, strict) + " (backward: compressed)"
  params = dict(
    axes=axes,
    **{**op_args, **call},
    compressor=spec_of(c),
    grad_compressor=spec_of(gc),
    backend=name,
    backend_arg=backend,
    chunks=chunks,
    min_bytes=min_bytes,
    **({"residual": True} if residual else {}),
    reason=reason(compressor, algo, why, op_args.get("requested"), decision),
  )
  return Bound(ensure_varying(x, axes), params)


def _skipped(x: Any, compressor: Any, min_bytes: Any, strict: bool) -> str:
  """:func:`skip_reason` of the compressor named (of a per-level pair: its first level)."""
  levels = compressor if isinstance(compressor, tuple) else (compressor,)
  named = next((c for c in levels if c is not None), None)
  return skip_reason(x, named, min_bytes, strict)


def _residual_backend(backend: str) -> str:
  """The backend of a call that returns its encoder's residual: the xla backend's codec
  calls hand it out; the fused engine, one custom call, does not."""
  if backend == "fused":
    raise ValueError(
      "backend='fused' returns no encoder residual (residual=, jcoccl.error_feedback): "
      "use backend='xla' or 'auto' for this call"
    )
  return "xla" if backend == "auto" else backend


def _exact(
  o: Op, x: Any, axes: tuple, op_args: dict, named: Any, why: str, decision: Any = None
) -> Exact:
  """The lax op on ``x``, marked as jcoccl's own with the reason it runs
  (:mod:`jcoccl._src.base.reason`)."""
  algo = "exact" if o.name == "all_reduce" else ""
  with exact_scope():
    y = o.exact(x, axes, **op_args)
  because = reason(named, algo, why, op_args.get("requested"), decision)
  return Exact(mark_exact(o.name, axes, x, y, because))


def apply(name: str, xs: Sequence[Any], key: Any, args: Sequence[dict]) -> list:
  """The collective ``name`` on the arrays ``xs``, leaf ``i`` with ``args[i]``: exact
  leaves through lax, every other leaf through ONE ``jcoccl_<name>`` equation (as
  ``lax.psum`` binds a whole pytree once).

  Args:
    name: the op.
    xs: the leaves.
    key: PRNG key shared by the leaves, or None.
    args: per leaf, the keyword arguments of :func:`plan`.

  Returns:
    The results, in the order of ``xs``.
  """
  o = op(name)
  outs: list = [None] * len(xs)
  bound: list[tuple[int, Bound]] = []
  for i, (x, a) in enumerate(zip(xs, args)):
    planned = plan(o, x, **a)
    if isinstance(planned, Exact):
      outs[i] = planned.value
    else:
      bound.append((i, planned))
  if bound:
    ys = bind(name, [b.x for _, b in bound], key, [b.params for _, b in bound])
    for (i, _), y in zip(bound, ys):
      outs[i] = y
  return outs


def apply_residual(
  name: str, xs: Sequence[Any], key: Any, args: Sequence[dict], owed: Sequence[Any]
) -> tuple[list, list]:
  """:func:`apply` with error feedback: leaf ``i`` owes the residual ``owed[i]``, and the
  op returns the residual each leaf leaves (the rule of :mod:`jcoccl._src.base.residual`: a
  compressed leaf sends ``x + owed`` and keeps what its encoder lost, an exact leaf sends
  ``x`` and carries ``owed`` forward).

  Returns:
    (the results, the residuals), in the order of ``xs``.
  """
  o = op(name)
  outs: list = [None] * len(xs)
  kept: list = list(owed)  # exact leaves carry theirs forward
  bound: list[tuple[int, Bound, jax.Array]] = []
  for i, (x, a) in enumerate(zip(xs, args)):
    if jnp.shape(owed[i]) != jnp.shape(x):
      raise ValueError(
        f"residual: leaf {i} has shape {jnp.shape(owed[i])}, x's has {jnp.shape(x)} (the "
        "residual is shaped like the input: zeros from error_feedback(...).init(x) at first)"
      )
    planned = plan(o, x, residual=True, **a)
    if isinstance(planned, Exact):
      outs[i] = planned.value
      continue
    y, rest = R.feed(planned.x, owed[i])
    bound.append((i, Bound(y, planned.params), rest))
  if bound:
    ys = bind(name, [b.x for _, b, _ in bound], key, [b.params for _, b, _ in bound])
    for (i, _, rest), y, lost in zip(bound, ys, ys[len(bound) :]):
      outs[i], kept[i] = y, R.keep(lost, rest)
  return outs, kept


def apply_tree(name: str, tree: Any, key: Any, residual: Any = None, **args: Any) -> Any:
  """:func:`apply` over the leaves of a pytree, all with the same ``args``; given the
  ``residual`` each leaf owes (a pytree like ``tree``), :func:`apply_residual`'s
  (results, residuals) as two pytrees."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  every = [args] * len(leaves)
  if residual is None:
    return jax.tree_util.tree_unflatten(treedef, apply(name, leaves, key, every))
  owed = R.leaves_like(residual, treedef)
  outs, kept = apply_residual(name, leaves, key, every, owed)
  return tuple(jax.tree_util.tree_unflatten(treedef, v) for v in (outs, kept))


def bind(name: str, xs: Sequence[jax.Array], key: Any, params: Sequence[dict]) -> list:
  """Binds ``jcoccl_<name>`` once on the operands ``xs`` (``params[i]`` as :func:`plan`
  builds them for ``xs[i]``), with the current :class:`jcoccl._src.base.config.Config`
  captured as the ``config`` param: lowering and the derivative rules run under it,
  whatever config is current then."""
  keys, key_type = key_operand(key)
  merged = merge_params([{**p, "batch": 0, "config": _config.current()} for p in params])
  return primitive(name).bind(*xs, *keys, key_type=key_type, **merged)

"""The five collectives as JAX primitives, the generic driver that binds them, and the one
table of their duals.

Each op module (all_reduce.py, all_gather.py, ...) describes its collective with an
:class:`Op` spec and registers it here. :func:`apply` plans every leaf of a call with the
spec (:func:`plan`: the pipeline all ops share) and binds one ``jcoccl_<op>`` equation
for the leaves that need it: the primitive takes one operand per leaf (and returns one
result per leaf), as ``lax.psum`` binds a pytree once. Its rules, applied per operand:

  abstract evaluation: shape and dtype from :attr:`Op.out_shape`; varying manual axes as
    lax's collectives type them (all_reduce removes ``axes``, the others keep the input's);
    a named-axis effect per axis, as lax's collectives have.
  lowering: :attr:`Op.forward` (the chosen algorithm on the chosen backend) traced and
    lowered in place, inside shard_map's manual lowering context; operands of one wire
    format (see :func:`bucket_key`) and are under :data:`PACK_MAX_BYTES` are packed into
    one row layout and travel as ONE encode -> collective -> decode chain
    (:func:`jcoccl._src.layout.run_packed`), with the same bits per leaf as alone.
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
import importlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jcoccl._src import _backend, _compat, compressor_args
from jcoccl._src import config as _config
from jcoccl._src import layout as L
from jcoccl._src import residual as R
from jcoccl._src.axes import ensure_varying, group_size, match_vma, off_mesh
from jcoccl._src.lax_errors import lax_errors
from jcoccl._src.params import PerLeaf as PerLeaf
from jcoccl._src.params import grad_args as grad_args
from jcoccl._src.params import key_operand, leaf_params, merge_params, unwrap_key
from jcoccl._src.params import load as load
from jcoccl._src.params import spec_of as spec_of
from jcoccl._src.reason import exact as mark_exact
from jcoccl._src.reason import exact_scope, reason
from jcoccl._src.threshold import effective_compressor, skip_reason, warn_default_threshold

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
  """One collective's spec, the row the generic driver (:func:`plan`, :func:`apply`) and
  the primitive's rules read (see the module docstring).

  Attributes:
    name: the op (a key of :data:`DUALS`).
    out_shape: ``(element shape, params) -> element output shape``.
    reduces: ``params -> bool``: the output is invariant over ``axes`` (all_reduce;
      all_gather with ``to="invarying"``).
    forward: ``(x, key, **params) -> y``: the collective on ``x``, which has
      ``params["batch"]`` leading batch axes; ``key`` is a PRNG key or None.
    check: ``(x, n, axes, **op_args) -> op_args``: the op's own argument checks on one
      array over a group of ``n`` ranks, returning them normalised (e.g. negative axes).
    exact: ``(x, axes, **op_args) -> y``: the lax collective with the same semantics (the
      path of uncompressed leaves and of axes bound off the mesh).
    tangent_args: ``params -> args`` of :func:`plan` for the tangent (grad compressor).
    dual_args: ``params -> args`` of the dual op's :func:`plan` for the cotangent.
    invariant_transpose: ``(ct, params) -> ct_x`` where the output is invariant over
      ``axes`` under check_vma and so is the cotangent: no communication is needed (lax's
      psum: a broadcast; all_gather to="invarying": this rank's block).
    row_length: ``(size, n) -> elements`` of one row of the message (the whole message, or
      one destination's block).
    settle: ``(x, c, axes, chunks=, **op_args) -> (c, call)``: the compressor as it runs
      (``call["chunks"]``, when given, replaces the slices) and the
      op's extra call parameters (all_reduce: the algorithm, which the backend check and
      the slice unit need).
    unit: ``(c, axes, **call) -> elements`` of the smallest slice.
    effective: ``(x, compressor, min_bytes, strict) -> compressor or None`` after the
      dtype and size threshold; ``grad_for`` the same for the backward compressor.
    unreduced_transpose: ``(ct, params) -> ct_x`` for the ops that sum an input unreduced
      over ``axes`` as lax does (psum, psum_scatter: each device's partial is its
      operand), the cotangent typed as lax types it; None: such an input takes the lax op,
      which raises lax's error.
    rows: ``(x, key, **params) -> Rows or None``: the leaf as the backend's rows
      (:class:`jcoccl._src.layout.Rows`; None where the exact lax op runs), for packing
      the leaves of one equation (``forward`` is then ``rows(...).run(chunks)``); None:
      every leaf is lowered on its own. With ``params["residual"]`` its ``call``
      returns (result rows, the encoder's residual rows in the input's layout).
    back: ``(element shape, params) -> fn``, ``fn`` the inverse of the rows' ``pre``
      (one message's rows -> the message), for an op that can return its encoder's
      residual (:mod:`jcoccl._src.residual`); None: it cannot.
  """

  name: str
  out_shape: Callable[..., tuple]
  reduces: Callable[[dict], bool]
  forward: Callable[..., Any]
  check: Callable[..., dict]
  exact: Callable[..., Any]
  tangent_args: Callable[[dict], dict]
  dual_args: Callable[[dict], dict]
  invariant_transpose: Callable[..., Any] | None = None
  row_length: Callable[[int, int], int] = lambda size, n: size
  settle: Callable[..., tuple] = lambda x, c, axes, **_: (c, {})
  unit: Callable[..., int] = lambda c, axes, **_: c.granule
  effective: Callable[..., Any] = effective_compressor
  grad_for: Callable[..., Any] = compressor_args.grad_for
  unreduced_transpose: Callable[..., Any] | None = None
  rows: Callable[..., Any] | None = None
  back: Callable[..., Any] | None = None


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
# The generic driver: each leaf planned (checks, exact fallback, threshold, backend), then
# one bind for every compressed leaf of the call.


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
    residual: the op returns its encoder's residual too (:mod:`jcoccl._src.residual`):
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
  (:mod:`jcoccl._src.reason`)."""
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
  op returns the residual each leaf leaves (the rule of :mod:`jcoccl._src.residual`: a
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


# ----------------------------------------------------------------------------------------
# Rules.


def bind(name: str, xs: Sequence[jax.Array], key: Any, params: Sequence[dict]) -> list:
  """Binds ``jcoccl_<name>`` once on the operands ``xs`` (``params[i]`` as :func:`plan`
  builds them for ``xs[i]``), with the current :class:`jcoccl._src.config.Config`
  captured as the ``config`` param: lowering and the derivative rules run under it,
  whatever config is current then."""
  keys, key_type = key_operand(key)
  merged = merge_params([{**p, "batch": 0, "config": _config.current()} for p in params])
  return primitive(name).bind(*xs, *keys, key_type=key_type, **merged)


def _batched(fn: Callable, xs: Sequence[jax.Array], nbs: Sequence[int]) -> list:
  """``fn`` (a list of leaves -> a list of results) vmapped over each leaf's ``nbs[i]``
  leading batch axes (a leaf with fewer is not mapped by the inner vmaps)."""
  for k in reversed(range(max(nbs, default=0))):
    dims = [0 if nb > k else None for nb in nbs]
    fn = jax.vmap(fn, in_axes=(dims,), out_axes=dims)
  return fn(list(xs))


def _split(args: Sequence[Any], key_type: Any) -> tuple[list, list]:
  n = len(args) - (key_type is not None)
  return list(args[:n]), list(args[n:])


def _make(o: Op) -> Any:
  p = _compat.new_primitive(f"jcoccl_{o.name}")

  def abstract_eval(*avals, key_type, **params):
    xs, _ = _split(avals, key_type)
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
    if params.get("residual"):  # the encoder's residual: float32, shaped like the input
      f32 = jnp.dtype(jnp.float32)
      outs += [
        _compat.collective_aval(a, a.shape, _compat.aval_vma(a)).update(dtype=f32) for a in xs
      ]
    return outs, params["axes"]

  def lower(*args, key_type, config, reason=None, **params):
    del reason  # what explain reads; not the wire's
    xs, keys = _split(args, key_type)
    key = unwrap_key(tuple(keys), key_type)
    with _config.using(config):
      return lower_leaves(o, xs, key, [leaf_params(params, i) for i in range(len(xs))])

  def jvp(primals, tangents, **params):
    with _config.using(params["config"]):
      return _jvp(primals, tangents, **params)

  def transpose(cts, *args, **params):
    with _config.using(params["config"]):
      return _transpose(cts, *args, **params)

  def _jvp(primals, tangents, *, key_type, **params):
    ys = p.bind(*primals, key_type=key_type, **params)
    # The residual's tangent is zero: straight-through, decode(encode(y)) moves as y does.
    n = len(ys) // 2 if params.get("residual") else len(ys)
    live = [i for i in range(n) if not _compat.is_zero_cotangent(tangents[i])]
    touts = [_compat.zero_tangent_of(y) for y in ys]
    if live:
      lps = [leaf_params(params, i) for i in live]
      args = [o.tangent_args(lp) for lp in lps]
      ts = [_compat.instantiate_zero(tangents[i]) for i in live]
      got = _batched(lambda vs: apply(o.name, vs, None, args), ts, [lp["batch"] for lp in lps])
      for i, t in zip(live, got):
        touts[i] = t
    return ys, touts

  def _transpose(cts, *args, key_type, **params):
    xs, keys = _split(args, key_type)
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
        res[i] = _batched(lambda v, lp=lp: [o.unreduced_transpose(v[0], lp)], [ct], nb)[0]
      elif o.reduces(lp) and set(lp["axes"]) <= vma:
        out = _batched(lambda v, lp=lp: [o.invariant_transpose(v[0], lp)], [ct], nb)[0]
        res[i] = match_vma(out, vma)
      else:
        dual_idx.append(i)
    if dual_idx:
      lps = [leaf_params(params, i) for i in dual_idx]
      dargs = [o.dual_args(lp) for lp in lps]
      got = _batched(
        lambda vs: apply(DUALS[o.name], vs, None, dargs),
        [cts[i] for i in dual_idx],
        [lp["batch"] for lp in lps],
      )
      for i, g in zip(dual_idx, got):
        res[i] = match_vma(g, _compat.aval_vma(_compat.undefined_aval(xs[i])))
    return res + [None] * len(keys)

  def batch(args, dims, *, key_type, **params):
    xs, keys = _split(args, key_type)
    xds, kds = dims[: len(xs)], dims[len(xs) :]
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    if keys:
      # Per-call random streams: one call per batch element.
      def take(a, d, i):
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
    dims = [None if d is None else 0 for d in xds]
    return outs, dims * (len(outs) // len(dims))

  _compat.define_collective(
    p, abstract_eval=abstract_eval, lower=lower, jvp=jvp, transpose=transpose, batch=batch
  )
  return p


# ----------------------------------------------------------------------------------------
# Lowering: the leaves of one equation, bucketed by wire format.

# Codec kinds whose blocks (of the granule) are encoded, summed and decoded independently
# of each other and of where they sit in the row: packing whole blocks end to end leaves
# every block's bits unchanged. A custom or plugin codec promises only that row lengths
# are multiples of its granule (it may read the whole row), so its leaves go alone.
BLOCKWISE_KINDS = frozenset({"none", "cast", "int", "fp8", "error_bounded", "hadamard", "spike"})


def blockwise(c: Any) -> bool:
  """Whether ``c`` (a compressor, None, or a per-level tuple) is one of jcoccl's own
  block-wise codecs (wrappers: their inner codec too), whose leaves may be packed.

  Example:
    >>> blockwise(load("hadamard(int4)")), blockwise(None)
    (True, True)
  """
  if c is None:
    return True
  if isinstance(c, tuple):
    return all(blockwise(v) for v in c)
  own = type(c).__module__.startswith("jcoccl._src.compressors.")
  inner = getattr(c, "inner", None)
  return own and getattr(c, "kind", None) in BLOCKWISE_KINDS and blockwise(inner)


# A leaf of this many bytes or more goes alone, as DDP's bucket cap leaves a large gradient
# in a bucket of its own: packing copies a leaf into the row and its result (and residual)
# back out, two or three passes over its bytes, which for large leaves cost more than the
# chain they save (XLA:CPU, GPT 'wide' train step of benchmarks/train_e2e.py, 20 gradient
# leaves of 4 KiB to 16 MiB: all packed, 1.5x the step time of per-leaf chains).
PACK_MAX_BYTES = 1 << 20


def packable(x: jax.Array) -> bool:
  """Whether leaf ``x`` is small enough to share a packed chain (:data:`PACK_MAX_BYTES`).

  Example:
    >>> packable(jnp.zeros(1000)), packable(jnp.zeros(1 << 18))
    (True, False)
  """
  return math.prod(jnp.shape(x)) * jnp.dtype(x.dtype).itemsize < PACK_MAX_BYTES


def bucket_key(x: jax.Array, params: dict, rows: Any) -> tuple:
  """What two leaves of one equation must share to travel as one chain: the group (with
  the op, it fixes the rows' leading shape), the codec, the backend, the slices, the
  dtype, and the op's own wire parameters (all_reduce's algorithm, ppermute's pairs)."""
  return (
    params["axes"],
    params["compressor"],
    params["backend"],
    params["chunks"],
    jnp.dtype(x.dtype).name,
    rows.unit,
    rows.block,
    rows.wire,
  )


def _at_lowering(o: Op, x: jax.Array, lp: dict) -> dict:
  """Leaf parameters with auto's "fused" checked against the lowering's concrete mesh
  (:func:`jcoccl._src._backend.at_lowering`)."""
  if lp.get("backend") != "fused":
    return lp
  algo = {"algorithm": lp["algorithm"]} if "algorithm" in lp else {}
  c = load(lp["compressor"])
  return _backend.at_lowering(o.name, lp, compressor=c, dtype=x.dtype, **algo)


def lower_leaves(o: Op, xs: Sequence[jax.Array], key: Any, lps: Sequence[dict]) -> list:
  """The forward of every leaf of one equation (``lps[i]``: leaf i's parameters), the
  leaves bucketed: those with equal :func:`bucket_key` run as ONE chain
  (:func:`jcoccl._src.layout.run_packed`), bit-identical per leaf to
  :attr:`Op.forward` alone. A leaf goes alone when it is the only one of its bucket, when
  it has :data:`PACK_MAX_BYTES` or more (:func:`packable`), when the call has a PRNG key
  (each leaf's random stream is drawn by its position in its own row), when its codec is
  not :func:`blockwise`, or on the exact path.

  With the ``residual`` parameter each leaf's encoder residual follows the results: the
  same call returns both, and each is cut back out of its rows (:attr:`L.Rows.back`).

  Returns:
    The results (then the residuals), in the order of ``xs``.
  """
  n = len(xs)
  residual = bool(lps and lps[0].get("residual"))
  outs: list = [None] * (2 * n if residual else n)
  buckets: dict[tuple, list[tuple[int, L.Rows]]] = {}
  lps = [_at_lowering(o, x, lp) for x, lp in zip(xs, lps)]
  for i, (x, lp) in enumerate(zip(xs, lps)):
    pack = (
      o.rows is not None
      and key is None
      and n > 1
      and packable(x)
      and blockwise(load(lp["compressor"]))
    )
    rows = o.rows(x, key, **lp) if o.rows is not None and (pack or residual) else None
    if rows is None:
      outs[i] = o.forward(x, key, **lp)
      continue
    if residual and o.back is not None:  # the call returns (result, residual) rows
      rows = dataclasses.replace(rows, back=o.back(x.shape[lp["batch"] :], lp))
    buckets.setdefault(bucket_key(x, lp, rows) if pack else ("alone", i), []).append((i, rows))
  for members in buckets.values():
    chunks = lps[members[0][0]]["chunks"]
    same = [r for _, r in members]
    ys = [same[0].run(chunks)] if len(same) == 1 else L.run_packed(same, chunks)
    for (i, _), y in zip(members, ys):
      if isinstance(y, tuple):
        outs[i], outs[n + i] = y
      else:
        outs[i] = y
  return outs


def register(o: Op) -> None:
  """Registers ``o`` and defines its primitive."""
  if o.name not in DUALS:
    raise ValueError(f"op must be one of {tuple(DUALS)}, got {o.name!r}")
  _OPS[o.name] = o
  _PRIMS[o.name] = _make(o)

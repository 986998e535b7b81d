"""Compressed all_reduce: one_shot, two_shot and hierarchical algorithms (no re-quantizing
ring), chosen by a documented cost model when algorithm="auto"."""

from __future__ import annotations

import math
from typing import Any

import jax
from jax import lax

from jcoccl._src import _compat
from jcoccl._src.base import reason as _reason
from jcoccl._src.base import residual as R
from jcoccl._src.base.axes import canonical_axes, group_size, rank_key
from jcoccl._src.compressors import layout as L
from jcoccl._src.compressors.compressor_args import (
  SAME,
  check_chunks,
  grad_for,
  is_lone_array,
  resolve_compressor,
)
from jcoccl._src.compressors.payloads import (
  decode_rows,
  decode_sum,
  decode_sum_encode,
  encode_rows,
  gather_decode,
  gather_method,
  gather_payloads,
  side_by_side,
)
from jcoccl._src.compressors.rows import Rows
from jcoccl._src.compressors.threshold import effective_compressor
from jcoccl._src.native import _backend
from jcoccl._src.ops import all_gather as _ag
from jcoccl._src.ops import primitives as P
from jcoccl._src.ops import reduce_scatter as _rs
from jcoccl._src.ops.all_reduce_auto import AUTO, decision

ALGORITHMS = ("auto", "auto_exact", "one_shot", "two_shot", "hierarchical")
AUTO_PREFIX = "auto:"  # compressor="auto:<spec>": algorithm "auto_exact" with <spec>


def all_reduce(
  x: Any,
  axis_name: Any,
  *,
  compressor: Any = None,
  algorithm: str = "auto",
  backend: str = "auto",
  chunks: int = 1,
  min_bytes: int | None = None,
  grad_compressor: Any = SAME,
  key: Any = None,
  axis_index_groups: Any = None,
  residual: Any = None,
) -> Any:
  """Sums ``x`` over ``axis_name``, as ``jax.lax.psum``, optionally compressed.

  Algorithms (none re-quantizes at every hop):
    one_shot: encode the local value once, ``lax.all_gather`` the payloads, every rank
      decodes all n payloads and sums them in float32 in rank order (1 quantization).
    two_shot: one_shot reduce_scatter (encode per destination, all_to_all, decode-sum),
      re-encode the reduced shard (``decode_sum_encode``), all_gather, decode
      (2 quantizations; 2(n-1)/n of the payload on the wire instead of (n-1)).
    hierarchical: over a tuple of axes (outer..., inner), e.g. ("node", "gpu"):
      reduce_scatter over the inner axis, one_shot all_reduce of the shard over the outer
      axes, all_gather over the inner axis. ``compressor`` may then be a pair
      (outer, inner) or a dict {axis name (or the tuple of outer names): compressor}, e.g.
      8-bit inside a node and 4-bit between nodes.
    auto: hierarchical when ``compressor`` is per level; otherwise the least predicted
      time among the compressed algorithms (one_shot, two_shot, and with a calibration
      their chunked variants and hierarchical) under the alpha-beta-gamma model of
      :mod:`jcoccl._src.base.cost_model`:
        T_one = a(n-1) + (n-1) r S / b + (1+n) S / g
        T_two = 2a(n-1) + 2(n-1)/n r S / b + (3+1/n) S / g
      (S bytes, r payload/raw ratio, n ranks; a, b, g measured on the link and backend in
      use: :func:`jcoccl.calibrate`, or ``python -m jcoccl.bench collectives --fit-out``
      and ``JCOCCL_COST_MODEL=m.json``), i.e. one_shot for small messages or n <= 2,
      two_shot for large ones on many ranks. With no cost model at all (the platform's
      default) it picks by size: one_shot under 256 KiB per leaf
      (:data:`jcoccl._src.ops.all_reduce_auto.TWO_SHOT_MIN_BYTES`) or on 2 ranks, two_shot
      from there. Without a calibration it never sends more bytes than ``lax.psum``
      (ring: 2(n-1)/n S) with a codec that shrinks its input: one_shot, (n-1) r S, is a
      candidate only where r <= 2/n.
    auto_exact: as auto, and the exact lax op is a candidate too (under a calibrated cost
      model only; it must be predicted faster by
      :data:`jcoccl._src.base.cost_model.EXACT_MARGIN`). ``compressor="auto:<spec>"`` and a
      policy's ``all_reduce = "auto:<spec>"`` ask for it.

  The rule: a codec named explicitly is used. ``algorithm="auto"`` (the default) only
  chooses how to send it; the exact op replaces it only where the caller opted in with
  ``"auto:<spec>"`` (or ``algorithm="auto_exact"``). Leaves under ``min_bytes`` or of a
  non-float dtype in a pytree still go exactly (a :class:`jcoccl.SkippedCompression`
  warning says so where the default ``min_bytes`` dropped a named codec).
  :func:`jcoccl.explain` lists what each call decided, with the predicted seconds of each
  candidate and the cost model's source; the decision is also in the jaxpr
  (``jcoccl_all_reduce[algorithm=two_shot ... requested=auto ...]``) and in
  ``jcoccl.wire_bytes(...)["choices"]``.

  Every rank of the group gets a bitwise-identical result (all decode the same payloads in
  the same order). The output is device-invariant over ``axis_name`` (as lax.psum's). The
  transpose is lax.psum's: under ``check_vma=True`` a broadcast (no communication);
  without it a compressed all_reduce with ``grad_compressor``.

  Args:
    x: array or pytree of arrays (local values inside ``jax.shard_map``).
    axis_name: mesh axis name or tuple of names.
    compressor: Compressor, spec string, None (exact: calls lax.psum), or per level
      (pair or dict) for "hierarchical". A spec string ``"auto:<spec>"`` (e.g.
      ``"auto:int8"``) is ``<spec>`` with ``algorithm="auto_exact"``.
    algorithm: "auto", "auto_exact", "one_shot", "two_shot" or "hierarchical".
    backend: "auto" (the fused engine where :func:`jcoccl.init` made it able to run this
      call, else "xla"), "xla" or "fused" (ValueError saying why when it cannot).
    chunks: split the message into this many independently processed slices so that
      communication of one overlaps codec work of another (slice boundaries are granule
      multiples, so results are bitwise identical to chunks=1). A slice holds at least one
      granule (two_shot: one per rank; hierarchical: one per inner rank), so larger values
      are clamped to what the message holds, with the same bits; a message that would
      still be cut into more than 64 slices raises ValueError. Measured on 8 host CPU
      devices (2 cores, 1 MiB int8): chunks=4 is 20-30% slower than chunks=1, since XLA
      CPU runs collectives synchronously; the overlap needs an asynchronous backend (GPU).
    min_bytes: leaves smaller than this (bytes) go uncompressed; None = the default
      (``jcoccl.set_config_defaults(min_bytes=...)``, env ``JCOCCL_MIN_BYTES``, 4 MiB).
    grad_compressor: compressor of the backward pass; default: ``compressor``.
    key: PRNG key for stochastic-rounding compressors; leaf i of several rounds with
      ``jax.random.fold_in(key, i)``, so leaves round independently; under jax.grad or
      jax.jvp the derivative's collective rounds with the key folded once more.
    axis_index_groups: as lax's; given, the exact lax op runs (the compressed algorithms
      work over whole mesh axes).
    residual: error feedback (:func:`jcoccl.error_feedback` wraps it): None, or what each
      leaf owes from earlier calls, float32 arrays in a pytree like ``x`` (zeros at
      first). A compressed leaf then sends ``x + residual`` and the call also returns
      what its encoder lost of that (``y - decode(encode(y))`` of the payload this rank
      sent, its first quantization under two_shot); a leaf that goes exactly sends ``x``
      and carries its residual forward unchanged (:mod:`jcoccl._src.base.residual`). The
      algorithm is one_shot or two_shot (auto charges the residual's decode pass to
      compression), on the xla backend.

  Pytree leaves that are not float32/bfloat16/float16 (and leaves under ``min_bytes``) go
  exactly; a lone array of another dtype with a lossy compressor raises TypeError.

  Returns:
    The sum(s), shaped and typed like ``x``; with ``residual``, the pair (sums, new
    residuals).

  Example:
    >>> y = jcoccl.all_reduce(g, "data", compressor="int8", min_bytes=0)  # doctest: +SKIP
    >>> y, e = jcoccl.all_reduce(g, "data", compressor="int8", residual=e)  # doctest: +SKIP
    >>> y = jcoccl.all_reduce(g, "data", compressor="auto:int8")  # may run lax.psum  # doctest: +SKIP
  """
  axes = canonical_axes(axis_name, empty=True)
  if algorithm not in ALGORITHMS:
    raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
  compressor, algorithm = split_auto(compressor, algorithm)
  if axis_index_groups is not None:
    with _reason.exact_scope():
      out = lax.psum(x, axes, axis_index_groups=axis_index_groups)
    why = "axis_index_groups: the lax op (compression works over whole mesh axes)"
    out = _reason.exact("all_reduce", axes, x, out, _reason.reason(compressor, "exact", why))
    return out if residual is None else (out, residual)
  comp = resolve_levels(compressor, axes, "compressor")
  gcomp = (
    comp
    if (isinstance(grad_compressor, str) and grad_compressor == SAME)
    else (resolve_levels(grad_compressor, axes, "grad_compressor"))
  )
  if isinstance(comp, tuple) and algorithm not in (*AUTO, "hierarchical"):
    raise ValueError(
      f"a per-level compressor needs algorithm='hierarchical', 'auto' or 'auto_exact', "
      f"got algorithm={algorithm!r}"
    )
  if algorithm == "hierarchical" and len(axes) < 2:
    raise ValueError(
      f"algorithm='hierarchical' needs a tuple of at least two axis names "
      f"(outer..., inner), got axis_name={axis_name!r}"
    )
  check_chunks(chunks)
  return P.apply_tree(
    "all_reduce",
    x,
    key,
    axes=axes,
    compressor=comp,
    grad_compressor=gcomp,
    backend=backend,
    chunks=chunks,
    min_bytes=min_bytes,
    strict=is_lone_array(x),
    algorithm=algorithm,
    residual=residual,
  )


def split_auto(compressor: Any, algorithm: str) -> tuple[Any, str]:
  """``compressor="auto:<spec>"`` as (``<spec>``, "auto_exact"); other values unchanged.

  Raises:
    ValueError: an ``"auto:"`` spec with an algorithm other than auto.

  Example:
    >>> split_auto("auto:int8", "auto")
    ('int8', 'auto_exact')
  """
  if not (isinstance(compressor, str) and compressor.strip().startswith(AUTO_PREFIX)):
    return compressor, algorithm
  if algorithm not in AUTO:
    raise ValueError(
      f"compressor={compressor!r} lets algorithm='auto' choose the exact op, but "
      f"algorithm={algorithm!r} pins one; write compressor="
      f"{compressor.strip()[len(AUTO_PREFIX) :]!r} to pin it, or leave algorithm='auto'"
    )
  return compressor.strip()[len(AUTO_PREFIX) :], "auto_exact"


def resolve_levels(compressor: Any, axes: tuple, argname: str) -> Any:
  """A Compressor/None, or a pair (outer, inner) for per-level compressors."""
  if isinstance(compressor, dict):
    if len(axes) < 2:
      raise ValueError(f"a per-level {argname} needs a tuple of axis names")
    outer, inner = axes[:-1], axes[-1]
    unknown = [k for k in compressor if k not in (inner, outer, *outer)]
    if unknown:
      raise ValueError(
        f"{argname} dict keys must be mesh axis names among {axes} (or the "
        f"tuple of outer names {outer}), got {unknown}"
      )
    out_c = compressor.get(outer, compressor.get(outer[0]) if len(outer) == 1 else None)
    compressor = (out_c, compressor.get(inner))
  if isinstance(compressor, (tuple, list)):
    if len(compressor) != 2:
      raise ValueError(f"a per-level {argname} must be a pair (outer, inner), got {compressor!r}")
    if len(axes) < 2:
      raise ValueError(f"a per-level {argname} needs a tuple of at least two axis names")
    return tuple(resolve_compressor(c, argname) for c in compressor)
  return resolve_compressor(compressor, argname)


def slice_unit(comp: Any, algorithm: str, axes: tuple) -> int:
  """Elements of the smallest slice: the granule, times the ranks a slice is split over."""
  if algorithm == "hierarchical":
    levels = comp if isinstance(comp, tuple) else (comp, comp)
    g = L.lcm(*(1 if c is None else c.granule for c in levels))
    return group_size(axes[-1:]) * g
  if algorithm == "two_shot":
    return group_size(axes) * comp.granule
  return comp.granule


def row_layout(m: int, comp: Any, algorithm: str, axes: tuple, chunks: int) -> L.RowLayout:
  """The layout of an ``m``-element message's row: padded to a multiple of (slices x
  slice unit), with ``chunks`` clamped as in :func:`jcoccl._src.compressors.layout.slices`."""
  return L.RowLayout.of(m, slice_unit(comp, algorithm, axes), chunks)


def _check(
  x: jax.Array, n: int, axes: tuple, *, algorithm: str = "auto", requested: str | None = None
) -> dict:
  # ``requested`` (what the caller asked auto for) stays in the params: the jaxpr shows
  # "auto" and "auto_exact" apart, and a cotangent decides again under the same rule.
  del x, n, axes
  return dict(algorithm=algorithm, requested=algorithm if requested is None else requested)


def _exact(
  x: jax.Array, axes: tuple, *, algorithm: str = "auto", requested: Any = None
) -> jax.Array:
  del algorithm, requested  # (defaults: lax_errors calls it with the caller's arguments)
  return lax.psum(x, axes)


def _effective(x: jax.Array, comp: Any, min_bytes: Any, strict: bool) -> Any:
  if isinstance(comp, tuple):
    levels = tuple(effective_compressor(x, c, min_bytes, strict) for c in comp)
    return None if all(c is None for c in levels) else levels
  return effective_compressor(x, comp, min_bytes, strict)


def _grad_for(x: jax.Array, gcomp: Any) -> Any:
  if isinstance(gcomp, tuple):
    levels = tuple(grad_for(x, c) for c in gcomp)
    return None if all(c is None for c in levels) else levels
  return grad_for(x, gcomp)


# The codec passes a call with ``residual`` makes beyond the plain op's: the decode of the
# payload this rank sent (its encode is the op's own).
RESIDUAL_PASSES = 1


def _settle(
  x: jax.Array,
  c: Any,
  axes: tuple,
  *,
  algorithm: str,
  requested: str,
  chunks: int = 1,
  residual: bool = False,
) -> tuple[Any, dict]:
  """The algorithm that runs (the exact path of a backward-only call: one_shot; "exact"
  where auto_exact chose the lax op: still bound, so the choice shows in the jaxpr), the
  slices (auto may chunk), and the compressor as a per-level pair for "hierarchical".
  With ``residual`` auto keeps to one_shot and two_shot (the residual is defined for a
  rank's own whole input) and charges the residual's decode."""
  del requested  # _check made it the algorithm asked for
  if c is None:
    return None, dict(algorithm="one_shot")
  if residual and (algorithm == "hierarchical" or isinstance(c, tuple)):
    raise ValueError(
      "residual: all_reduce returns its encoder's residual under one_shot and two_shot, "
      "not hierarchical (a per-level compressor): pass one compressor"
    )
  passes = RESIDUAL_PASSES if residual else 0
  d = decision(c, algorithm, axes, x, chunks, flat=residual, codec_passes=passes)
  c = d.compressor
  if d.algorithm == "hierarchical" and not isinstance(c, tuple):
    c = (c, c)
  return c, dict(algorithm=d.algorithm, chunks=d.chunks, decision=d)


def _rows(
  x: jax.Array,
  key: Any,
  *,
  axes: tuple,
  compressor: Any,
  algorithm: str,
  backend: str,
  batch: int,
  residual: bool = False,
  **_: Any,
) -> Rows | None:
  """The leaf as one row for the backend (None: the exact lax.psum runs); with
  ``residual`` its call returns the encoder's residual rows too."""
  comp = P.load(compressor)
  if comp is None:
    return None
  if set(axes) & _compat.unreduced_axes(x):
    x = _compat.unreduced_as_varying(x, axes)  # each device's partial is one operand
  shape = x.shape[batch:]
  levels = comp if isinstance(comp, tuple) else (comp,)
  impl = _backend.implementation("all_reduce", backend)
  more = {"residual": True} if residual else {}
  joint = None
  if impl is _xla_all_reduce and algorithm in _FLAT and gather_method() != "all_to_all":
    joint = lambda pairs: _joint(pairs, axes, algorithm, residual)
  return Rows(
    x,
    batch,
    L.flat_row,
    lambda r: r.reshape(shape),
    math.prod(shape),
    slice_unit(comp, algorithm, axes),
    L.lcm(*(c.granule for c in levels if c is not None)),
    lambda r, k: impl(
      r, axes=axes, compressor=comp, algorithm=algorithm, chunks=k, key=key, **more
    ),
    wire=(algorithm,),
    codec=comp,
    joint=joint,
  )


def _forward(x: jax.Array, key: Any, **params: Any) -> jax.Array:
  rows = _rows(x, key, **params)
  return lax.psum(x, params["axes"]) if rows is None else rows.run(params["chunks"])


def _grad_args(params: dict) -> dict:
  """Arguments of :func:`jcoccl._src.ops.primitives.plan` for the tangent and for the cotangent (its own dual)."""
  algo, requested = params["algorithm"], params["requested"]
  # A hierarchical call without a gradient compressor has no per-level pair to use; a
  # cotangent's own call decides again what auto chose for the primal, under the rule the
  # caller asked for (auto_exact may choose the exact op again, auto may not).
  if algo == "exact" or (algo == "hierarchical" and not P.load(params["grad_compressor"])):
    algo = requested if requested in AUTO else "auto"
  return P.grad_args(params, algorithm=algo, requested=algo)


P.register(
  P.Op(
    "all_reduce",
    out_shape=lambda shape, params: shape,
    reduces=lambda params: True,
    forward=_forward,
    rows=_rows,
    back=lambda shape, params: lambda r: r.reshape(shape),
    check=_check,
    exact=_exact,
    tangent_args=_grad_args,
    dual_args=_grad_args,
    # lax.psum's transpose under check_vma: the invariant cotangent itself.
    invariant_transpose=lambda ct, params: ct,
    settle=_settle,
    unit=lambda c, axes, *, algorithm: slice_unit(c, algorithm, axes),
    effective=_effective,
    grad_for=_grad_for,
    # lax.psum of an unreduced value transposes to the cotangent typed reduced.
    unreduced_transpose=lambda ct, params: lax.pcast(ct, params["axes"], to="reduced"),
  )
)


# ----------------------------------------------------------------------------------------
# XLA backend.


def _one_shot(xs: jax.Array, axes: tuple, comp: Any, key: Any, residual: bool = False) -> Any:
  if comp is None:
    return lax.psum(xs, axes)
  buf = encode_rows(comp, xs[None], key=key)
  out = gather_decode(comp, buf[0], axes, xs.shape[-1], xs.dtype, sum_rows=True, invariant=True)
  if not residual:
    return out
  return out, R.lost(xs, decode_rows(comp, buf, xs.shape[-1], xs.dtype)[0])


def _two_shot(xs: jax.Array, axes: tuple, comp: Any, key: Any, residual: bool = False) -> Any:
  n = group_size(axes)
  width = xs.shape[-1] // n
  buf = encode_rows(comp, L.rank_rows(xs, n), key=key)
  got = lax.all_to_all(buf, axes, 0, 0, tiled=True)
  # The second quantization (of the reduced shard) rounds on a stream of its own: drawn
  # from ``key`` itself, its bits would repeat those of the first row encoded above.
  again = None if key is None else jax.random.fold_in(key, 1)
  shard = decode_sum_encode(comp, got, width, xs.dtype, again)
  out = L.flat_row(
    gather_decode(comp, shard, axes, width, xs.dtype, sum_rows=False, invariant=True)
  )
  if not residual:
    return out
  return out, R.lost(xs, L.flat_row(decode_rows(comp, buf, width, xs.dtype)))


def _hierarchical(xs: jax.Array, axes: tuple, comp: Any, key: Any) -> jax.Array:
  outer, inner = axes[:-1], axes[-1:]
  c_out, c_in = comp
  n_in = group_size(inner)
  # Distinct stochastic-rounding streams per rank and per stage. The gather's stream is
  # folded with the inner rank only (gather_rows does that): every outer group holds the
  # same reduced shards and must encode them alike, or the groups' results would differ.
  key_in = rank_key(key, outer, 1)
  key_out = None if key is None else rank_key(rank_key(key, inner, 2), outer, 0)
  key_ag = None if key is None else jax.random.fold_in(key, 3)
  shard = _rs.scatter_rows(L.rank_rows(xs, n_in), inner, c_in, 1, key_in)
  shard = _one_shot(shard, outer, c_out, key_out)
  return L.flat_row(_ag.gather_rows(shard, inner, c_in, 1, key_ag, invariant=True))


def _joint(pairs: list[tuple[jax.Array, Any]], axes: tuple, algorithm: str, residual: bool) -> list:
  """one_shot or two_shot of several rows, each with its own codec, through one chain:
  each row is encoded, summed and decoded as :func:`_one_shot` / :func:`_two_shot` does
  alone, and the payloads of all rows share each collective (:func:`side_by_side`).

  Args:
    pairs: (padded row, its compressor); rows a multiple of their codec's unit long.
    axes: the group.
    algorithm: "one_shot" or "two_shot".
    residual: also return each row's encoder residual.

  Returns:
    Per row, its result (with ``residual``: the pair (result, residual)).
  """
  n = group_size(axes) if algorithm == "two_shot" else 1
  bufs = [encode_rows(c, L.rank_rows(xs, n) if n > 1 else xs[None]) for xs, c in pairs]
  widths = [xs.shape[-1] // n for xs, _ in pairs]
  sent = bufs
  if n > 1:  # two_shot: each rank reduces its shard of every row, then re-encodes it
    got = side_by_side(bufs, lambda b: lax.all_to_all(b, axes, 0, 0, tiled=True))
    sent = [decode_sum_encode(c, g, w, xs.dtype)[None] for (xs, c), g, w in zip(pairs, got, widths)]
  every = side_by_side(sent, lambda b: gather_payloads(b[0], axes, invariant=True))
  outs = []
  for (xs, c), rows, buf, w in zip(pairs, every, bufs, widths):
    if n > 1:
      out = L.flat_row(decode_rows(c, rows, w, xs.dtype))
    else:
      out = decode_sum(c, rows, w, xs.dtype)
    lost = L.flat_row(decode_rows(c, buf, w, xs.dtype))
    outs.append((out, R.lost(xs, lost)) if residual else out)
  return outs


_FLAT = {"one_shot": _one_shot, "two_shot": _two_shot}
_ALGOS = {**_FLAT, "hierarchical": _hierarchical}


def _xla_all_reduce(
  x: jax.Array,
  *,
  axes: tuple,
  compressor: Any,
  algorithm: str,
  chunks: int,
  key: Any,
  residual: bool = False,
) -> Any:
  """The xla backend; with ``residual`` (one_shot, two_shot) also the encoder's residual
  rows, float32, in ``x``'s layout."""
  run = _ALGOS[algorithm]

  def one(xs: jax.Array, i: int) -> Any:
    k = (
      rank_key(key, axes, i)
      if algorithm != "hierarchical"
      else (None if key is None else jax.random.fold_in(key, i))
    )
    if residual:  # one_shot and two_shot (plan refuses hierarchical)
      return _FLAT[algorithm](xs, axes, compressor, k, residual=True)
    return run(xs, axes, compressor, k)

  return L.chunked(one, x, chunks)


_backend.register("xla", "all_reduce", _xla_all_reduce)

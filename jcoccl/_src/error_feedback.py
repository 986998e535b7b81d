"""Error feedback for compressed gradient reductions (optax-style functional helper).

Each rank keeps a residual ``e`` (float32, shaped like its gradients). Before encoding it
adds the residual, ``y = x + e``, and after the step keeps what its own encoding lost,
``e' = y - decode(encode(y))``. The compression error is then fed back instead of lost, so
the sum of the reduced values over many steps tracks the exact sum (its error stays
bounded by one step's error instead of growing like sqrt(steps) or steps).

Only the quantization of the rank's own input is fed back (the first quantization of
two_shot/hierarchical is; their re-encoding of the reduced shard is not, since no single
rank owns it). Residuals are computed with the same padding/blocks as the collective, so
``decode(encode(y))`` is exactly what the other ranks decode from this rank.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jcoccl._src import _common as C
from jcoccl._src import all_reduce as _ar
from jcoccl._src import layout as L
from jcoccl._src import reduce_scatter as _rs


class ErrorFeedback(NamedTuple):
  """Pure functions built by :func:`error_feedback` (optax style).

  Attributes:
    init: ``init(grads) -> state`` (float32 zeros shaped like ``grads``).
    all_reduce: ``all_reduce(grads, state, axis_name, **kw) -> (reduced, new_state)``.
    reduce_scatter: ``reduce_scatter(grads, state, axis_name, **kw) -> (shards, new_state)``.
    compensate: ``compensate(grads, state, layout_fn) -> (to_send, new_state)`` low level.
  """

  init: Any
  all_reduce: Any
  reduce_scatter: Any
  compensate: Any


def _roundtrip(rows: jax.Array, comp: Any, lay: L.RowLayout) -> jax.Array:
  """decode(encode(rows)) with the padding of ``lay`` (blocks from element 0 of each row)."""
  padded = lay.pad(rows)
  return lay.unpad(comp.decode_rows(comp.encode_rows(padded), lay.padded, rows.dtype))


def _roundtrip_flat(y: jax.Array, comp: Any, lay: L.RowLayout) -> jax.Array:
  """decode(encode(y)) with the flat layout of all_reduce."""
  return _roundtrip(L.flat_row(y)[None], comp, lay)[0].reshape(y.shape)


def _roundtrip_rows(y: jax.Array, comp: Any, dim: int, n: int, chunks: int) -> jax.Array:
  """decode(encode(y)) with reduce_scatter's per-destination rows (and its slicing)."""
  rows, block = L.to_rows(y, dim, n)
  back = _roundtrip(rows, comp, L.RowLayout.of(rows.shape[1], comp.granule, chunks))
  return jnp.moveaxis(back.reshape((n * block[0],) + tuple(block[1:])), 0, dim)


def _plan(
  g: jax.Array, comp: Any, algorithm: str, axes: tuple, chunks: int, min_bytes: Any
) -> tuple[Any, str, int]:
  """(compressor, algorithm, chunks) that all_reduce runs for leaf ``g`` (None: exact)."""
  c = C.effective_compressor(g, comp, min_bytes)
  if c is None:
    return None, "auto", chunks
  # The residual's own encode and decode are two more codec passes than the plain op.
  c, algo, k = _ar.decide(c, algorithm, axes, g, chunks, flat=True, codec_passes=2)
  if algo == "hierarchical":
    raise ValueError("error_feedback.all_reduce supports one_shot and two_shot, not hierarchical")
  return (None, "auto", chunks) if c is None else (c, algo, k)


def _sent(y: jax.Array, plan: tuple[Any, str, int], axes: tuple) -> jax.Array | None:
  """What this rank's ``y`` arrives as under ``plan`` (None when it goes exactly)."""
  c, algo, k = plan
  if c is None:
    return None
  return _roundtrip_flat(y, c, _ar.row_layout(y.size, c, algo, axes, k))


def _leaves_like(state: Any, treedef: Any) -> list:
  """The leaves of ``state``, which must have the gradients' structure ``treedef``."""
  leaves, tree = jax.tree_util.tree_flatten(state)
  if tree != treedef:
    raise ValueError(f"state must have the structure of grads ({treedef}), got {tree}")
  return leaves


def _groups(plans: list) -> dict:
  """Leaf indices by plan, in first-seen order."""
  groups: dict = {}
  for i, plan in enumerate(plans):
    groups.setdefault(plan, []).append(i)
  return groups


def error_feedback(compressor: Any) -> ErrorFeedback:
  """Builds error-feedback helpers around ``compressor``.

  Args:
    compressor: Compressor or spec string (deterministic rounding: a stochastic
      compressor's local round trip would not match what was sent).

  Returns:
    An :class:`ErrorFeedback` of pure functions.

  Example:
    >>> ef = jcoccl.error_feedback("int4")                      # doctest: +SKIP
    >>> state = ef.init(grads)                                   # inside shard_map
    >>> g, state = ef.all_reduce(grads, state, "data", min_bytes=0)
  """
  comp = C.resolve_compressor(compressor)
  if comp is not None and getattr(comp, "stochastic", False):
    raise ValueError(f"error_feedback needs a compressor with rounding='nearest', got {comp}")

  def init(grads: Any) -> Any:
    # The residual varies over the same axes as the gradients (it is per rank).
    return jax.tree_util.tree_map(
      lambda g: C.match_vma(jnp.zeros(jnp.shape(g), jnp.float32), C.vma_of(g)), grads
    )

  def compensate(grads: Any, state: Any, roundtrip: Any) -> tuple[Any, Any]:
    """y = g + e (cast to g's dtype); new e = y - roundtrip(y) in float32.

    A non-finite residual element is reset to 0, both the one read and the one kept: a
    NaN/Inf gradient (a step that loss scaling skips) makes that step's output non-finite,
    as the exact op's would be, but leaves nothing behind, so later finite steps are finite
    again (a residual restored from a poisoned checkpoint recovers too).
    """

    def leaf(g, e):
      e = jnp.where(jnp.isfinite(e), e, jnp.zeros_like(e))
      y = (g.astype(jnp.float32) + e).astype(g.dtype)
      sent = roundtrip(y)
      if sent is None:
        return y, jnp.zeros_like(e)
      new = (y.astype(jnp.float32) - sent.astype(jnp.float32)) + (
        (g.astype(jnp.float32) + e) - y.astype(jnp.float32)
      )
      return y, jnp.where(jnp.isfinite(new), new, jnp.zeros_like(new))

    pairs = jax.tree_util.tree_map(leaf, grads, state)
    ys = jax.tree_util.tree_map(lambda g, p: p[0], grads, pairs)
    es = jax.tree_util.tree_map(lambda g, p: p[1], grads, pairs)
    return ys, es

  def all_reduce(
    grads: Any,
    state: Any,
    axis_name: Any,
    *,
    algorithm: str = "auto",
    chunks: int = 1,
    min_bytes: int | None = None,
    **kw: Any,
  ) -> tuple[Any, Any]:
    """Compressed all_reduce of ``grads + state``; returns (reduced, new_state).

    Each leaf's algorithm is decided first (``algorithm="auto"`` with a calibration may
    keep the exact op, whose residual is then zero) and the leaves sharing a decision go
    in one call, so the residual is always that of what was sent.
    """
    axes = C.canonical_axes(axis_name)
    leaves, treedef = jax.tree_util.tree_flatten(grads)
    plans = [_plan(g, comp, algorithm, axes, chunks, min_bytes) for g in leaves]
    sent, new_state = [], []
    for g, e, plan in zip(leaves, _leaves_like(state, treedef), plans):
      y, e = compensate(g, e, lambda y, p=plan: _sent(y, p, axes))
      sent.append(y)
      new_state.append(e)
    out = [None] * len(leaves)
    for plan, idx in _groups(plans).items():
      c, algo, k = plan
      reduced = _ar.all_reduce(
        [sent[i] for i in idx],
        axis_name,
        compressor=c,
        algorithm=algo,
        chunks=k,
        min_bytes=min_bytes,
        **kw,
      )
      for i, r in zip(idx, reduced):
        out[i] = r
    return jax.tree_util.tree_unflatten(treedef, out), jax.tree_util.tree_unflatten(
      treedef, new_state
    )

  def reduce_scatter(
    grads: Any,
    state: Any,
    axis_name: Any,
    *,
    scatter_dimension: int = 0,
    tiled: bool = False,
    chunks: int = 1,
    min_bytes: int | None = None,
    **kw: Any,
  ) -> tuple[Any, Any]:
    """Compressed reduce_scatter of ``grads + state``; returns (shards, new_state)."""
    axes = C.canonical_axes(axis_name)
    n = C.group_size(axes)

    def roundtrip(y):
      c = C.effective_compressor(y, comp, min_bytes)
      if c is None:
        return None
      dim = _rs.check_scatter(y.shape, scatter_dimension, tiled, n)
      return _roundtrip_rows(y, c, dim, n, chunks)

    ys, new_state = compensate(grads, state, roundtrip)
    out = _rs.reduce_scatter(
      ys,
      axis_name,
      scatter_dimension=scatter_dimension,
      tiled=tiled,
      compressor=comp,
      chunks=chunks,
      min_bytes=min_bytes,
      **kw,
    )
    return out, new_state

  return ErrorFeedback(init, all_reduce, reduce_scatter, compensate)


def ef_all_reduce(
  grads: Any, state: Any, axis_name: Any, *, compressor: Any, **kw: Any
) -> tuple[Any, Any]:
  """``error_feedback(compressor).all_reduce(grads, state, axis_name, **kw)``."""
  return error_feedback(compressor).all_reduce(grads, state, axis_name, **kw)


def ef_reduce_scatter(
  grads: Any, state: Any, axis_name: Any, *, compressor: Any, **kw: Any
) -> tuple[Any, Any]:
  """``error_feedback(compressor).reduce_scatter(grads, state, axis_name, **kw)``."""
  return error_feedback(compressor).reduce_scatter(grads, state, axis_name, **kw)

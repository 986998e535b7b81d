"""Error feedback for compressed gradient reductions (optax-style functional helper).

Each rank keeps a residual ``e`` (float32, shaped like its gradients). A compressed leaf
sends ``y = g + e`` and keeps what its own encoding lost, ``e' = y - decode(encode(y))``:
the compression error is fed back instead of lost, so the sum of the reduced values over
many steps tracks the exact sum (its error stays bounded by one step's error instead of
growing like sqrt(steps) or steps).

The collectives compute the residual themselves (``residual=`` of :func:`jcoccl.all_reduce`
and :func:`jcoccl.reduce_scatter`): it is the decoding of the very payload this rank sent,
so nothing is encoded twice, and only this rank's own quantization is fed back (two_shot's
re-encoding of the reduced shard belongs to no single rank). A leaf that goes exactly
(under ``min_bytes``, or where auto_exact / a calibration chose the lax op) sends ``g`` and
carries its residual forward unchanged. The rule in full: :mod:`jcoccl._src.base.residual`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jcoccl._src.base.axes import match_vma, vma_of
from jcoccl._src.compressors.compressor_args import resolve_compressor
from jcoccl._src.ops import all_reduce as _ar
from jcoccl._src.ops import reduce_scatter as _rs


class ErrorFeedback(NamedTuple):
  """Pure functions built by :func:`error_feedback` (optax style: ``init`` and an update
  per op).

  Attributes:
    init: ``init(grads) -> state`` (float32 zeros shaped like ``grads``, inside shard_map;
      the state kept between jitted steps is :func:`jcoccl.residuals.init`'s, whose
      ``local`` view is this).
    all_reduce: ``all_reduce(grads, state, axis_name, **kw) -> (reduced, new_state)``.
    reduce_scatter: ``reduce_scatter(grads, state, axis_name, **kw) -> (shards, new_state)``.
  """

  init: Any
  all_reduce: Any
  reduce_scatter: Any


def error_feedback(compressor: Any) -> ErrorFeedback:
  """Builds error-feedback helpers around ``compressor``.

  Args:
    compressor: Compressor or spec string. A stochastic-rounding codec works too (pass
      ``key=``): the residual is the decoding of the payload that was sent.

  Returns:
    An :class:`ErrorFeedback` of pure functions; ``all_reduce`` and ``reduce_scatter``
    are :func:`jcoccl.all_reduce` and :func:`jcoccl.reduce_scatter` with
    ``compressor`` and ``residual=state``.

  Example:
    >>> ef = jcoccl.error_feedback("int4")                      # doctest: +SKIP
    >>> state = ef.init(grads)                                   # inside shard_map
    >>> g, state = ef.all_reduce(grads, state, "data", min_bytes=0)
  """
  comp = resolve_compressor(compressor)

  def init(grads: Any) -> Any:
    # The residual varies over the same axes as the gradients (it is per rank).
    return jax.tree_util.tree_map(
      lambda g: match_vma(jnp.zeros(jnp.shape(g), jnp.float32), vma_of(g)), grads
    )

  def all_reduce(grads: Any, state: Any, axis_name: Any, **kw: Any) -> tuple[Any, Any]:
    """:func:`jcoccl.all_reduce` of ``grads`` with ``residual=state``; returns (reduced,
    new_state). ``algorithm="auto"`` keeps to one_shot and two_shot, and under a
    calibration charges the residual's decode pass to compression."""
    return _ar.all_reduce(grads, axis_name, compressor=comp, residual=_checked(state), **kw)

  def reduce_scatter(grads: Any, state: Any, axis_name: Any, **kw: Any) -> tuple[Any, Any]:
    """:func:`jcoccl.reduce_scatter` of ``grads`` with ``residual=state``; returns
    (shards, new_state)."""
    return _rs.reduce_scatter(grads, axis_name, compressor=comp, residual=_checked(state), **kw)

  return ErrorFeedback(init, all_reduce, reduce_scatter)


def _checked(state: Any) -> Any:
  if state is None:
    raise ValueError("state: pass the residuals from ef.init(grads) (or the last call's)")
  return state

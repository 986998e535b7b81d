"""The encoder's residual: what a compressed all_reduce or reduce_scatter lost of this
rank's own input, returned by the op itself (``residual=`` of :func:`jcoccl.all_reduce`
and :func:`jcoccl.reduce_scatter`; :func:`jcoccl.error_feedback` wraps it).

The rule, per leaf of a call given the residual ``e`` it owes (float32, shaped like the
leaf ``g``):

  compressed: the op sends ``y = g + e`` (computed in float32, cast to g's dtype) and
    returns ``e' = (y - decode(encode(y))) + ((g + e) - y)`` in float32: what its own
    encoding lost, plus what the cast to g's dtype lost. ``decode(encode(y))`` is the
    decoding of the very payload this rank sent (the first quantization of two_shot; the
    re-encoding of a reduced shard belongs to no single rank). A non-finite element of
    ``e`` is read as 0 and a non-finite element of ``e'`` is kept as 0: a NaN/Inf gradient
    makes that step's output non-finite, as the exact op's would be, and leaves nothing
    behind.
  exact (under ``min_bytes``, a non-float dtype, or auto_exact / a calibration chose the
    lax op): the op sends ``g`` alone and returns ``e`` itself, untouched: the residual is
    carried forward, without an operation, to the next call that compresses the leaf
    (sending it exactly now would cost an add per step for what is zero unless the
    decision changed; a non-finite element is dropped when a compressed call reads it).

Example:
  >>> y, rest = feed(jnp.ones(4), jnp.full(4, 0.5))
  >>> y.tolist(), rest.tolist()
  ([1.5, 1.5, 1.5, 1.5], [0.0, 0.0, 0.0, 0.0])
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def feed(g: jax.Array, e: jax.Array) -> tuple[jax.Array, jax.Array]:
  """What a compressed leaf sends, and what the cast to its dtype lost.

  Args:
    g: the leaf.
    e: the residual it owes (float32, g's shape); non-finite elements read as 0.

  Returns:
    (``y = g + e`` in g's dtype, ``(g + e) - y`` in float32).
  """
  e = jnp.where(jnp.isfinite(e), e, jnp.zeros_like(e))
  want = g.astype(jnp.float32) + e
  # Computed once, then read: without the barrier XLA fuses ``g + e`` (and whatever made
  # g, e.g. a model's per-layer gradients padded into their stacked leaf) into the encode's
  # input and again into the residual's ``y - sent`` and ``want - y``, so g's producers are
  # written out unfused and the residual is copied: on the GPT 'wide' train step of
  # benchmarks/train_e2e.py, 0.36 GB more memory traffic per device and step.
  want, y = jax.lax.optimization_barrier((want, want.astype(g.dtype)))
  return y, want - y.astype(jnp.float32)


def keep(lost: jax.Array, rest: jax.Array) -> jax.Array:
  """The residual a compressed leaf keeps: its encoder's ``lost`` plus the cast's
  ``rest`` (:func:`feed`), non-finite elements as 0."""
  new = lost + rest
  return jnp.where(jnp.isfinite(new), new, jnp.zeros_like(new))


def lost(x: jax.Array, sent: jax.Array) -> jax.Array:
  """``x - sent`` in float32: what an encoding of ``x`` that decodes to ``sent`` lost."""
  return x.astype(jnp.float32) - sent.astype(jnp.float32)


def leaves_like(state: Any, treedef: Any, argname: str = "residual") -> list:
  """The leaves of ``state``, which must have the structure ``treedef`` of the input."""
  leaves, tree = jax.tree_util.tree_flatten(state)
  if tree != treedef:
    raise ValueError(f"{argname} must have the structure of x ({treedef}), got {tree}")
  return leaves

"""Building blocks shared by GPT-2 and Qwen2, written so one module serves one device or a shard.

Every layer computes its head counts and widths from its parameter shapes, so the same module
runs on full weights (one device) or on the local slice a ``jax.shard_map`` hands it (tensor
parallel). Collectives are never called here: a ``Comm`` object (``models.collectives``) supplies
the two Megatron operators ``enter`` (identity forward, all-reduce backward) and ``exit``
(all-reduce forward, identity backward); ``LOCAL`` makes both the identity.
"""

from __future__ import annotations

import math
from typing import Protocol

import jax
import jax.numpy as jnp
from flax import nnx


class Comm(Protocol):
  """What a layer needs from the tensor-parallel group."""

  def enter(self, x: jax.Array) -> jax.Array:
    """Marks the input of a column-parallel projection (backward: all-reduce over 'tensor')."""

  def exit(self, x: jax.Array) -> jax.Array:
    """Sums the partial outputs of a row-parallel projection (forward: all-reduce)."""


class _Local:
  """The one-device group: both operators are the identity."""

  def enter(self, x: jax.Array) -> jax.Array:
    return x

  def exit(self, x: jax.Array) -> jax.Array:
    return x


LOCAL: Comm = _Local()


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], std: float) -> jax.Array:
  return std * jax.random.normal(rngs.params(), shape, jnp.float32)


class Dense(nnx.Module):
  """``y = x @ kernel + bias`` with ``kernel`` stored (in, out), as GPT-2's Conv1D stores it.

  Example:
    >>> d = Dense(4, 8, rngs=nnx.Rngs(0)); d(jnp.ones((2, 4))).shape
    (2, 8)
  """

  def __init__(self, din: int, dout: int, *, bias: bool = True, std: float = 0.02, rngs: nnx.Rngs):
    self.kernel = nnx.Param(_normal(rngs, (din, dout), std))
    self.bias = nnx.Param(jnp.zeros((dout,), jnp.float32)) if bias else None

  def __call__(self, x: jax.Array) -> jax.Array:
    y = jnp.einsum("...i,io->...o", x, self.kernel[...], precision=jax.lax.Precision.HIGHEST)
    return y if self.bias is None else y + self.bias[...]


class LayerNorm(nnx.Module):
  """LayerNorm over the last axis, statistics in float32 (torch semantics: biased variance)."""

  def __init__(self, dim: int, eps: float = 1e-5):
    self.eps = eps
    self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))
    self.bias = nnx.Param(jnp.zeros((dim,), jnp.float32))

  def __call__(self, x: jax.Array) -> jax.Array:
    h = x.astype(jnp.float32)
    mean = h.mean(-1, keepdims=True)
    var = jnp.square(h - mean).mean(-1, keepdims=True)
    normed = ((h - mean) * jax.lax.rsqrt(var + self.eps)).astype(x.dtype)
    return normed * self.scale[...] + self.bias[...]


class RMSNorm(nnx.Module):
  """Qwen2's RMSNorm: ``x * rsqrt(mean(x^2) + eps)`` in float32, cast back, times weight."""

  def __init__(self, dim: int, eps: float = 1e-6):
    self.eps = eps
    self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))

  def __call__(self, x: jax.Array) -> jax.Array:
    h = x.astype(jnp.float32)
    h = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + self.eps)
    return self.scale[...] * h.astype(x.dtype)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
  """Softmax attention with a causal mask; grouped-query when k/v have fewer heads.

  Args:
    q: [batch, seq, heads, head_dim].
    k, v: [batch, seq, kv_heads, head_dim]; ``heads`` is a multiple of ``kv_heads`` and query
      head ``i`` reads kv head ``i // (heads // kv_heads)`` (HF's repeat_kv).

  Returns:
    [batch, seq, heads * head_dim].
  """
  b, s, h, d = q.shape
  group = h // k.shape[2]
  k = jnp.repeat(k, group, axis=2)
  v = jnp.repeat(v, group, axis=2)
  hp = jax.lax.Precision.HIGHEST
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=hp) * (1.0 / math.sqrt(d))
  mask = jnp.tril(jnp.ones((s, s), bool))
  scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
  probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(v.dtype)
  return jnp.einsum("bhqk,bkhd->bqhd", probs, v, precision=hp).reshape(b, s, h * d)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Mean next-token cross entropy in float32.

  Args:
    logits: [..., vocab].
    targets: int [...].

  Returns:
    A float32 scalar.
  """
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()

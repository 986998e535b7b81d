"""Hadamard rotation in front of another codec (spreads outliers across a block)."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jcoccl._src.compressors import _base as B

MAX_SIZE = 4096
DEFAULT_SIZE_LOSSLESS_INNER = 128


def default_size(inner: B.Compressor) -> int:
  """The inner codec's granule capped to 4096, or 128 when that granule is 1 (none, cast)."""
  g = inner.granule
  return DEFAULT_SIZE_LOSSLESS_INNER if g < 2 else min(g, MAX_SIZE)


def fwht(x2d: jax.Array, size: int) -> jax.Array:
  """Unnormalised fast Walsh-Hadamard transform of each ``size`` block of each row.

  Stage order fixed by the wire format: h = 1, 2, ..., size/2; pairs (j, j + h) of each 2h run
  become (a + b, a - b).
  """
  rows, n = x2d.shape
  y = x2d
  h = 1
  while h < size:
    y = y.reshape(rows, n // (2 * h), 2, h)
    a, b = y[:, :, 0, :], y[:, :, 1, :]
    y = jnp.stack([a + b, a - b], axis=2)
    h *= 2
  return y.reshape(rows, n)


@dataclasses.dataclass(frozen=True)
class HadamardCompressor(B.Compressor):
  """Rotation by the orthonormal Hadamard matrix of order ``size``, then ``inner``."""

  inner: B.Compressor = None  # type: ignore[assignment]
  size: int = 0
  kind: ClassVar[str] = "hadamard"

  def __post_init__(self):
    if not isinstance(self.inner, B.Compressor):
      raise TypeError(f"inner must be a jcoccl Compressor, got {type(self.inner).__name__}")
    s = self.size
    if (isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 2 or s > MAX_SIZE
        or s & (s - 1)):
      raise ValueError(f"size must be a power of two in 2..{MAX_SIZE}, got {s!r}")
    object.__setattr__(self, "size", int(s))

  @property
  def rounding(self) -> str:
    return getattr(self.inner, "rounding", "nearest")

  @property
  def granule(self) -> int:
    return math.lcm(self.size, self.inner.granule)

  @property
  def _scale(self) -> np.float32:
    return np.float32(1.0 / math.sqrt(self.size))

  def _payload_bytes(self, n: int, dtype: jnp.dtype) -> int:
    return self.inner._payload_bytes(n, jnp.dtype(jnp.float32))

  def _rotate(self, x2d: jax.Array) -> jax.Array:
    return fwht(x2d, self.size) * self._scale

  def _encode_f32(self, x2d: jax.Array, key: jax.Array | None) -> jax.Array:
    # Barrier: the scaled row must be rounded before an inner codec subtracts from it (FMA).
    return self.inner._encode_f32(B.barrier(self._rotate(x2d)), key)

  def _decode_f32(self, buf: jax.Array, n: int) -> jax.Array:
    # Barrier: inner decode's products are rounded before the transform adds them (FMA).
    return self._rotate(B.barrier(self.inner._decode_f32(buf, n)))

  def _bound_f32(self, x2d: jax.Array) -> jax.Array:
    # With y the computed rotation, e_q the inner error (|e_q| <= inner bound b), the output
    # is x + Hn e_q + (forward and inverse rounding). |(Hn e)_i| <= sum|e_j| / sqrt(H) and a
    # k = log2(H) stage transform errs by at most (k+3)u * sum|x_j| (per output, scaled).
    # So per H-block: E/sqrt(H) + 2g(S + E/sqrt(H)) with E = sum b, S = sum|x|, g = (k+3)u.
    h = self.size
    k = int(math.log2(h))
    rows, n = x2d.shape
    y = B.barrier(self._rotate(x2d))
    e = self.inner._bound_f32(y).reshape(rows, n // h, h)
    sums_slack = np.float32(1 + 2 * h * B.U32)  # float32 summation of h positive terms
    e_sum = jnp.sum(e, axis=-1, keepdims=True) * sums_slack * self._scale * np.float32(1 + 4 * B.U32)
    s = jnp.sum(jnp.abs(x2d.reshape(rows, n // h, h)), axis=-1, keepdims=True) * sums_slack
    g = np.float32(2 * (k + 3) * B.U32 * 1.01)
    b = e_sum + g * (s + e_sum) + np.float32(h * (k + 4) * B.TINY)
    b = jnp.where(s < np.float32(B.F32_MAX / 4), b, jnp.inf)
    return jnp.broadcast_to(b, (rows, n // h, h)).reshape(rows, n)

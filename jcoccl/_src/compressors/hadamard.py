"""Hadamard rotation in front of another codec (spreads outliers across a block)."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jcoccl._src.compressors import _base as B
from jcoccl._src.compressors import registry

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
  """Rotation by the orthonormal Hadamard matrix of order ``size``, then ``inner``.

  The rotation is computed as ``x * 2**-k`` (``size = 2**k``), the unnormalised butterflies,
  then ``* sqrt(size)``: no intermediate exceeds ``max |x|``, so any finite block whose
  rotation fits in float32 encodes and decodes without overflow, one value near float32's
  maximum included.

  ``error_bound`` is finite for an element ``x_i`` of a ``size``-block exactly when the block
  is finite, its L2 norm (the size of the largest rotated value) is at most
  ``F32_MAX * (1 - 2**-10)``, the inner codec's bound on the rotated block is finite, and
  ``|x_i| + bound_i <= F32_MAX * (1 - 2**-20)`` (the decoded value cannot overflow); it is
  ``inf`` otherwise (e.g. blocks whose L2 norm is within 0.1% of float32's maximum, where
  the rotated values themselves may overflow).

  Example:
    >>> c = jc.hadamard(jc.int8(block_size=64), size=64)
    >>> x = jnp.zeros(64).at[3].set(3e38)
    >>> bool(jnp.isfinite(c.decode(c.encode(x))).all()), bool(jnp.isfinite(c.error_bound(x)).all())
    (True, True)
  """

  inner: B.Compressor = None  # type: ignore[assignment]
  size: int = 0
  kind: ClassVar[str] = "hadamard"
  blockwise: ClassVar[bool] = True

  def __post_init__(self):
    B.check_inner(self.inner)
    s = self.size
    if (
      isinstance(s, bool)
      or not isinstance(s, (int, np.integer))
      or s < 2
      or s > MAX_SIZE
      or s & (s - 1)
    ):
      raise ValueError(f"size must be a power of two in 2..{MAX_SIZE}, got {s!r}")
    object.__setattr__(self, "size", int(s))

  @property
  def rounding(self) -> str:
    return getattr(self.inner, "rounding", "nearest")

  @property
  def granule(self) -> int:
    return math.lcm(self.size, self.inner.granule)

  @property
  def _pre(self) -> np.float32:
    """2**-k for size 2**k: exact, and it keeps every butterfly output <= max |x|."""
    return np.float32(1.0 / self.size)

  @property
  def _post(self) -> np.float32:
    return np.float32(math.sqrt(self.size))

  def row_nbytes(self, n: int, dtype: jnp.dtype) -> int:
    return self.inner.row_nbytes(n, jnp.dtype(jnp.float32))

  def _rotate(self, x2d: jax.Array) -> jax.Array:
    # x * 2^-k, butterflies, * sqrt(H): intermediates never exceed max |x|, so only the last
    # multiply can overflow, and only where the true rotated value is near float32's top.
    # The barrier keeps the pre-scaled values rounded before the butterflies add them (FMA).
    y = fwht(B.barrier(x2d * self._pre), self.size) * self._post
    return B.canonical_nan(y)

  def encode_f32(self, x2d: jax.Array, key: jax.Array | None) -> jax.Array:
    # Barrier: the scaled row must be rounded before an inner codec subtracts from it (FMA).
    return self.inner.encode_f32(B.barrier(self._rotate(x2d)), key)

  def decode_f32(self, buf: jax.Array, n: int) -> jax.Array:
    # Barrier: inner decode's products are rounded before the transform adds them (FMA).
    return self._rotate(B.barrier(self.inner.decode_f32(buf, n)))

  def bound_f32(self, x2d: jax.Array) -> jax.Array:
    # With y the computed rotation, e_q the inner error (|e_q| <= inner bound b), the output
    # is x + Hn e_q + (forward and inverse rounding). |(Hn e)_i| <= sum|e_j| / sqrt(H) and a
    # k = log2(H) stage transform errs by at most (k+3)u * sum|x_j| (per output, scaled; the
    # pre-scale by 2^-k is exact). So per H-block: E + 2g(S + E) with E = sum b / sqrt(H),
    # S = sum|x|, g = (k+3)u, plus absolute terms for values below the normal range (the
    # pre-scale, butterfly outputs and products flushed to zero: <= 4 H^2 TINY in all).
    # Sums are formed as m * sum(|x| / m) (m = max |x|) and sum(b / sqrt(H)), so they do not
    # overflow before the bound itself would be inf. Where the result could overflow (see
    # the class docstring) the bound is inf.
    h = self.size
    k = int(math.log2(h))
    rows, n = x2d.shape
    xb = x2d.reshape(rows, n // h, h)
    y = B.barrier(self._rotate(x2d))
    e = self.inner.bound_f32(y).reshape(rows, n // h, h)
    sums_slack = np.float32(1 + 2 * h * B.U32)  # float32 summation of h positive terms
    e_sum = jnp.sum(e * np.float32(1 / math.sqrt(h)), axis=-1, keepdims=True) * (
      sums_slack * np.float32(1 + 4 * B.U32)
    )
    m = jnp.max(jnp.abs(xb), axis=-1, keepdims=True)
    # In [0, 1]. B.div: XLA would multiply by 1 / m, which flushes to 0 for m > 2^126.
    rel = B.div(jnp.abs(xb), jnp.where(m > 0, m, np.float32(1)))
    g = np.float32(2 * (k + 3) * B.U32 * 1.01)
    gs = (m * g) * (jnp.sum(rel, axis=-1, keepdims=True) * sums_slack)
    b = e_sum + gs + g * e_sum + np.float32(4 * h * (h + 4) * B.TINY)
    # L2 norm of the block, the size of the largest rotated value (relative error < h u).
    norm = m * jnp.sqrt(jnp.sum(rel * rel, axis=-1, keepdims=True))
    ok = B.block_finite(xb) & (norm <= np.float32(B.F32_MAX * (1 - 2.0**-10)))
    b = jnp.where(ok, b, jnp.inf)
    b = jnp.where(jnp.abs(xb) + b <= np.float32(B.F32_MAX * (1 - 2.0**-20)), b, jnp.inf)
    return b.reshape(rows, n)


def _hadamard(inner: B.Compressor, size: int | None = None) -> HadamardCompressor:
  return HadamardCompressor(inner=inner, size=default_size(inner) if size is None else size)


def _hadamard_string(c: HadamardCompressor) -> str:
  tail = "" if c.size == default_size(c.inner) else f":size={c.size}"
  return f"hadamard({c.inner!s}){tail}"


registry.register(
  {"hadamard": _hadamard},
  HadamardCompressor,
  keys={"size": "size"},
  printer=_hadamard_string,
  native=lambda c: {"hadamard": c.size},
  wraps=True,
)

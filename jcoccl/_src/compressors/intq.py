"""Blockwise integer quantization: int2 ... int8 (symmetric or asymmetric)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jcoccl._src.compressors import _base as B
from jcoccl._src.compressors import registry

ROUNDINGS = ("nearest", "stochastic")
BITS = (8, 7, 6, 5, 4, 3, 2)


def check_rounding(rounding: str) -> str:
  if rounding not in ROUNDINGS:
    raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
  return rounding


def round_codes(v: jax.Array, key: jax.Array | None, stochastic: bool) -> jax.Array:
  """round-half-even(v), or floor(v + r) with r ~ U[0, 1) of shape [rows, n] (stochastic)."""
  if not stochastic:
    return jnp.round(v)
  assert key is not None, "stochastic rounding draws from key"  # checked by the callers
  r = jax.random.uniform(key, (v.shape[0], v.shape[1] * v.shape[2]), jnp.float32)
  return jnp.floor(v + r.reshape(v.shape))


@dataclasses.dataclass(frozen=True)
class IntCompressor(B.Compressor):
  """``bits``-bit blockwise quantization with one float32 scale (and min) per block.

  Layout: ``codes: uint8[n*bits/8] | scales: f32[nb] | (asym) mins: f32[nb]``.
  """

  bits: int = 8
  block_size: int = 256
  symmetric: bool = True
  rounding: str = "nearest"
  kind: ClassVar[str] = "int"
  blockwise: ClassVar[bool] = True

  def __post_init__(self):
    if self.bits not in BITS or isinstance(self.bits, bool):
      raise ValueError(f"bits must be one of {BITS}, got {self.bits!r}")
    object.__setattr__(self, "block_size", B.check_block_size(self.block_size))
    if not isinstance(self.symmetric, (bool, np.bool_)):
      raise ValueError(f"symmetric must be True or False, got {self.symmetric!r}")
    object.__setattr__(self, "symmetric", bool(self.symmetric))
    check_rounding(self.rounding)

  @property
  def granule(self) -> int:
    return self.block_size

  @property
  def _levels(self) -> int:
    """qmax (symmetric) or L (asymmetric)."""
    return 2 ** (self.bits - 1) - 1 if self.symmetric else 2**self.bits - 1

  def fit(self, n: int) -> IntCompressor:
    # Symmetric only: an asymmetric block's min and max count the padding's zeros.
    return B.fit_block(self, n) if self.symmetric else self

  def row_nbytes(self, n: int, dtype: jnp.dtype) -> int:
    nb = n // self.block_size
    return n * self.bits // 8 + 4 * nb * (1 if self.symmetric else 2)

  def encode_f32(self, x2d: jax.Array, key: jax.Array | None) -> jax.Array:
    xb = B.blocks(x2d, self.block_size)
    fin = B.block_finite(xb)
    lev = self._levels
    r = np.float32(1.0 / lev)
    if self.symmetric:
      s = jnp.max(jnp.abs(xb), axis=-1, keepdims=True) * r
      lo = None
      v = B.div(xb, s)
      qlo, off = -lev, 2 ** (self.bits - 1)
    else:
      # Zero extremes are stored as +0 (`v + 0.0`): XLA's min/max of a block mixing +-0 and
      # (DAZ-flushed) subnormals returns either sign depending on the array layout.
      lo = B.plus_zero(jnp.min(xb, axis=-1, keepdims=True))
      hi = B.plus_zero(jnp.max(xb, axis=-1, keepdims=True))
      s = (hi - lo) * r
      v = B.div(xb - lo, s)
      qlo, off = 0, 0
    q = jnp.clip(round_codes(v, key, self.stochastic), qlo, lev)
    q = jnp.where(fin & (s > 0), q, 0.0)
    codes = (q.astype(jnp.int32) + off).astype(jnp.uint8).reshape(x2d.shape)
    parts = [B.pack_bits(codes, self.bits), B.f32_to_bytes(jnp.where(fin, s, jnp.nan)[..., 0])]
    if lo is not None:
      parts.append(B.f32_to_bytes(jnp.where(fin, lo, jnp.nan)[..., 0]))
    return jnp.concatenate(parts, axis=-1)

  def decode_f32(self, buf: jax.Array, n: int) -> jax.Array:
    nb = n // self.block_size
    c = n * self.bits // 8
    codes = B.unpack_bits(buf[:, :c], self.bits, n)
    s = B.bytes_to_f32(buf[:, c : c + 4 * nb])[..., None]
    if self.symmetric:
      q = codes.astype(jnp.int32) - 2 ** (self.bits - 1)
      out = B.blocks(q.astype(jnp.float32), self.block_size) * s
    else:
      lo = B.bytes_to_f32(buf[:, c + 4 * nb : c + 8 * nb])[..., None]
      # The product is rounded before the add (no FMA): see B.barrier.
      prod = B.barrier(B.blocks(codes.astype(jnp.float32), self.block_size) * s)
      out = lo + prod
    # Any scale/min bits decode to something defined (untrusted payloads): NaN is canonical.
    return B.canonical_nan(out).reshape(buf.shape[0], n)

  def bound_f32(self, x2d: jax.Array) -> jax.Array:
    # Nearest: |q - x/s| <= 1/2 + (division rounding) and the decode rounds |q*s| once (and
    # the asymmetric add once): s/2 + 4u*amax (symmetric) or s/2 + 8u*(|lo|+|hi|) bound all
    # float32 rounding terms. Stochastic rounding moves up to 1 step: s instead of s/2.
    # (levels + 2) * TINY covers scales and products flushed to zero (XLA:CPU is FTZ/DAZ).
    xb = B.blocks(x2d, self.block_size)
    lev = self._levels
    r = np.float32(1.0 / lev)
    half = np.float32(1.0 if self.stochastic else 0.5)
    if self.symmetric:
      big = jnp.max(jnp.abs(xb), axis=-1, keepdims=True)
      s = big * r
      b = s * half + big * np.float32(4 * B.U32)
    else:
      lo = jnp.min(xb, axis=-1, keepdims=True)
      hi = jnp.max(xb, axis=-1, keepdims=True)
      s = (hi - lo) * r
      big = jnp.maximum(jnp.abs(lo), jnp.abs(hi))
      b = s * half + (jnp.abs(lo) + jnp.abs(hi)) * np.float32(8 * B.U32)
    b = b + np.float32((lev + 2) * B.TINY)
    # Non-finite blocks decode to NaN; near float32's top the decode may overflow.
    b = jnp.where(B.block_finite(xb) & (big < np.float32(B.F32_MAX * (1 - 2.0**-20))), b, jnp.inf)
    return jnp.broadcast_to(b, xb.shape).reshape(x2d.shape)


def _int_string(c: IntCompressor) -> str:
  opts = [] if c.block_size == 256 else [f"block={c.block_size}"]
  opts += [] if c.symmetric else ["asym"]
  opts += [] if c.rounding == "nearest" else [c.rounding]
  return f"int{c.bits}" + (":" + ",".join(opts) if opts else "")


def _int_native(c: IntCompressor) -> dict | None:
  if c.rounding != "nearest":
    return None
  return {"bits": c.bits, "block": c.block_size, "symmetric": c.symmetric}


registry.register(
  {f"int{b}": (lambda b=b, **kw: IntCompressor(bits=b, **kw)) for b in BITS},
  IntCompressor,
  keys={"block": "block_size"},
  flags={
    "sym": ("symmetric", True),
    "asym": ("symmetric", False),
    "nearest": ("rounding", "nearest"),
    "stochastic": ("rounding", "stochastic"),
  },
  printer=_int_string,
  native=_int_native,
)

"""Scaled sign ("sign1"): one bit per value plus one float32 scale per block.

The codec of signSGD with majority-free averaging and 1-bit Adam: each value becomes its
sign, and each block of ``block`` values shares one magnitude, the mean of their absolute
values. This module is the codec's executable specification (jnp); ``sign_cpu.cc`` and
``sign_cuda.cu`` are its native kernels, bit-identical to it.

Wire format of a row of n float32 values (n a multiple of B = ``block``):
  bytes [0, n/8)            sign bits: bit t of byte j is 1 where value 8j + t is < 0
  bytes [n/8, n/8 + 4n/B)   one float32 scale per block, little-endian
The payload is the same for float32, bfloat16 and float16 rows (they are converted to float32
exactly first).

Scale of a block x[0..B): if every value is finite, the pairwise sum of |x| in float32 (the
tree a[i] <- a[i] + a[i + w/2] for w = B, B/2, ..., 2), divided by B, and if that overflowed
to +inf, the largest float32; otherwise NaN. Decoding gives -s where the bit is set and s
elsewhere (NaN for a non-finite block: the canonical NaN 0x7fc00000).

Bound: for a finite block the decoded value has the sign of x (or is +s at x = 0), so
|x - x_hat| = ||x| - s| <= max(|x|, s), plus 2**-126 for the subnormals XLA:CPU flushes;
non-finite blocks have no bound (inf).

Subnormals: XLA:CPU runs with flush-to-zero/denormals-are-zero, and the CPU kernels run on
XLA's threads, so both treat float32 subnormals alike there (as zero in sums and compares).

Example:
  >>> import jax.numpy as jnp, jcoccl.compressors as jc
  >>> import sign_codec
  >>> c = jc.parse("sign1:block=64")
  >>> c.payload_nbytes(256, jnp.float32)
  48
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jcoccl.compressors as jc

F32_MAX = float(np.finfo(np.float32).max)


def _check_block(block: int) -> int:
  if isinstance(block, bool) or not isinstance(block, (int, np.integer)):
    raise TypeError(f"sign1: block must be an int, got {block!r}")
  if not 32 <= block <= 4096 or block & (block - 1):
    raise ValueError(f"sign1: block must be a power of two in 32..4096, got {block}")
  return int(block)


def _pack_bits(bits: jax.Array) -> jax.Array:
  """bool[rows, n] -> uint8[rows, n/8], value 8j + t in bit t of byte j."""
  b = bits.astype(jnp.uint8).reshape(bits.shape[0], -1, 8)
  shifts = jnp.arange(8, dtype=jnp.uint8)
  return jnp.sum(b << shifts, axis=-1, dtype=jnp.uint8)


def _unpack_bits(packed: jax.Array, n: int) -> jax.Array:
  """uint8[rows, n/8] -> bool[rows, n]."""
  shifts = jnp.arange(8, dtype=jnp.uint8)
  return (((packed[..., None] >> shifts) & 1) == 1).reshape(packed.shape[0], n)


def block_scales(x: jax.Array, block: int) -> jax.Array:
  """float32[rows, n] -> float32[rows, n/block]: each block's scale (see the module doc)."""
  xb = x.reshape(x.shape[0], -1, block)
  finite = jnp.all(jnp.isfinite(xb), axis=-1)
  a = jnp.abs(xb)
  while a.shape[-1] > 1:
    h = a.shape[-1] // 2
    a = a[..., :h] + a[..., h:]
  s = a[..., 0] / np.float32(block)
  s = jnp.where(s > np.float32(F32_MAX), np.float32(F32_MAX), s)
  return jnp.where(finite, s, np.float32(np.nan))


@jc.register("sign1")
class SignCompressor(jc.Compressor):
  """1 bit per value and one float32 scale (the mean |x|) per block of ``block`` values.

  Example:
    >>> c = SignCompressor(block=32)
    >>> c.decode(c.encode(jnp.float32([1, -3] * 16)))[:2]
    Array([ 2., -2.], dtype=float32)
  """

  block: int = 256

  def __post_init__(self) -> None:
    _check_block(self.block)

  @property
  def granule(self) -> int:
    return self.block

  def row_nbytes(self, n: int, dtype: jnp.dtype) -> int:
    return n // 8 + 4 * (n // self.block)

  def encode_f32(self, x: jax.Array, key: jax.Array | None) -> jax.Array:
    bits = _pack_bits(x < 0)
    scales = lax.bitcast_convert_type(block_scales(x, self.block), jnp.uint8)
    return jnp.concatenate([bits, scales.reshape(x.shape[0], -1)], axis=-1)

  def decode_f32(self, buf: jax.Array, n: int) -> jax.Array:
    nb = n // self.block
    neg = _unpack_bits(buf[:, : n // 8], n)
    raw = buf[:, n // 8 : n // 8 + 4 * nb].reshape(buf.shape[0], nb, 4)
    s = jnp.repeat(lax.bitcast_convert_type(raw, jnp.float32), self.block, axis=-1)
    v = jnp.where(neg, -s, s)
    return jnp.where(jnp.isnan(v), np.float32(np.nan), v)

  def bound_f32(self, x: jax.Array) -> jax.Array:
    s = jnp.repeat(block_scales(x, self.block), self.block, axis=-1)
    # + 2**-126: XLA:CPU flushes float32 subnormals (|x| of one reads 0 there, while the
    # error of the value it stands for is not 0), as the built-ins' bounds allow for.
    b = jnp.maximum(jnp.abs(x), s) + np.float32(2.0**-126)
    return jnp.where(jnp.isnan(s), np.float32(np.inf), b)

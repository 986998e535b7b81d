"""The arithmetic, bit and byte helpers the codec families share.

Every function here is bit-exact on XLA:CPU and matches the native kernels (cuda/codecs/format.h):
division kept in float32 behind an optimization barrier, NaN canonicalised, float32/uint32
<-> little-endian bytes, b-bit codes packed as a little-endian bit stream.

Example:
  >>> import jax.numpy as jnp
  >>> unpack_bits(pack_bits(jnp.arange(8, dtype=jnp.uint8), 3), 3, 8).tolist()
  [0, 1, 2, 3, 4, 5, 6, 7]
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
IMPLS = ("auto", "jnp", "native")
OPS = ("encode", "decode", "decode_sum", "decode_sum_encode")
# Smallest normal float32. XLA:CPU runs with flush-to-zero and denormals-are-zero, so any
# float32 intermediate below this may become 0; error bounds carry absolute terms in its units.
TINY = float(np.finfo(np.float32).tiny)
U32 = 2.0**-24  # unit roundoff of float32
F32_MAX = float(np.finfo(np.float32).max)


def _accepted_dtypes() -> str:
  return ", ".join(str(d) for d in FLOAT_DTYPES)


def check_float_dtype(dtype: Any, who: str) -> jnp.dtype:
  """Returns ``dtype`` canonicalised; TypeError unless float32, bfloat16 or float16."""
  d = jnp.dtype(dtype)
  if d not in FLOAT_DTYPES:
    raise TypeError(f"{who}: dtype {d} is not supported; accepted dtypes: {_accepted_dtypes()}")
  return d


def check_block_size(block_size: Any, lo: int = 32, hi: int = 4096) -> int:
  """ValueError unless ``block_size`` is a power of two in [lo, hi]."""
  if (
    isinstance(block_size, bool)
    or not isinstance(block_size, (int, np.integer))
    or block_size < lo
    or block_size > hi
    or block_size & (block_size - 1)
  ):
    raise ValueError(
      f"block_size must be a power of two in {lo}..{hi} (32, 64, ..., {hi}), got {block_size!r}"
    )
  return int(block_size)


def barrier(x: jax.Array) -> jax.Array:
  """Stops XLA from rewriting arithmetic across this point.

  Used (1) on every product that is later added to something, because XLA:GPU may contract
  ``a * b + c`` into a fused multiply-add and the wire format rounds the product first, and
  (2) on divisors, because XLA rewrites ``a / broadcast(b)`` into ``a * broadcast(1 / b)``
  (seen on CPU), which rounds twice.
  """
  return lax.optimization_barrier(x)


def div(a: jax.Array, b: jax.Array) -> jax.Array:
  """IEEE float32 ``a / b`` with ``b`` broadcast to ``a``'s shape, never a reciprocal multiply.

  The divisor behind the barrier is computed from ``a`` (a NaN ``a`` divides by 1, which gives
  the same NaN), so it has ``a``'s full shape under ``vmap`` too: a divisor that does not
  depend on ``a`` (a constant step) would be broadcast over the batch after the barrier, and
  XLA would again see ``a / broadcast(c)`` and multiply by ``1 / c``.

  Example:
    >>> div(jnp.float32([3.0, 6.0]), np.float32(3.0))
    Array([1., 2.], dtype=float32)
  """
  d = jnp.where(jnp.isnan(a), jnp.ones_like(a), jnp.broadcast_to(b, a.shape).astype(a.dtype))
  return a / barrier(d)


def plus_zero(x: jax.Array) -> jax.Array:
  """``x + 0.0`` in round-to-nearest: a zero of either sign (and, under DAZ, a subnormal) -> +0.

  Written as a select because XLA folds ``x + 0`` away.

  Example:
    >>> plus_zero(jnp.array([-0.0, -1.0]))
    Array([ 0., -1.], dtype=float32)
  """
  return jnp.where(x == 0, jnp.zeros_like(x), x)


def canonical_nan(x: jax.Array) -> jax.Array:
  """``x`` with every NaN replaced by the canonical NaN 0x7fc00000 (cuda/WIRE_FORMAT.md).

  Decoders apply it wherever their arithmetic can make a NaN: IEEE 754 leaves that NaN's
  sign and payload open, and hardware differs (x86: 0xffc00000 for 0 * inf, CUDA: 0x7fffffff).

  Example:
    >>> canonical_nan(-jnp.float32(jnp.nan)).view(jnp.uint32) == 0x7fc00000
    Array(True, dtype=bool)
  """
  return jnp.where(jnp.isnan(x), jnp.full_like(x, np.nan), x)


def f32_to_bytes(x: jax.Array) -> jax.Array:
  """float32[..., k] -> uint8[..., 4k], little-endian (the byte order of every jax backend)."""
  b = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint8)
  return b.reshape(*x.shape[:-1], x.shape[-1] * 4)


def bytes_to_f32(b: jax.Array) -> jax.Array:
  """uint8[..., 4k] -> float32[..., k] (inverse of :func:`f32_to_bytes`)."""
  return lax.bitcast_convert_type(b.reshape(*b.shape[:-1], b.shape[-1] // 4, 4), jnp.float32)


def u32_to_bytes(x: jax.Array) -> jax.Array:
  """uint32[..., k] -> uint8[..., 4k], little-endian."""
  b = lax.bitcast_convert_type(x.astype(jnp.uint32), jnp.uint8)
  return b.reshape(*x.shape[:-1], x.shape[-1] * 4)


def bytes_to_u32(b: jax.Array) -> jax.Array:
  """uint8[..., 4k] -> uint32[..., k]."""
  return lax.bitcast_convert_type(b.reshape(*b.shape[:-1], b.shape[-1] // 4, 4), jnp.uint32)


def pack_bits(codes: jax.Array, bits: int) -> jax.Array:
  """uint8 codes < 2**bits, [..., n] (n a multiple of 8) -> uint8[..., n*bits/8].

  A little-endian bit stream: code i occupies bits [i*bits, (i+1)*bits) of the row, so every
  8 codes fill ``bits`` whole bytes (cuda/WIRE_FORMAT.md "int"). For 2, 4 and 8 bits that is
  also 8/bits codes per byte, LSB first.
  """
  if bits == 8:
    return codes.astype(jnp.uint8)
  c = codes.astype(jnp.uint32).reshape(*codes.shape[:-1], codes.shape[-1] // 8, 8)
  out = []
  for j in range(bits):  # output byte j of each group of 8 codes: stream bits [8j, 8j+8)
    byte = jnp.zeros(c.shape[:-1], jnp.uint32)
    for t in range(8):
      shift = bits * t - 8 * j
      if -bits < shift < 8:  # code t has bits in this byte
        part = c[..., t] << shift if shift >= 0 else c[..., t] >> -shift
        byte = byte | part
    out.append((byte & 0xFF).astype(jnp.uint8))
  return jnp.stack(out, axis=-1).reshape(*codes.shape[:-1], codes.shape[-1] * bits // 8)


def unpack_bits(packed: jax.Array, bits: int, n: int) -> jax.Array:
  """Inverse of :func:`pack_bits`: uint8[..., n*bits/8] -> uint8[..., n]."""
  if bits == 8:
    return packed
  p = packed.astype(jnp.uint32).reshape(*packed.shape[:-1], n // 8, bits)
  mask = jnp.uint32((1 << bits) - 1)
  out = []
  for t in range(8):
    j, off = divmod(bits * t, 8)
    v = p[..., j] >> off
    if off + bits > 8:  # the code runs into the next byte of the group
      v = v | (p[..., j + 1] << (8 - off))
    out.append((v & mask).astype(jnp.uint8))
  return jnp.stack(out, axis=-1).reshape(*packed.shape[:-1], n)


def blocks(x: jax.Array, block: int) -> jax.Array:
  """[rows, n] -> [rows, n // block, block]."""
  return x.reshape(x.shape[0], x.shape[1] // block, block)


def block_finite(xb: jax.Array) -> jax.Array:
  """[rows, nb, B] -> bool[rows, nb, 1]: True where every element is finite."""
  return jnp.all(jnp.isfinite(xb), axis=-1, keepdims=True)


def cast_term(xhat_abs: jax.Array, dtype: jnp.dtype) -> jax.Array:
  """Bound on the error of rounding a float32 value of magnitude ``xhat_abs`` to ``dtype``."""
  if dtype == jnp.float32:
    return jnp.zeros_like(xhat_abs)
  fi = jnp.finfo(dtype)
  u = 2.0 ** -(fi.nmant + 1)
  sub = max(float(fi.smallest_subnormal) / 2, TINY)
  over = xhat_abs > float(fi.max)
  return jnp.where(over, jnp.inf, xhat_abs * np.float32(u) + np.float32(sub))


def round_up(n: int, m: int) -> int:
  return -(-n // m) * m

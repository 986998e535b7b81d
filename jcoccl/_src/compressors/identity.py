"""The ``none`` (raw bytes) and ``cast`` (bfloat16 / float16) codecs."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax import lax

from jcoccl._src.compressors import registry
from jcoccl._src.compressors._base import FLOAT_DTYPES, Compressor, cast_term

CAST_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _to_bytes(x2d: jax.Array) -> jax.Array:
  """[rows, n] of any dtype -> uint8[rows, n * itemsize] (the raw little-endian bytes)."""
  if x2d.dtype == jnp.bool_:
    return x2d.astype(jnp.uint8)
  b = lax.bitcast_convert_type(x2d, jnp.uint8)
  return b.reshape(x2d.shape[0], -1)


def _from_bytes(buf: jax.Array, n: int, dtype: jnp.dtype) -> jax.Array:
  """Inverse of :func:`_to_bytes`."""
  if dtype == jnp.bool_:
    return buf != 0
  if dtype.itemsize == 1:
    return lax.bitcast_convert_type(buf, dtype)
  return lax.bitcast_convert_type(buf.reshape(buf.shape[0], n, dtype.itemsize), dtype)


@dataclasses.dataclass(frozen=True)
class NoneCompressor(Compressor):
  """No compression: the payload is the row's raw bytes. Any dtype; lossless.

  ``decode_sum`` accumulates float32/bfloat16/float16 rows in float32 (as every codec does)
  and other dtypes in their own dtype.
  """

  kind: ClassVar[str] = "none"
  blockwise: ClassVar[bool] = True
  lossless: ClassVar[bool] = True

  @property
  def granule(self) -> int:
    return 1

  def _check_dtype(self, dtype: Any) -> jnp.dtype:
    try:
      return jnp.dtype(dtype)
    except TypeError as e:
      raise TypeError(f"compressor none: dtype must be a numpy/jax dtype, got {dtype!r}") from e

  def row_nbytes(self, n: int, dtype: jnp.dtype) -> int:
    return n * dtype.itemsize

  def _encode_jnp(self, x2d: jax.Array, key: jax.Array | None) -> jax.Array:
    return _to_bytes(x2d)

  def encode_f32(self, x2d: jax.Array, key: jax.Array | None) -> jax.Array:
    return _to_bytes(x2d.astype(jnp.float32))

  def decode_f32(self, buf: jax.Array, n: int) -> jax.Array:
    return _from_bytes(buf, n, jnp.dtype(jnp.float32))

  def _decode_wide(self, buf: jax.Array, n: int, dtype: jnp.dtype) -> jax.Array:
    x = _from_bytes(buf, n, dtype)
    return x.astype(jnp.float32) if dtype in FLOAT_DTYPES else x

  def bound_f32(self, x2d: jax.Array) -> jax.Array:
    return jnp.zeros(x2d.shape, jnp.float32)


@dataclasses.dataclass(frozen=True)
class CastCompressor(Compressor):
  """Conversion to ``dtype`` (bfloat16 or float16), round-to-nearest-even; granule 1."""

  dtype: Any = jnp.dtype(jnp.bfloat16)  # noqa: RUF009 (a dtype is immutable)
  kind: ClassVar[str] = "cast"
  blockwise: ClassVar[bool] = True

  def __post_init__(self):
    try:
      d = jnp.dtype(self.dtype)
    except TypeError:
      d = None
    if d not in CAST_DTYPES:
      raise ValueError(f"dtype must be one of bfloat16, float16 for cast(), got {self.dtype!r}")
    object.__setattr__(self, "dtype", d)

  @property
  def granule(self) -> int:
    return 1

  def row_nbytes(self, n: int, dtype: jnp.dtype) -> int:
    return n * self.dtype.itemsize

  def encode_f32(self, x2d: jax.Array, key: jax.Array | None) -> jax.Array:
    return _to_bytes(x2d.astype(self.dtype))

  def decode_f32(self, buf: jax.Array, n: int) -> jax.Array:
    return _from_bytes(buf, n, self.dtype).astype(jnp.float32)

  def _decode_rows_jnp(self, buf: jax.Array, n: int, d: jnp.dtype) -> jax.Array:
    # Decoding to the cast dtype itself returns the payload's bits: the float32 round trip
    # would quiet a signalling NaN, and XLA folds it away anyway (WIRE_FORMAT.md).
    if d == self.dtype:
      return _from_bytes(buf, n, d)
    return super()._decode_rows_jnp(buf, n, d)

  def bound_f32(self, x2d: jax.Array) -> jax.Array:
    return cast_term(jnp.abs(x2d), self.dtype)


registry.register("none", NoneCompressor, keys={}, native=lambda c: {})
registry.register(
  {
    n: (lambda d=d: CastCompressor(d))
    for n, d in (
      ("bf16", "bfloat16"),
      ("bfloat16", "bfloat16"),
      ("fp16", "float16"),
      ("float16", "float16"),
      ("f16", "float16"),
    )
  },
  CastCompressor,
  keys={},
  printer=lambda c: "bf16" if c.dtype.name == "bfloat16" else "fp16",
  native=lambda c: {"cast_dtype": c.dtype.name},
)

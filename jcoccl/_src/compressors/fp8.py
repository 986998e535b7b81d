"""Blockwise scaled float8 (e4m3 = float8_e4m3fn, e5m2 = float8_e5m2)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jcoccl._src.compressors import _base as B
from jcoccl._src.compressors import registry

# fmt -> (jnp dtype, FMAX, unit roundoff 2**-(mantissa bits + 1), smallest subnormal)
FORMATS = {
  "e4m3": (jnp.float8_e4m3fn, 448.0, 2.0**-4, 2.0**-9),
  "e5m2": (jnp.float8_e5m2, 57344.0, 2.0**-3, 2.0**-16),
}


@dataclasses.dataclass(frozen=True)
class Fp8Compressor(B.Compressor):
  """Scaled fp8: ``s = amax / FMAX`` per block, codes are fp8(x / s) bit patterns.

  Layout: ``codes: uint8[n] | scales: f32[nb]``.
  """

  fmt: str = "e4m3"
  block_size: int = 128
  kind: ClassVar[str] = "fp8"
  blockwise: ClassVar[bool] = True

  def __post_init__(self):
    if self.fmt not in FORMATS:
      raise ValueError(f"fmt must be one of {tuple(FORMATS)}, got {self.fmt!r}")
    object.__setattr__(self, "block_size", B.check_block_size(self.block_size))

  @property
  def granule(self) -> int:
    return self.block_size

  def fit(self, n: int) -> Fp8Compressor:
    return B.fit_block(self, n)

  def row_nbytes(self, n: int, dtype: jnp.dtype) -> int:
    return n + 4 * (n // self.block_size)

  def encode_f32(self, x2d: jax.Array, key: jax.Array | None) -> jax.Array:
    f8, fmax, _, _ = FORMATS[self.fmt]
    xb = B.blocks(x2d, self.block_size)
    fin = B.block_finite(xb)
    s = jnp.max(jnp.abs(xb), axis=-1, keepdims=True) * np.float32(1.0 / fmax)
    y = jnp.clip(B.div(xb, s), -fmax, fmax)
    y = jnp.where(fin & (s > 0), y, 0.0)
    codes = lax.bitcast_convert_type(y.astype(f8), jnp.uint8).reshape(x2d.shape)
    return jnp.concatenate([codes, B.f32_to_bytes(jnp.where(fin, s, jnp.nan)[..., 0])], axis=-1)

  def decode_f32(self, buf: jax.Array, n: int) -> jax.Array:
    f8 = FORMATS[self.fmt][0]
    y = lax.bitcast_convert_type(buf[:, :n], f8).astype(jnp.float32)
    s = B.bytes_to_f32(buf[:, n:])[..., None]
    # NaN codes, NaN scales and inf * 0 all decode to the canonical NaN.
    return B.canonical_nan(B.blocks(y, self.block_size) * s).reshape(buf.shape[0], n)

  def bound_f32(self, x2d: jax.Array) -> jax.Array:
    # |x - x_hat| <= u8*|x| (fp8 relative rounding) + s*sub8/2 (fp8 subnormal spacing, in x
    # units) + 4u*amax (float32 division, clamp and product roundings)
    # + (FMAX + 2)*TINY (scales/products flushed to zero by FTZ).
    _, fmax, u8, sub8 = FORMATS[self.fmt]
    xb = B.blocks(x2d, self.block_size)
    amax = jnp.max(jnp.abs(xb), axis=-1, keepdims=True)
    s = amax * np.float32(1.0 / fmax)
    b = (
      jnp.abs(xb) * np.float32(u8 * (1 + 4 * B.U32))
      + s * np.float32(sub8 / 2)
      + amax * np.float32(4 * B.U32)
      + np.float32((fmax + 2) * B.TINY)
    )
    ok = B.block_finite(xb) & (amax < np.float32(B.F32_MAX * (1 - 2.0**-20)))
    return jnp.where(ok, b, jnp.inf).reshape(x2d.shape)


def _fp8_string(c: Fp8Compressor) -> str:
  opts = [] if c.fmt == "e4m3" else [c.fmt]
  opts += [] if c.block_size == 128 else [f"block={c.block_size}"]
  return "fp8" + (":" + ",".join(opts) if opts else "")


registry.register(
  "fp8",
  Fp8Compressor,
  keys={"block": "block_size"},
  flags={f: ("fmt", f) for f in FORMATS},
  printer=_fp8_string,
  native=lambda c: {"block": c.block_size, "fp8": c.fmt},
)

"""Error-bounded quantization with per-block variable bit widths (raw fallback per block)."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jcoccl._src.compressors import _base as B
from jcoccl._src.compressors import layout, registry
from jcoccl._src.compressors._base import Payload

RAW = 255
MAX_WIDTH = 31  # width bytes 32..254 are invalid: the block decodes to NaN
QMAX = 2.0**30


@dataclasses.dataclass(frozen=True)
class ErrorBoundedCompressor(B.Compressor):
  """``|x - x_hat| <= float32(abs_error)`` for every finite element; NaN/Inf pass through.

  Layout: ``widths: uint8[nb]`` padded to 4 bytes ``| words: uint32[n]``.
  """

  abs_error: float = 1e-3
  block_size: int = 256
  kind: ClassVar[str] = "error_bounded"
  blockwise: ClassVar[bool] = True

  def __post_init__(self):
    a = self.abs_error
    ok = isinstance(a, (int, float, np.floating)) and not isinstance(a, bool)
    if not ok or not math.isfinite(a) or not (B.TINY <= float(a) <= B.F32_MAX / 4):
      raise ValueError(
        f"abs_error must be a finite float in [{B.TINY:.8g}, {B.F32_MAX / 4:.8g}] "
        f"(> 0; the step 2*abs_error must be a normal float32), got {a!r}"
      )
    object.__setattr__(self, "abs_error", float(a))
    object.__setattr__(self, "block_size", B.check_block_size(self.block_size))

  @property
  def granule(self) -> int:
    return self.block_size

  def _nwidth(self, n: int) -> int:
    return B.round_up(n // self.block_size, 4)

  def row_nbytes(self, n: int, dtype: jnp.dtype) -> int:
    return self._nwidth(n) + 4 * n

  def encode_f32(self, x2d: jax.Array, key: jax.Array | None) -> jax.Array:
    rows, n = x2d.shape
    bs = self.block_size
    nb = n // bs
    step = np.float32(2 * self.abs_error)
    xb = B.blocks(x2d, bs)
    q = jnp.round(B.div(xb, jnp.float32(step)))
    # Barrier: q*step is rounded before the subtraction (no fused multiply-subtract).
    xhat = B.barrier(q * step)
    good = (
      jnp.all(jnp.isfinite(xb), axis=-1)
      & jnp.all(jnp.abs(q) < QMAX, axis=-1)
      & jnp.all(jnp.abs(xb - xhat) <= np.float32(self.abs_error), axis=-1)
    )
    qi = jnp.where(good[..., None], q, 0.0).astype(jnp.int32)
    z = jnp.where(qi >= 0, 2 * qi, -2 * qi - 1).astype(jnp.uint32)
    zmax = jnp.max(z, axis=-1)
    w = (32 - lax.clz(zmax)).astype(jnp.int32)  # bit_length, 0..31
    # Element i's field starts at bit i*w of its block's words.
    pos = jnp.arange(bs, dtype=jnp.int32) * w[..., None]
    idx = pos >> 5
    off = (pos & 31).astype(jnp.uint32)
    lo = z << off
    spill = off + w[..., None].astype(jnp.uint32) > 32
    hi = jnp.where(spill, z >> (jnp.uint32(32) - off), jnp.uint32(0))
    r_i = jnp.arange(rows)[:, None, None]
    b_i = jnp.arange(nb)[None, :, None]
    # Fields do not overlap, so adding is or-ing.
    words = jnp.zeros((rows, nb, bs + 1), jnp.uint32)
    words = words.at[r_i, b_i, idx].add(lo).at[r_i, b_i, idx + 1].add(hi)[..., :bs]
    raw = lax.bitcast_convert_type(xb, jnp.uint32)
    words = jnp.where(good[..., None], words, raw).reshape(rows, n)
    widths = jnp.where(good, w, RAW).astype(jnp.uint8)
    widths = jnp.pad(widths, ((0, 0), (0, self._nwidth(n) - nb)))
    return jnp.concatenate([widths, B.u32_to_bytes(words)], axis=-1)

  def decode_f32(self, buf: jax.Array, n: int) -> jax.Array:
    rows = buf.shape[0]
    bs = self.block_size
    nb = n // bs
    nw = self._nwidth(n)
    w = buf[:, :nb].astype(jnp.int32)
    raw = w == RAW
    # A payload is untrusted: a width byte no encoder writes decodes the block to NaN.
    invalid = (w > MAX_WIDTH) & ~raw
    wq = jnp.where(raw | invalid, 0, w)
    words = B.bytes_to_u32(buf[:, nw:]).reshape(rows, nb, bs)
    ext = jnp.pad(words, ((0, 0), (0, 0), (0, 1)))
    pos = jnp.arange(bs, dtype=jnp.int32) * wq[..., None]
    idx = pos >> 5
    off = (pos & 31).astype(jnp.uint32)
    wu = wq[..., None].astype(jnp.uint32)
    lo = jnp.take_along_axis(ext, idx, axis=-1) >> off
    hi_word = jnp.take_along_axis(ext, idx + 1, axis=-1)
    hi = jnp.where(off + wu > 32, hi_word << (jnp.uint32(32) - off), jnp.uint32(0))
    z = (lo | hi) & ((jnp.uint32(1) << wu) - jnp.uint32(1))
    half = (z >> 1).astype(jnp.int32)
    q = jnp.where((z & 1) == 1, -half - 1, half)
    xhat = q.astype(jnp.float32) * np.float32(2 * self.abs_error)
    out = jnp.where(raw[..., None], lax.bitcast_convert_type(words, jnp.float32), xhat)
    out = jnp.where(invalid[..., None], jnp.float32(np.nan), out)
    return out.reshape(rows, n)

  def bound_f32(self, x2d: jax.Array) -> jax.Array:
    # Quantized blocks are checked element by element (the float32 difference is exact by
    # Sterbenz whenever it is <= abs_error); raw blocks are exact. Non-finite elements pass
    # through bit-exactly and get bound inf (|NaN - NaN| is not a number).
    return jnp.where(jnp.isfinite(x2d), np.float32(self.abs_error), jnp.inf)

  def achieved_ratio(self, payload: Payload) -> float:
    """Input bytes / bytes a variable-length encoding of the widths would need (concrete only).

    Example:
      >>> c = jc.error_bounded(1e-2); c.achieved_ratio(c.encode(jnp.zeros(1024))) > 50
      True
    """
    if not isinstance(payload, Payload):
      raise TypeError(f"payload must be a jcoccl Payload, got {type(payload).__name__}")
    data = np.asarray(payload.data)
    size = math.prod(payload.shape)
    n = layout.padded_len(size, self.granule)
    nb = n // self.block_size
    w = data[:nb].astype(np.int64)
    words = np.where(w == RAW, self.block_size, -(-w * self.block_size // 32))
    need = self._nwidth(n) + 4 * int(words.sum())
    return size * np.dtype(payload.dtype).itemsize / need


def _eb_string(c: ErrorBoundedCompressor) -> str:
  return f"eb:abs={c.abs_error!r}" + ("" if c.block_size == 256 else f",block={c.block_size}")


def _eb_native(c: ErrorBoundedCompressor) -> dict | None:
  # The kernels take the bound as float32; outside (0, 3e38) it does not survive that cast.
  if not 0.0 < np.float32(c.abs_error) < np.float32(3e38):
    return None
  return {"block": c.block_size, "abs_error": c.abs_error}


registry.register(
  ["eb", "error_bounded"],
  ErrorBoundedCompressor,
  keys={"abs": "abs_error", "block": "block_size"},
  required=("abs_error",),
  printer=_eb_string,
  native=_eb_native,
)

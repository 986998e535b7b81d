"""Spike reserving: the k largest magnitudes of each block kept exactly, the rest quantized by
an inner codec over the narrowed range (``spike(int4):k=4``).

Outliers set a block's quantization step: one value 100x the others costs every other value
of its block most of its bits. Reserving the few largest (as float32 with their in-block
index) lets the inner codec's scale follow the bulk of the block. This family is written
with the public codec API (jcoccl.compressors.register); around an int, fp8 or
error_bounded inner codec that rounds to nearest it also has native kernels (C++ and CUDA,
cuda/WIRE_FORMAT.md "spike"), so it runs on every backend.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jcoccl._src.compressors import _base as B
from jcoccl._src.compressors import registry

DEFAULT_K = 4
MAX_BLOCK = 32768  # in-block indices are uint16; 0xFFFF marks nothing valid
INVALID = 0xFFFF


@dataclasses.dataclass(frozen=True)
class SpikeCompressor(B.Compressor):
  """``k`` reserved values per block of the inner codec's granule, then ``inner``.

  Layout of a row of n values, ``G = inner.granule``, ``nb = n / G``:
  ``inner payload of the row with the reserved values replaced by their block's (k+1)-th
  largest magnitude | values: f32[nb, k] | indices: uint16[nb, k] | zeros to a multiple of
  4 bytes``. Reserved values are
  the ``k`` largest finite magnitudes of the block, in that order: by the bits of ``|x|``
  (the order of the magnitudes, subnormals included, whatever the hardware's
  denormals-are-zero mode), ties to the lower index. An index >= G, or one repeated in its
  block, makes the block decode to NaN (never an error: payloads come off the network); a
  NaN value field decodes to the canonical NaN.

  Guarantee: a reserved value decodes bit for bit (0 error); any other value is within the
  inner codec's bound computed on the block with the reserved values zeroed, which is the
  narrowed range; NaN/Inf stay non-finite. Payload: inner's bytes plus ``6 k`` per block
  (rounded up to 4 bytes per row).

  Example:
    >>> c = jc.parse("spike(int4):k=2")
    >>> x = jnp.linspace(-1, 1, 256).at[7].set(100.0)
    >>> float(jnp.max(jnp.abs(c.decode(c.encode(x)) - x))) < 0.1
    True
  """

  inner: B.Compressor = None  # type: ignore[assignment]
  k: int = DEFAULT_K
  kind: ClassVar[str] = "spike"
  blockwise: ClassVar[bool] = True

  def __post_init__(self):
    B.check_inner(self.inner)
    g = self.inner.granule
    if g < 2 or g > MAX_BLOCK or self.inner.lossless:
      raise ValueError(
        f"spike needs a lossy blockwise inner codec (granule 2..{MAX_BLOCK}), got "
        f"{self.inner} (granule {g}); e.g. spike(int4)"
      )
    k = self.k
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k < g:
      raise ValueError(
        f"k must be an int in 1..{g - 1} (below the block of {self.inner}), got {k!r}"
      )
    object.__setattr__(self, "k", int(k))

  @property
  def rounding(self) -> str:
    return getattr(self.inner, "rounding", "nearest")

  @property
  def granule(self) -> int:
    return self.inner.granule

  def row_nbytes(self, n: int, dtype: jnp.dtype) -> int:
    slots = n // self.granule * self.k
    return self.inner.row_nbytes(n, jnp.dtype(jnp.float32)) + 4 * slots + B.round_up(2 * slots, 4)

  def _split(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(the row with the reserved values replaced, reserved mask, indices [rows, nb, k]).

    A reserved value is replaced by the block's (k+1)-th largest magnitude, a value the
    block keeps anyway, so the replacement never widens the inner codec's range (a 0 would,
    for an asymmetric codec on a block of positive values).
    """
    rows, n = x.shape
    xb = x.reshape(rows, n // self.granule, self.granule)
    # Integer keys: the order of |x| by its bits, which no flush of subnormals can tie.
    # Non-finite values are never reserved (key -1), so the inner codec still sees them.
    bits = lax.bitcast_convert_type(jnp.abs(xb), jnp.int32)
    score = jnp.where(jnp.isfinite(xb), bits, jnp.int32(-1))
    _, top = lax.top_k(score, self.k + 1)  # equal keys: the lower index first
    idx = top[..., : self.k]
    fill = jnp.take_along_axis(xb, top[..., self.k :], axis=-1)
    r = jnp.arange(rows)[:, None, None]
    c = jnp.arange(xb.shape[1])[None, :, None]
    mask = jnp.zeros(xb.shape, bool).at[r, c, idx].set(True, unique_indices=True)
    mask = mask & jnp.isfinite(xb)
    rest = jnp.where(mask, jnp.broadcast_to(fill, xb.shape), xb).reshape(rows, n)
    idx = jnp.where(jnp.take_along_axis(mask, idx, axis=-1), idx, INVALID)
    return rest, mask, idx

  def encode_f32(self, x: jax.Array, key: jax.Array | None) -> jax.Array:
    rows, n = x.shape
    rest, _, idx = self._split(x)
    xb = x.reshape(rows, n // self.granule, self.granule)
    vals = jnp.take_along_axis(xb, jnp.minimum(idx, self.granule - 1), axis=-1)
    vals = jnp.where(idx == INVALID, jnp.zeros_like(vals), vals)
    slots = n // self.granule * self.k
    return jnp.concatenate(
      [
        self.inner.encode_f32(rest, key),
        lax.bitcast_convert_type(vals, jnp.uint8).reshape(rows, -1),
        lax.bitcast_convert_type(idx.astype(jnp.uint16), jnp.uint8).reshape(rows, -1),
        jnp.zeros((rows, B.round_up(2 * slots, 4) - 2 * slots), jnp.uint8),
      ],
      axis=1,
    )

  def decode_f32(self, buf: jax.Array, n: int) -> jax.Array:
    rows, g, k = buf.shape[0], self.granule, self.k
    nb = n // g
    p = self.inner.row_nbytes(n, jnp.dtype(jnp.float32))
    body = self.inner.decode_f32(buf[:, :p], n).reshape(rows, nb, g)
    vals = lax.bitcast_convert_type(buf[:, p : p + nb * k * 4].reshape(rows, nb, k, 4), jnp.float32)
    vals = B.canonical_nan(vals)
    idx = buf[:, p + nb * k * 4 : p + nb * k * 6].reshape(rows, nb, k, 2)
    idx = lax.bitcast_convert_type(idx, jnp.uint16)
    idx = idx.astype(jnp.int32)
    # INVALID slots (a block with fewer finite values than k) restore nothing. Any other
    # index must be in the block and distinct: else the block decodes to NaN.
    used = idx != INVALID
    srt = jnp.sort(jnp.where(used, idx, -1 - jnp.arange(k)), axis=-1)
    ok = jnp.all(srt < g, axis=-1, keepdims=True) & jnp.all(
      srt[..., 1:] != srt[..., :-1], axis=-1, keepdims=True
    )
    # Unused slots scatter into k spare columns past the block, cut off afterwards: every
    # index stays distinct and in bounds.
    safe = jnp.where(used & ok, idx, g + jnp.arange(k))
    r = jnp.arange(rows)[:, None, None]
    c = jnp.arange(nb)[None, :, None]
    wide = jnp.concatenate([body, jnp.zeros((rows, nb, k), jnp.float32)], axis=-1)
    out = wide.at[r, c, safe].set(vals, unique_indices=True)[..., :g]
    return jnp.where(ok, out, jnp.float32(np.nan)).reshape(rows, n)

  def bound_f32(self, x: jax.Array) -> jax.Array:
    rows, n = x.shape
    rest, mask, _ = self._split(x)
    inner = self.inner.bound_f32(rest).reshape(rows, n // self.granule, self.granule)
    return jnp.where(mask, jnp.zeros_like(inner), inner).reshape(rows, n)


def _spike(inner: B.Compressor, k: int = DEFAULT_K) -> SpikeCompressor:
  return SpikeCompressor(inner=inner, k=k)


def _spike_string(c: SpikeCompressor) -> str:
  return f"spike({c.inner})" + ("" if c.k == DEFAULT_K else f":k={c.k}")


def _spike_native(c: SpikeCompressor) -> dict | None:
  # The kernels reserve around a plain int, fp8 or error_bounded codec (their own fields).
  if registry.family_of(c.inner).kind not in ("int", "fp8", "error_bounded"):
    return None
  return {"spike": c.k}


registry.register(
  {"spike": _spike},
  SpikeCompressor,
  keys={"k": "k"},
  printer=_spike_string,
  native=_spike_native,
  wraps=True,
)

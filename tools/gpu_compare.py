"""Bit comparison of codec results across platforms (numpy only; no jax import).

The GPU codecs must give the CPU codecs' bytes, with one documented exception: a NaN that a
conversion *produces* (float32 -> bfloat16/float16) is the canonical NaN 0x7fff on the GPU
(PTX cvt.rn) and a quieted, payload-preserving NaN on the CPU (XLA:CPU's conversion). So two
elements of a float field compare equal when their bits are equal or both are NaN; every
other byte (codes, scales, widths, padding) must be identical.

Used by tools/gpu_shim.py (CUDA kernels on the host shim vs the CPU codecs) and
tools/gpu_codecs.py (CUDA kernels on a GPU vs the jnp specification on the CPU).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

# Kind values as in cuda/codecs/codec.h.
NONE, CAST, INT, FP8, ERROR_BOUNDED = 0, 1, 2, 3, 5
F32, BF16, F16 = 0, 1, 2
RAW_WIDTH = 255

_NAN_MASKS = {F32: (0x7FFFFFFF, 0x7F800000), BF16: (0x7FFF, 0x7F80), F16: (0x7FFF, 0x7C00)}
_UINT = {F32: np.uint32, BF16: np.uint16, F16: np.uint16}


class Layout(NamedTuple):
  """What the comparison needs to know of a codec's payload of a row of n elements."""

  kind: int
  block: int  # int / fp8 / error_bounded block size, else 1
  cast_dtype: int  # cast: the payload element type
  hadamard: int  # 0: none
  dtype: int  # the row's element type (F32, BF16, F16)
  n: int

  def payload_elem(self) -> int | None:
    """Element type of a none/cast payload, or None (a structured payload)."""
    if self.kind == NONE:
      return F32 if self.hadamard else self.dtype
    if self.kind == CAST:
      return self.cast_dtype
    return None


def is_nan_bits(u: np.ndarray, dtype: int) -> np.ndarray:
  mask, inf = _NAN_MASKS[dtype]
  return (u & mask) > inf


def float_mismatch(a: np.ndarray, b: np.ndarray, dtype: int) -> np.ndarray:
  """Boolean mask of elements whose bits differ, NaN against NaN counting as equal.

  Args:
    a, b: arrays of the same shape, any dtype whose itemsize is that of ``dtype``.
    dtype: F32, BF16 or F16 (how to find NaNs in the bits).
  Returns:
    ``a != b`` bitwise, except where both are NaN.
  """
  ua = np.ascontiguousarray(a).view(_UINT[dtype])
  ub = np.ascontiguousarray(b).view(_UINT[dtype])
  return (ua != ub) & ~(is_nan_bits(ua, dtype) & is_nan_bits(ub, dtype))


def payload_mismatch(layout: Layout, a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """Boolean mask over the bytes of two uint8[rows, P] payload batches that differ.

  Float fields (none/cast elements, raw error_bounded words) compare NaN-equal; everything
  else bytewise.
  """
  a = np.ascontiguousarray(a, np.uint8).reshape(-1, a.shape[-1])
  b = np.ascontiguousarray(b, np.uint8).reshape(-1, b.shape[-1])
  if a.shape != b.shape:
    raise ValueError(f"payload shapes differ: {a.shape} vs {b.shape}")
  bad = a != b
  elem = layout.payload_elem()
  if elem is not None:
    size = 4 if elem == F32 else 2
    m = float_mismatch(a, b, elem)
    return np.repeat(m, size, axis=-1)
  if layout.kind == ERROR_BOUNDED:
    nb = layout.n // layout.block
    words_at = (nb + 3) // 4 * 4
    wa, wb = a[:, :nb], b[:, :nb]
    raw = (wa == RAW_WIDTH) & (wb == RAW_WIDTH)  # [rows, nb]
    raw_words = np.repeat(raw, layout.block, axis=-1)  # [rows, n]
    # The words only (a spike section may follow them).
    ua = a[:, words_at : words_at + 4 * layout.n].view(np.uint32)
    ub = b[:, words_at : words_at + 4 * layout.n].view(np.uint32)
    w_bad = np.where(raw_words, float_mismatch(ua, ub, F32), ua != ub)
    bad = bad.copy()
    bad[:, words_at : words_at + 4 * layout.n] = np.repeat(w_bad, 4, axis=-1)
  return bad


def describe(mask: np.ndarray, limit: int = 3) -> str:
  """'<count> mismatching, first at [...]' for a mismatch mask."""
  idx = np.argwhere(mask)
  return f"{len(idx)} mismatching, first at {idx[:limit].tolist()}"

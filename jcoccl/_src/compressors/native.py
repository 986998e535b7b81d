"""Native (C++ on CPU, CUDA on GPU) implementations of the codec row operations.

The jnp code in this package is the specification; these custom calls compute the same
bytes. Each function here mirrors a row method of ``Compressor``.

Interface (used by ``Compressor`` when ``impl`` is "native" or "auto"):
  available(c, op, dtype) -> bool
  encode_rows(c, x2d) -> uint8[rows, c.payload_nbytes(n, dtype)]
  decode_rows(c, buf, n, dtype) -> dtype[rows, n]
  decode_sum(c, buf, n, dtype) -> dtype[n]
  decode_sum_encode(c, buf, n, dtype) -> uint8[c.payload_nbytes(n, dtype)]
"""

from __future__ import annotations

from typing import Any


def available(c: Any, op: str, dtype: Any) -> bool:
  """True if a native kernel implements ``op`` for compressor ``c`` on the default backend."""
  del c, op, dtype
  return False

"""Factories of every compressor family (the public constructors)."""

from __future__ import annotations

from typing import Any

from jcoccl._src.compressors._base import Compressor, check_inner
from jcoccl._src.compressors.error_bounded import ErrorBoundedCompressor
from jcoccl._src.compressors.fp8 import Fp8Compressor
from jcoccl._src.compressors.hadamard import HadamardCompressor, default_size
from jcoccl._src.compressors.identity import CastCompressor, NoneCompressor
from jcoccl._src.compressors.intq import IntCompressor
from jcoccl._src.compressors.spike import SpikeCompressor


def none() -> NoneCompressor:
  """No compression: raw bytes, any dtype, exact (``error_bound`` is 0).

  Example:
    >>> none().payload_nbytes(10, jnp.float32)
    40
  """
  return NoneCompressor()


def cast(dtype: Any) -> CastCompressor:
  """Conversion to ``dtype`` (bfloat16 or float16), round-to-nearest-even.

  Guarantee: ``|x - x_hat| <= u*|x| + max(sub/2, 2**-126)`` with ``u = 2**-(mantissa+1)``
  of ``dtype`` (2**-8 bf16, 2**-11 f16) and ``sub`` its smallest subnormal; ``inf`` where
  ``|x| > finfo(dtype).max`` (float16 overflows to Inf); plus the output cast's rounding.

  Example:
    >>> cast(jnp.bfloat16).payload_nbytes(10, jnp.float32)
    20
  """
  return CastCompressor(dtype)


def _int(bits: int, block_size: int, symmetric: bool, rounding: str) -> IntCompressor:
  return IntCompressor(bits=bits, block_size=block_size, symmetric=symmetric, rounding=rounding)


_INT_DOC = """{bits}-bit blockwise quantization (wire format: cuda/WIRE_FORMAT.md "int").

  Args:
    block_size: elements per float32 scale; a power of two in 32..4096.
    symmetric: codes ``round(x / s)`` in [-{qmax}, {qmax}] with ``s = amax / {qmax}`` (True), or
      ``round((x - lo) / s)`` in [0, {lmax}] with ``s = (max - min) / {lmax}`` and a float32 min
      per block (False).
    rounding: "nearest" (half to even) or "stochastic" (``floor(v + U[0,1))``; needs ``key``).

  Guarantee (per element of a finite block, float32 output): ``|x - x_hat| <= s/2 + 4u*amax
  + ({qmax}+2)*2**-126`` (symmetric) or ``s/2 + 8u*(|min| + |max|) + ({lmax}+2)*2**-126``
  (asymmetric), ``u = 2**-24``; ``s`` instead of ``s/2`` for stochastic rounding; plus the
  output dtype's rounding for bfloat16/float16 outputs. Blocks with NaN/Inf decode to NaN.

  Payload: ``n*{bits}/8 + 4*(n/block_size)`` bytes (symmetric), ``+ 4*(n/block_size)`` more
  for asymmetric.

  Example:
    >>> int{bits}().payload_nbytes(1024, jnp.float32)
    {example}
  """


def _int_factory(bits: int):
  def factory(
    block_size: int = 256, symmetric: bool = True, rounding: str = "nearest"
  ) -> IntCompressor:
    return _int(bits, block_size, symmetric, rounding)

  factory.__name__ = factory.__qualname__ = f"int{bits}"
  factory.__doc__ = _INT_DOC.format(
    bits=bits, qmax=2 ** (bits - 1) - 1, lmax=2**bits - 1, example=1024 * bits // 8 + 16
  )
  return factory


int8 = _int_factory(8)
int7 = _int_factory(7)
int6 = _int_factory(6)
int5 = _int_factory(5)
int4 = _int_factory(4)
int3 = _int_factory(3)
int2 = _int_factory(2)


def fp8(fmt: str = "e4m3", block_size: int = 128) -> Fp8Compressor:
  """Scaled fp8 per block: ``s = amax / FMAX``, codes ``fp8(clamp(x / s))`` (RNE).

  Args:
    fmt: "e4m3" (float8_e4m3fn, FMAX 448) or "e5m2" (float8_e5m2, FMAX 57344).
    block_size: elements per float32 scale; a power of two in 32..4096.

  Guarantee (finite block, float32 output): ``|x - x_hat| <= u8*|x|*(1+4u) + s*sub8/2
  + 4u*amax + (FMAX+2)*2**-126`` with ``u8`` = 2**-4 (e4m3) or 2**-3 (e5m2) and ``sub8`` =
  2**-9 or 2**-16 (smallest fp8 subnormal); plus the output dtype's rounding. Blocks with
  NaN/Inf decode to NaN. Payload: ``n + 4*(n/block_size)`` bytes.

  Example:
    >>> fp8("e5m2", block_size=64).payload_nbytes(128, jnp.float32)
    136
  """
  return Fp8Compressor(fmt=fmt, block_size=block_size)


def hadamard(inner: Compressor, size: int | None = None) -> HadamardCompressor:
  """Orthonormal Hadamard rotation of each ``size`` block, then ``inner``.

  Args:
    inner: the codec applied to the rotated float32 row.
    size: power of two in 2..4096; default: ``inner.granule`` capped to 4096, or 128 when
      that granule is 1 (none, cast). ``granule = lcm(size, inner.granule)``.

  Guarantee (per ``size`` block): ``E/sqrt(H) + 2g*(S + E/sqrt(H)) + H*(k+4)*2**-126`` with
  ``E`` the sum of inner's bounds on the rotated block, ``S = sum|x|``, ``k = log2 H``,
  ``g = (k+3)*2**-24`` (rotation roundings both ways); plus the output dtype's rounding.
  NaN/Inf anywhere in a block decode to NaN over the block.

  Example:
    >>> hadamard(int4(block_size=128)).granule
    128
  """
  check_inner(inner)  # before default_size reads its granule
  return HadamardCompressor(inner=inner, size=default_size(inner) if size is None else size)


def spike(inner: Compressor, k: int = 4) -> SpikeCompressor:
  """Spike reserving: the ``k`` largest magnitudes of each block of ``inner``'s granule are
  sent exactly (float32 + uint16 index), the rest by ``inner`` over the narrowed range.

  Args:
    inner: a lossy blockwise codec (int2 ... int8, fp8, eb; hadamard(...) too).
    k: reserved values per block, 1 .. granule - 1.

  Guarantee: reserved values exact; the others within ``inner``'s bound on the block with
  the reserved values replaced; plus the output dtype's rounding. Payload: inner's bytes
  plus ``6 k`` per block. jnp only (backend "xla"/"auto").

  Example:
    >>> spike(int4(), k=2).payload_nbytes(256, jnp.float32)
    144
  """
  return SpikeCompressor(inner=inner, k=k)


def error_bounded(abs_error: float, block_size: int = 256) -> ErrorBoundedCompressor:
  """Error-bounded quantization: ``q = round(x / (2*abs_error))``, variable widths per block.

  Guarantee: ``|x - x_hat| <= float32(abs_error)`` for every finite element with float32
  output (blocks that would miss it are stored raw, exactly); NaN/Inf and huge values pass
  through bit-exactly; plus the output dtype's rounding for bfloat16/float16 outputs.
  Payload (fixed worst case): ``round_up(n/block_size, 4) + 4n`` bytes; see ``achieved_ratio``.

  Args:
    abs_error: float in [2**-126, float32 max / 4].
    block_size: a power of two in 32..4096.

  Example:
    >>> error_bounded(1e-3).payload_nbytes(1024, jnp.float32)
    4100
  """
  return ErrorBoundedCompressor(abs_error=abs_error, block_size=block_size)

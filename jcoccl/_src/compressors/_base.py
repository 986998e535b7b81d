"""Compressor base class and the Payload pytree (the families' shared arithmetic is
:mod:`jcoccl._src.compressors.arith`, re-exported here).

Every codec is a frozen (hashable) dataclass: its fields are the codec's parameters and its
methods are pure jnp functions of arrays, so a compressor can be a static ``jax.jit``
argument or a primitive parameter. Subclasses implement hooks on 2-D float32 rows (the
public contract, docs/custom_compressors.md):

  granule                 row lengths are multiples of it
  row_nbytes(n, dtype)    exact bytes of one row
  encode_f32(x2d, key)    float32[rows, n] -> uint8[rows, row_nbytes]
  decode_f32(buf, n)      uint8[rows, P] -> float32[rows, n]
  bound_f32(x2d)          per-element error bound of a float32 round trip
  decode_sum_f32(buf, n)  optional: the decoded rows' float32 left fold

and the base class adds input checks, padding, output casts, reductions and the choice of
implementation ("jnp" or "native").
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jcoccl._src.compressors import layout, registry, spec

# The families reach these as ``_base.X``; they are the arithmetic module's.
from jcoccl._src.compressors.arith import F32_MAX as F32_MAX
from jcoccl._src.compressors.arith import FLOAT_DTYPES as FLOAT_DTYPES
from jcoccl._src.compressors.arith import IMPLS as IMPLS
from jcoccl._src.compressors.arith import OPS as OPS
from jcoccl._src.compressors.arith import TINY as TINY
from jcoccl._src.compressors.arith import U32 as U32
from jcoccl._src.compressors.arith import barrier as barrier
from jcoccl._src.compressors.arith import block_finite as block_finite
from jcoccl._src.compressors.arith import blocks as blocks
from jcoccl._src.compressors.arith import bytes_to_f32 as bytes_to_f32
from jcoccl._src.compressors.arith import bytes_to_u32 as bytes_to_u32
from jcoccl._src.compressors.arith import canonical_nan as canonical_nan
from jcoccl._src.compressors.arith import cast_term as cast_term
from jcoccl._src.compressors.arith import check_block_size as check_block_size
from jcoccl._src.compressors.arith import check_float_dtype as check_float_dtype
from jcoccl._src.compressors.arith import div as div
from jcoccl._src.compressors.arith import f32_to_bytes as f32_to_bytes
from jcoccl._src.compressors.arith import pack_bits as pack_bits
from jcoccl._src.compressors.arith import plus_zero as plus_zero
from jcoccl._src.compressors.arith import round_up as round_up
from jcoccl._src.compressors.arith import u32_to_bytes as u32_to_bytes
from jcoccl._src.compressors.arith import unpack_bits as unpack_bits
from jcoccl._src.compressors.eager import one_program


def _left_fold(rows: jax.Array) -> jax.Array:
  """``rows[0] + rows[1] + ...`` in row order (the order every native kernel uses)."""
  rows = _whole_rows(rows)
  acc = rows[0]
  for i in range(1, rows.shape[0]):
    acc = acc + rows[i]
  return acc


def _whole_rows(rows: jax.Array) -> jax.Array:
  """``rows`` with its row axis whole on every device. An explicit mesh axis can split it
  (the none codec's payload is a bitcast, which keeps its operand's sharding: an int32
  [2, n] split over a mesh axis of 2 devices, for one), and JAX takes no single row out of
  a split axis ("slicing on sharded dims ... is not implemented"): the fold's sum runs
  across those devices, so they first gather the rows.

  Example:
    >>> _whole_rows(jnp.ones((2, 4))).shape  # no mesh: unchanged
    (2, 4)
  """
  sharding = jax.typeof(rows).sharding
  spec = getattr(sharding, "spec", None)
  if not spec or spec[0] is None:
    return rows
  return jax.reshard(rows, jax.NamedSharding(sharding.mesh, jax.P(None, *spec[1:])))


def _as_one_op(fn: Any, arg: jax.Array, *rest: Any) -> jax.Array:
  """``fn(arg, *rest)``, a codec's jnp row operation, behind optimization barriers.

  A native kernel is a custom call, which XLA never fuses with the ops around it; the
  barriers give the jnp specification the same boundaries. Without them XLA:CPU fused the
  tail of a jnp ``decode_sum`` into AdamW's moment update ``0.1 * g + 0.9 * mu`` and made
  an FMA of the other product than in the native program: the code around the codec
  rounded differently, and native and jnp training split (docs/numerics.md).

  Example:
    >>> _as_one_op(lambda x, k: x * k, jnp.ones(2), 3.0)
    Array([3., 3.], dtype=float32)
  """
  return barrier(fn(barrier(arg), *rest))


def _payload_flatten(p: Payload):
  return (p.data,), (p.shape, p.dtype)


def _payload_unflatten(aux, children) -> Payload:
  return Payload(children[0], *aux)


@dataclasses.dataclass(frozen=True, eq=False)
class Payload:
  """An encoded array: ``data`` is one uint8 row of ``payload_nbytes`` bytes.

  A pytree with one leaf (``data``) and static ``shape`` and ``dtype`` of the original array.

  Example:
    >>> import jax.numpy as jnp, jcoccl.compressors as jc
    >>> p = jc.int8().encode(jnp.ones((3, 100)))
    >>> p.data.shape, p.shape
    ((520,), (3, 100))
  """

  data: jax.Array
  shape: tuple[int, ...]
  dtype: Any

  @property
  def nbytes(self) -> int:
    """Bytes on the wire."""
    return int(self.data.shape[-1])


jax.tree_util.register_pytree_node(Payload, _payload_flatten, _payload_unflatten)


@dataclasses.dataclass(frozen=True)
class Compressor:
  """Base class of every codec, built-in or a user's.

  A codec is a frozen dataclass (its fields are its options) that implements the hooks
  below on 2-D float32 rows, in jnp: ``granule``, ``row_nbytes``, ``encode_f32``,
  ``decode_f32``, ``bound_f32`` (unless ``lossless``), and optionally ``decode_sum_f32``.
  Registered with :func:`jcoccl.compressors.register`, it runs in every collective, policy
  and tool; the base class adds input checks, padding, dtype casts, reductions and the
  choice of implementation ("jnp" or "native").

  Class constants: ``kind`` (the family; set by ``register``), ``lossless`` (exact codecs:
  the error bound is 0 and any dtype may pass through unchanged).

  Example:
    >>> @jc.register("trunc16")
    ... class Trunc16(jc.Compressor):  # bfloat16 by truncation: the top 16 bits
    ...   granule = 1
    ...   def row_nbytes(self, n, dtype): return 2 * n
    ...   def encode_f32(self, x, key):
    ...     hi = (lax.bitcast_convert_type(x, jnp.uint32) >> 16).astype(jnp.uint16)
    ...     return lax.bitcast_convert_type(hi, jnp.uint8).reshape(x.shape[0], -1)
    ...   def decode_f32(self, buf, n):
    ...     hi = lax.bitcast_convert_type(buf.reshape(-1, n, 2), jnp.uint16)
    ...     return lax.bitcast_convert_type(hi.astype(jnp.uint32) << 16, jnp.float32)
    ...   def bound_f32(self, x): return jnp.abs(x) * 2.0**-7 + 2.0**-126
    >>> str(jc.parse("trunc16"))
    'trunc16'
  """

  kind: ClassVar[str] = "abstract"
  lossless: ClassVar[bool] = False
  # True: each block of ``granule`` elements is encoded, summed and decoded on its own,
  # wherever it sits in the row, so the leaves of one call may share a row laid end to end
  # (jcoccl._src.ops.lowering). A codec that reads a whole row (a row-wide scale, top-k over the
  # row) keeps False; a wrapper is block-wise where its inner codec is too.
  blockwise: ClassVar[bool] = False

  # ---- hooks: what a codec implements (public contract, docs/custom_compressors.md) -------
  @property
  def granule(self) -> int:
    """Row lengths are multiples of this many elements (a block size; 1 for elementwise).

    A subclass may also set it as a plain class attribute (``granule = 1``).
    """
    raise NotImplementedError

  def row_nbytes(self, n: int, dtype: jnp.dtype) -> int:
    """Exact payload bytes of one row of ``n`` elements (``n`` a multiple of ``granule``)
    of ``dtype`` (float32, bfloat16 or float16). ``payload_nbytes`` is the checked,
    rounding-up public form."""
    raise NotImplementedError

  def encode_f32(self, x: jax.Array, key: jax.Array | None) -> jax.Array:
    """Encodes each row: ``float32[rows, n]`` -> ``uint8[rows, row_nbytes(n, dtype)]``.

    jnp code only: this is the codec's executable specification. ``key`` is a PRNG key for
    codecs with ``rounding="stochastic"``, else None. Rows of bfloat16/float16 calls arrive
    converted to float32 (exactly), so the payload is the same for every input dtype.
    """
    raise NotImplementedError

  def decode_f32(self, buf: jax.Array, n: int) -> jax.Array:
    """Decodes each row: ``uint8[rows, P]`` -> ``float32[rows, n]``.

    Must be total: any bytes decode to some float32 row without error (payloads come off
    the network). The base class casts the result to the call's dtype.
    """
    raise NotImplementedError

  def bound_f32(self, x: jax.Array) -> jax.Array:
    """Per-element error bound of a float32 round trip: ``float32[rows, n]`` -> ``float32
    [rows, n]`` with ``|x - decode(encode(x))| <= bound``; ``inf`` where nothing is
    promised (e.g. blocks with NaN/Inf, which must decode to NaN/Inf). Not needed when
    ``lossless`` is True (the bound is 0)."""
    raise NotImplementedError

  def decode_sum_f32(self, buf: jax.Array, n: int) -> jax.Array:
    """Optional: ``uint8[rows, P]`` -> ``float32[n]``, the sum of the decoded rows.

    The default is the documented order every native kernel follows: decode each row, then
    a float32 left fold in row order. Override it only with a faster computation of the
    same bits (``jcoccl.compressors.check`` compares the two).
    """
    return _left_fold(barrier(self.decode_f32(buf, n)))

  # Overridden by `none` (any dtype, native-dtype arithmetic).
  def _check_dtype(self, dtype: Any) -> jnp.dtype:
    return check_float_dtype(dtype, f"compressor {self}")

  def _encode_jnp(self, x2d: jax.Array, key: jax.Array | None) -> jax.Array:
    return self.encode_f32(x2d.astype(jnp.float32), key)

  def _decode_wide(self, buf: jax.Array, n: int, dtype: jnp.dtype) -> jax.Array:
    """Decoded rows in the accumulation dtype (float32 for float inputs)."""
    return self.decode_f32(buf, n)

  @property
  def stochastic(self) -> bool:
    return getattr(self, "rounding", "nearest") == "stochastic"

  def fit(self, n: int) -> Compressor:
    """The codec to send rows of at most ``n`` elements with: ``self``, or one with a
    smaller granule that gives every element the same codes and sends less zero padding.

    A message shorter than one block is padded with zeros to a whole block, and the
    padding travels. A codec whose block is coded from ``max |x|`` alone (the padding's
    zeros change nothing) may return itself with the block cut to the message
    (:func:`fit_block`); the default, for every other codec, is ``self``. A codec that
    returns ``self`` for ``n = 1`` is taken to keep its block for every ``n`` (the lowering
    asks that first).

    Example:
      >>> [str(jc.int8().fit(n)) for n in (64, 1000)], str(jc.int8(symmetric=False).fit(64))
      (['int8:block=64', 'int8'], 'int8:asym')
    """
    return self

  # ---- public API --------------------------------------------------------------------------
  @property
  def name(self) -> str:
    """The spec string (``parse(c.name) == c``)."""
    return str(self)

  def __str__(self) -> str:
    try:
      return spec.to_string(self)
    except TypeError:  # an unregistered class: it prints, but no spec names it yet
      return repr(self)

  def payload_nbytes(self, num_elements: int, dtype: Any) -> int:
    """Exact bytes on the wire for a row of ``num_elements`` (rounded up to the granule).

    Example:
      >>> jc.int8().payload_nbytes(1024, jnp.float32)
      1040
    """
    d = self._check_dtype(dtype)
    if num_elements < 0:
      raise ValueError(f"num_elements must be >= 0, got {num_elements}")
    return self.row_nbytes(round_up(int(num_elements), self.granule), d)

  def _check_n(self, n: int, what: str) -> int:
    if not isinstance(n, (int, np.integer)) or n <= 0 or n % self.granule:
      raise ValueError(
        f"{what} must be a positive multiple of the granule {self.granule} of "
        f"compressor {self}, got {n!r}; pad the row (encode() pads for you)"
      )
    return int(n)

  def _impl(self, impl: str, op: str, dtype: jnp.dtype) -> str:
    if impl not in IMPLS:
      raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "jnp" or (op in ("encode", "decode_sum_encode") and self.stochastic):
      return "jnp"
    from jcoccl._src.compressors import native

    ok = native.available(self, op, dtype)
    if impl == "native" and not ok:
      raise ValueError(
        f"impl='native': no native kernel for compressor {self}, op {op!r}, dtype "
        f"{dtype} on backend {jax.default_backend()!r}; use impl='jnp' or 'auto'"
      )
    return "native" if ok else "jnp"

  def _check_key(self, key: jax.Array | None) -> None:
    if self.stochastic and key is None:
      raise ValueError(
        f"key is required for compressor {self} (rounding='stochastic'); "
        "pass key=jax.random.key(...)"
      )

  @one_program
  def encode_rows(
    self, x2d: jax.Array, *, key: jax.Array | None = None, impl: str = "auto"
  ) -> jax.Array:
    """Encodes each row of ``x2d``.

    Args:
      x2d: ``[rows, n]`` array, ``n`` a multiple of ``granule``.
      key: PRNG key, required for stochastic rounding (ignored otherwise).
      impl: "jnp", "native" or "auto".

    Returns:
      ``uint8[rows, payload_nbytes(n, x2d.dtype)]``.

    Example:
      >>> jc.int8().encode_rows(jnp.ones((2, 256))).shape
      (2, 260)
    """
    x2d = jnp.asarray(x2d)
    if x2d.ndim != 2:
      raise ValueError(f"x2d must be 2-D [rows, n], got shape {x2d.shape}")
    d = self._check_dtype(x2d.dtype)
    self._check_n(x2d.shape[1], "x2d.shape[1] (the row length n)")
    if self._impl(impl, "encode", d) == "native":
      from jcoccl._src.compressors import native

      return native.encode_rows(self, x2d)
    self._check_key(key)
    return _as_one_op(self._encode_jnp, x2d, key)

  def _check_buf(self, buf: jax.Array, n: int, dtype: Any, ndim: int = 2) -> jnp.dtype:
    d = self._check_dtype(dtype)
    self._check_n(n, "n")
    want = self.row_nbytes(n, d)
    if buf.ndim != ndim or buf.shape[-1] != want or buf.dtype != jnp.uint8:
      raise ValueError(
        f"buf must be uint8{'[rows, ' if ndim == 2 else '['}{want}] for n={n}, "
        f"dtype={d} and compressor {self}; got {buf.dtype}{list(buf.shape)}"
      )
    return d

  @one_program
  def decode_rows(self, buf: jax.Array, n: int, dtype: Any, *, impl: str = "auto") -> jax.Array:
    """Decodes ``uint8[rows, payload_nbytes(n, dtype)]`` to ``dtype[rows, n]``.

    Example:
      >>> c = jc.int8(); c.decode_rows(c.encode_rows(jnp.ones((2, 256))), 256, jnp.float32)[0, 0]
      Array(1., dtype=float32)
    """
    buf = jnp.asarray(buf)
    d = self._check_buf(buf, n, dtype)
    if self._impl(impl, "decode", d) == "native":
      from jcoccl._src.compressors import native

      return native.decode_rows(self, buf, n, d)
    return _as_one_op(self._decode_rows_jnp, buf, n, d)

  def _decode_rows_jnp(self, buf: jax.Array, n: int, d: jnp.dtype) -> jax.Array:
    return self._decode_wide(buf, n, d).astype(d)

  @one_program
  def decode_sum(self, buf: jax.Array, n: int, dtype: Any, *, impl: str = "auto") -> jax.Array:
    """Decodes every row and sums them: float32 left fold in row order, cast once.

    Example:
      >>> c = jc.int8(); c.decode_sum(c.encode_rows(jnp.ones((3, 256))), 256, jnp.float32)[0]
      Array(3., dtype=float32)
    """
    buf = jnp.asarray(buf)
    d = self._check_buf(buf, n, dtype)
    if self._impl(impl, "decode_sum", d) == "native":
      from jcoccl._src.compressors import native

      return native.decode_sum(self, buf, n, d)
    return _as_one_op(self._decode_sum_jnp, buf, n, d)

  def _decode_sum_jnp(self, buf: jax.Array, n: int, d: jnp.dtype) -> jax.Array:
    if d in FLOAT_DTYPES and type(self).decode_sum_f32 is not Compressor.decode_sum_f32:
      acc = self.decode_sum_f32(buf, n)
    else:
      # The barrier keeps each decoded row's products rounded before the fold adds them.
      acc = _left_fold(barrier(self._decode_wide(buf, n, d)))
    if buf.shape[0] > 1 and jnp.issubdtype(acc.dtype, jnp.floating):
      acc = canonical_nan(acc)  # which NaN a sum of NaNs gives is not fixed by IEEE 754
    return acc.astype(d)

  @one_program
  def decode_sum_encode(
    self, buf: jax.Array, n: int, dtype: Any, *, key: jax.Array | None = None, impl: str = "auto"
  ) -> jax.Array:
    """``encode(decode_sum(buf))`` as one row: ``uint8[payload_nbytes(n, dtype)]``.

    Example:
      >>> c = jc.int8(); c.decode_sum_encode(c.encode_rows(jnp.ones((3, 256))), 256, jnp.float32).shape
      (260,)
    """
    buf = jnp.asarray(buf)
    d = self._check_buf(buf, n, dtype)
    if self._impl(impl, "decode_sum_encode", d) == "native":
      from jcoccl._src.compressors import native

      return native.decode_sum_encode(self, buf, n, d)
    self._check_key(key)
    return _as_one_op(self._decode_sum_encode_jnp, buf, n, d, key)

  def _decode_sum_encode_jnp(self, buf: jax.Array, n: int, d: jnp.dtype, key: Any) -> jax.Array:
    return self._encode_jnp(self._decode_sum_jnp(buf, n, d)[None], key)[0]

  def _flat_row(self, x: jax.Array) -> tuple[jax.Array, int]:
    npad = layout.padded_len(x.size, self.granule)
    return layout.pad_last(layout.flat_row(x), npad)[None], npad

  @one_program
  def encode(self, x: jax.Array, *, key: jax.Array | None = None, impl: str = "auto") -> Payload:
    """Encodes an array of any shape: flattened, zero-padded to the granule, one row.

    Example:
      >>> p = jc.int4().encode(jnp.arange(10.0)); jc.int4().decode(p).shape
      (10,)
    """
    x = jnp.asarray(x)
    self._check_dtype(x.dtype)
    row, _ = self._flat_row(x)
    return Payload(self.encode_rows(row, key=key, impl=impl)[0], tuple(x.shape), jnp.dtype(x.dtype))

  def decode(self, payload: Payload, *, impl: str = "auto") -> jax.Array:
    """Decodes a :class:`Payload` to an array of the original shape and dtype."""
    if not isinstance(payload, Payload):
      raise TypeError(
        f"payload must be a jcoccl Payload (from encode), got {type(payload).__name__}"
      )
    return self._decode_payload(payload, impl=impl)

  @one_program
  def _decode_payload(self, payload: Payload, *, impl: str) -> jax.Array:
    size = math.prod(payload.shape)
    npad = layout.padded_len(size, self.granule)
    out = self.decode_rows(payload.data[None], npad, payload.dtype, impl=impl)[0]
    return out[:size].reshape(payload.shape)

  @one_program
  def error_bound(self, x: jax.Array) -> jax.Array:
    """Per-element bound: ``|x - decode(encode(x))| <= error_bound(x)`` (float32, x's shape).

    The bound is computed in float32 and then rounded up (times 1 + 2**-16) so that its own
    rounding cannot make it smaller than the true bound. Elements of blocks that contain
    NaN/Inf (which decode to NaN/Inf, never to a finite value) get ``inf``.
    """
    x = jnp.asarray(x)
    d = self._check_dtype(x.dtype)
    size = x.size
    row, _ = self._flat_row(x)
    return self._bound_rows(row, d)[0, :size].reshape(x.shape)

  def _bound_rows(self, x2d: jax.Array, d: jnp.dtype) -> jax.Array:
    if self.lossless:
      return jnp.zeros(x2d.shape, jnp.float32)
    xf = x2d.astype(jnp.float32)
    b = self.bound_f32(xf)
    b = b + cast_term(jnp.abs(xf) + b, d)
    b = jnp.where(jnp.isnan(b), jnp.inf, b)
    return b * np.float32(1 + 2.0**-16)


def check_inner(inner: Any) -> Compressor:
  """``inner`` of a wrapping codec (hadamard, spike); TypeError unless it is a Compressor."""
  if not isinstance(inner, Compressor):
    raise TypeError(f"inner must be a jcoccl Compressor, got {type(inner).__name__}")
  return inner


registry.set_base(Compressor)


def fit_block(c: Any, n: int) -> Any:
  """``c`` with ``block_size`` cut to the smallest allowed block (a power of two, 32 or
  more) that holds ``n`` elements, when that is smaller than its own (else ``c``).

  Only for codecs whose block is coded from ``max |x|`` and rounded to nearest: zeros
  added to a block change none of its codes, so one short block gives every element the
  bits that one zero-padded long block gives it. A stochastic codec draws its random bits
  by position in the row, which a shorter row changes.
  """
  if c.stochastic or n <= 0 or n >= c.block_size:
    return c
  b = max(32, 1 << (int(n) - 1).bit_length())
  return dataclasses.replace(c, block_size=b) if b < c.block_size else c

"""The row layout: how a message becomes the rows the backends encode and move.

Every compressed collective sees its message as rows of elements: one row (all_reduce,
all_gather, ppermute) or one row per destination rank (reduce_scatter, all_to_all). A row
is zero-padded to a whole number of *slices*, each a whole number of *units* (the codec's
granule, times the ranks a slice is split over), and slice i of every row is encoded, sent
and decoded on its own. A vmap batch adds messages, which are interleaved slice by slice
so that each one is encoded exactly as on its own.

This module is the one place that knows this arithmetic; the op modules, the fused
backend, error feedback and the benchmarks all ask it, so every path pads and slices alike
(which is what makes ``chunks`` and ``backend`` choices bit-identical).

Example:
  >>> lay = RowLayout.of(length=1000, unit=32, chunks=4)
  >>> lay.slices, lay.padded, lay.width
  (4, 1024, 256)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jcoccl._src import _compat
from jcoccl._src.native import _ffi

# Each slice is its own encode -> collective -> decode in the compiled program (unrolled on
# the xla backend, one engine round per slice on the fused one), so compile time and launch
# overhead grow linearly with the slice count, while the overlap it buys saturates after a
# few slices (COCCL pipelines 1 to 16 deep). 64 leaves room above that.
MAX_SLICES = 64


# ----------------------------------------------------------------------------------------
# Arithmetic.


def padded_len(length: int, multiple: int) -> int:
  """``length`` rounded up to a positive multiple of ``multiple``.

  Args:
    length: elements (0 pads to one ``multiple``: a row is never empty).
    multiple: positive int.

  Returns:
    The padded length.

  Example:
    >>> padded_len(1000, 64), padded_len(0, 32)
    (1024, 32)
  """
  return max(1, -(-length // multiple)) * multiple


def lcm(*values: int) -> int:
  """Least common multiple of positive ints (1 for none), e.g. of several granules.

  Example:
    >>> lcm(32, 128, 1)
    128
  """
  out = 1
  for v in values:
    out = out * v // math.gcd(out, v)
  return out


def granule_rows(nbytes: int, itemsize: int, granule: int) -> int:
  """Elements of a row of about ``nbytes`` bytes holding whole granules (at least one):
  rounded down to the granule, up for sizes under one granule.

  Example:
    >>> granule_rows(1000, 4, 32), granule_rows(8, 4, 32)
    (224, 32)
  """
  return max(nbytes // itemsize // granule, 1) * granule


def slices(chunks: int, length: int, unit: int) -> int:
  """The number of slices a message is cut into for ``chunks``.

  A slice holds at least one ``unit`` (the granule, times the group size where the
  algorithm splits a slice over ranks), so ``chunks`` is clamped to the number of units
  the ``length``-element message holds. Slices are cut at unit boundaries and processed
  independently, so the result has the same bits as with that smaller ``chunks``.

  Args:
    chunks: the requested slice count (a positive int).
    length: message length in elements.
    unit: elements of the smallest slice.

  Returns:
    min(chunks, ceil(length / unit)), at least 1.

  Raises:
    ValueError: more than :data:`MAX_SLICES` slices would be used.

  Example:
    >>> slices(2**20, 1024, 32), slices(4, 1024, 32)
    (32, 4)
  """
  k = min(chunks, max(1, -(-length // unit)))
  if k > MAX_SLICES:
    raise ValueError(
      f"chunks={chunks} would cut this message of {length} elements into {k} slices; at "
      f"most {MAX_SLICES} are supported (each slice is unrolled into the compiled "
      f"program): pass chunks <= {MAX_SLICES}"
    )
  return k


@dataclasses.dataclass(frozen=True)
class RowLayout:
  """The padded layout of rows of ``length`` elements cut into ``slices`` slices.

  Attributes:
    length: elements of a row before padding.
    unit: elements of the smallest slice.
    slices: slices per row (``chunks`` clamped by :func:`slices`).
  """

  length: int
  unit: int
  slices: int

  @classmethod
  def of(cls, length: int, unit: int, chunks: int) -> RowLayout:
    """The layout for ``chunks`` requested slices (raises as :func:`slices` does).

    Example:
      >>> RowLayout.of(100, 32, 8).slices
      4
    """
    return cls(length, unit, slices(chunks, length, unit))

  @property
  def padded(self) -> int:
    """Elements of a padded row: a positive multiple of ``slices * unit``."""
    return padded_len(self.length, self.slices * self.unit)

  @property
  def width(self) -> int:
    """Elements of one slice of a padded row."""
    return self.padded // self.slices

  def pad(self, rows: jax.Array) -> jax.Array:
    """Zero-pads the last axis of ``rows`` (``length`` elements) to :attr:`padded`."""
    return pad_last(rows, self.padded)

  def unpad(self, rows: jax.Array) -> jax.Array:
    """The first ``length`` elements of the last axis (drops the padding)."""
    return rows[..., : self.length]


# ----------------------------------------------------------------------------------------
# Arrays.


def pad_last(x: jax.Array, size: int) -> jax.Array:
  """Zero-pads the last axis of ``x`` to ``size``.

  Example:
    >>> pad_last(jnp.ones((2, 3)), 4).shape
    (2, 4)
  """
  extra = size - x.shape[-1]
  if extra == 0:
    return x
  widths = [(0, 0)] * (x.ndim - 1) + [(0, extra)]
  return jnp.pad(x, widths)


def flat_row(x: jax.Array) -> jax.Array:
  """A message as one row: ``x`` flattened (the all_reduce/all_gather/ppermute layout)."""
  return x.reshape(-1)


def row_block(shape: tuple, dim: int, n: int) -> tuple:
  """The shape of one destination row's block of a message of ``shape`` split along
  ``dim`` over ``n`` ranks, with ``dim`` moved first (the layout of :func:`to_rows`).

  Example:
    >>> row_block((4, 6), 1, 3)
    (2, 4)
  """
  return (shape[dim] // n,) + tuple(s for i, s in enumerate(shape) if i != dim)


def to_rows(x: jax.Array, dim: int, n: int) -> tuple[jax.Array, tuple]:
  """A message as ``n`` destination rows, split along ``dim``.

  Args:
    x: the message; ``x.shape[dim]`` is a multiple of ``n``.
    dim: the axis split over destinations.
    n: destinations (ranks).

  Returns:
    (``[n, c]`` rows, row j = block j of ``dim`` with ``dim`` moved first and flattened;
    the shape of one block in that moved layout).

  Example:
    >>> rows, block = to_rows(jnp.zeros((4, 6)), 1, 3)
    >>> rows.shape, block
    ((3, 8), (2, 4))
  """
  return jnp.moveaxis(x, dim, 0).reshape(n, -1), row_block(x.shape, dim, n)


def from_rows(rows: jax.Array, block: tuple, dim: int) -> jax.Array:
  """Inverse of :func:`to_rows` for ``[..., c]`` rows (leading axes kept): each row back
  to its block, with ``dim`` (of the block) back in place: ``[..., *x block]``.

  Example:
    >>> x = jnp.arange(24.0).reshape(4, 6)
    >>> rows, block = to_rows(x, 1, 3)
    >>> from_rows(rows, block, 1).shape
    (3, 4, 2)
  """
  lead = rows.shape[:-1]
  out = rows.reshape(lead + tuple(block))
  return jnp.moveaxis(out, len(lead), len(lead) + dim)


def rank_rows(x: jax.Array, n: int) -> jax.Array:
  """Rows ``[..., w]`` split over ``n`` ranks: ``[..., n, w / n]`` (part j goes to rank j).

  Example:
    >>> rank_rows(jnp.zeros((2, 12)), 3).shape
    (2, 3, 4)
  """
  return x.reshape(x.shape[:-1] + (n, x.shape[-1] // n))


def chunked(fn: Callable[[jax.Array, int], Any], x: jax.Array, chunks: int) -> Any:
  """Applies ``fn(slice, index)`` to ``chunks`` equal slices of x's last axis; concatenates.
  An ``fn`` that returns a tuple of arrays per slice (a result and its residual) gives the
  tuple of their concatenations.

  Each slice runs its own encode -> collective -> decode, so XLA can overlap one slice's
  communication with another's codec work.

  Example:
    >>> chunked(lambda s, i: s * (i + 1), jnp.ones(4), 2).tolist()
    [1.0, 1.0, 2.0, 2.0]
    >>> [v.tolist() for v in chunked(lambda s, i: (s * 2, s * i), jnp.ones(4), 2)]
    [[2.0, 2.0, 2.0, 2.0], [0.0, 0.0, 1.0, 1.0]]
  """
  if chunks == 1:
    return fn(x, 0)
  width = x.shape[-1] // chunks
  outs = [fn(x[..., i * width : (i + 1) * width], i) for i in range(chunks)]
  if isinstance(outs[0], tuple):
    return tuple(jnp.concatenate([o[j] for o in outs], axis=-1) for j in range(len(outs[0])))
  return jnp.concatenate(outs, axis=-1)


def slice_major(x: jax.Array, k: int) -> jax.Array:
  """``[*mid, k * w]`` -> ``[k, *mid, w]``: slice i of every row, slices first (the fused
  engine's layout).

  Example:
    >>> slice_major(jnp.zeros((3, 8)), 2).shape
    (2, 3, 4)
  """
  mid, total = x.shape[:-1], x.shape[-1]
  y = x.reshape(mid + (k, total // k))
  return y if not mid else jnp.moveaxis(y, -2, 0)


def from_slice_major(y: jax.Array) -> jax.Array:
  """Inverse of :func:`slice_major`: ``[k, *mid, w]`` -> ``[*mid, k * w]``."""
  k, mid, w = y.shape[0], y.shape[1:-1], y.shape[-1]
  if mid:
    y = jnp.moveaxis(y, 0, -2)
  return y.reshape(mid + (k * w,))


# ----------------------------------------------------------------------------------------
# Packing: several leaves laid end to end in one row (:func:`jcoccl._src.compressors.rows.run_packed`).


@dataclasses.dataclass(frozen=True)
class Span:
  """One leaf's place in a packed row: ``count`` segments (its vmap batch) of ``length``
  elements, each followed by zeros up to ``padded`` (a whole number of codec blocks)."""

  count: int
  length: int
  padded: int


PACK_TARGETS = ("jcoccl_pack_rows", "jcoccl_unpack_rows")


def native_packing() -> bool:
  """Whether :func:`pack_parts` / :func:`unpack_parts` use jcoccl._cpu's calls: the program
  is lowered for CPU alone (outside a lowering: the default backend is the CPU) and the
  native module is in use (``jcoccl.config(native=...)``)."""
  platforms = _compat.lowering_platforms() or (jax.default_backend(),)
  return tuple(platforms) == ("cpu",) and all(_ffi.has_target(t, "cpu") for t in PACK_TARGETS)


def _span_attrs(spans: list[Span], rows: int) -> dict[str, np.ndarray | np.int64]:
  return dict(
    lengths=np.array([s.length for s in spans], np.int64),
    padded=np.array([s.padded for s in spans], np.int64),
    counts=np.array([s.count for s in spans], np.int64),
    rows=np.int64(rows),
  )


def _varying(out: jax.Array, *xs: jax.Array) -> jax.Array:
  """``out`` (an ffi_call result, which carries no varying manual axes) varying over the
  axes any of ``xs`` varies over."""
  vma: set = set()
  for x in xs:
    vma |= _compat.varying_axes(x)
  missing = tuple(sorted(vma - _compat.varying_axes(out)))
  return jax.lax.pcast(out, missing, to="varying") if missing else out


def pack_parts(parts: list[jax.Array], spans: list[Span], width: int) -> jax.Array:
  """The packed row ``[*mid, width]`` of ``parts`` (leaf i: ``[*mid, count * length]``),
  laid out as :class:`Span` says, zeros in every gap and up to ``width``.

  Example:
    >>> pack_parts([jnp.ones((1, 3))], [Span(1, 3, 4)], 8).tolist()
    [[1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]]
  """
  mid, dtype = parts[0].shape[:-1], parts[0].dtype
  if native_packing():
    rows = math.prod(mid)
    fn = jax.ffi.ffi_call(PACK_TARGETS[0], jax.ShapeDtypeStruct(mid + (width,), dtype))
    return _varying(fn(*parts, **_span_attrs(spans, rows)), *parts)
  index, start = [], 0
  for sp in spans:
    pos = start + np.arange(sp.count * sp.length).reshape(sp.count, sp.length)
    index.append(np.pad(pos, ((0, 0), (0, sp.padded - sp.length)), constant_values=-1).ravel())
    start += sp.count * sp.length
  if width <= GATHER_MAX:
    zero = jnp.zeros(mid + (1,), dtype)
    idx = pad_index(np.concatenate(index), width)
    return jnp.concatenate(parts + [zero], axis=-1)[..., np.where(idx < 0, start, idx)]
  padded_parts = []
  for part, sp in zip(parts, spans):
    grid = pad_last(part.reshape(mid + (sp.count, sp.length)), sp.padded)
    padded_parts.append(grid.reshape(mid + (sp.count * sp.padded,)))
  return pad_last(jnp.concatenate(padded_parts, axis=-1), width)


def unpack_parts(out: jax.Array, spans: list[Span]) -> list[jax.Array]:
  """Each leaf's ``[*mid, count * length]`` cut back out of a packed row ``out``
  (``[*mid, width]``; ``mid`` may differ from the packed input's, e.g. after a gather).

  Example:
    >>> [p.tolist() for p in unpack_parts(jnp.arange(8.0)[None], [Span(1, 3, 4), Span(1, 2, 4)])]
    [[[0.0, 1.0, 2.0]], [[4.0, 5.0]]]
  """
  mid = out.shape[:-1]
  if native_packing():
    shapes = [jax.ShapeDtypeStruct(mid + (sp.count * sp.length,), out.dtype) for sp in spans]
    fn = jax.ffi.ffi_call(PACK_TARGETS[1], shapes)
    return [_varying(p, out) for p in fn(out, **_span_attrs(spans, math.prod(mid)))]
  parts, at = [], 0
  for sp in spans:
    part = out[..., at : at + sp.count * sp.padded]
    at += sp.count * sp.padded
    part = part.reshape(mid + (sp.count, sp.padded))[..., : sp.length]
    parts.append(part.reshape(mid + (sp.count * sp.length,)))
  return parts


# Elements of a packed row up to which the XLA-op path builds it by one gather (its int32
# index, a constant of the compiled program, is then at most 16 MiB).
GATHER_MAX = 1 << 22


def pad_index(index: np.ndarray, size: int) -> np.ndarray:
  """``index`` padded with -1 (a zero element) to ``size`` entries, as int32."""
  return np.pad(index, (0, size - index.size), constant_values=-1).astype(np.int32)

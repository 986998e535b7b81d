"""A leaf's message as the rows a backend moves (:class:`Rows`), run alone with its vmap
batch (:func:`run_batched`) or packed with other leaves of one wire format into one chain
(:func:`run_packed`). The padding and slicing arithmetic is :mod:`jcoccl._src.compressors.layout`'s.

Example:
  >>> twice = lambda r, k: 2 * r
  >>> Rows(jnp.ones(3), 0, jnp.ravel, lambda r: r, 3, 8, 4, twice).run(1).tolist()
  [2.0, 2.0, 2.0]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jcoccl._src.compressors.layout import (
  MAX_SLICES,
  RowLayout,
  Span,
  pack_parts,
  padded_len,
  unpack_parts,
)

# ----------------------------------------------------------------------------------------
# A vmap batch: B padded messages -> the backend's rows.


def interleave(rows: jax.Array, k: int) -> jax.Array:
  """``[B, *mid, L]`` -> ``[*mid, k * B * (L / k)]``: slice i of every message, then i+1.

  Each backend slice then holds slice i of each message, whole codec blocks each, so each
  message is encoded, sent and decoded as on its own. B == 1 is a plain reshape.
  """
  b, mid, length = rows.shape[0], rows.shape[1:-1], rows.shape[-1]
  if b == 1:
    return rows.reshape(mid + (length,))
  w = length // k
  out = jnp.moveaxis(rows.reshape((b,) + mid + (k, w)), 0, -2)
  return out.reshape(mid + (k * b * w,))


def deinterleave(out: jax.Array, b: int, k: int) -> jax.Array:
  """Inverse of :func:`interleave`: ``[*mid, k * B * w]`` -> ``[B, *mid, k * w]``."""
  mid, total = out.shape[:-1], out.shape[-1]
  if b == 1:
    return out.reshape((1,) + mid + (total,))
  w = total // (k * b)
  y = jnp.moveaxis(out.reshape(mid + (k, b, w)), -2, 0)
  return y.reshape((b,) + mid + (k * w,))


def rows_in(pre: Callable, x: jax.Array, nb: int) -> jax.Array:
  """``pre`` (one message -> its padded rows) applied to each of the ``nb``-dim batch of
  ``x``: ``[B, *rows]`` (B = 1 without batch axes)."""
  if nb == 0:
    return pre(x)[None]
  return jax.vmap(pre)(x.reshape((-1,) + x.shape[nb:]))


def rows_out(post: Callable, y: jax.Array, lead: tuple) -> jax.Array:
  """``post`` (one message's rows -> its result) applied to each of ``y``'s B messages,
  reshaped to the batch axes ``lead``."""
  if not lead:
    return post(y[0])
  out = jax.vmap(post)(y)
  return out.reshape(tuple(lead) + out.shape[1:])


def run_batched(
  lay: RowLayout,
  pre: Callable,
  x: jax.Array,
  nb: int,
  impl: Callable[[jax.Array], Any],
  post: Callable | tuple[Callable, ...],
) -> Any:
  """One message or an ``nb``-dim batch of them through a backend, laid out as rows.

  Args:
    lay: the layout of each message's rows.
    pre: one message -> its unpadded rows (``[..., lay.length]``).
    x: the message, with ``nb`` leading batch axes.
    nb: batch axes of ``x``.
    impl: the backend call on the interleaved padded rows (``lay.slices`` slices); it
      returns the result rows, or a tuple of row arrays (a result and its residual).
    post: one message's unpadded result rows -> its result; a tuple of them, one per
      array ``impl`` returns.

  Returns:
    ``post`` of each message's rows, with the batch axes in front (a tuple for a tuple
    ``post``).
  """
  rows = rows_in(lambda v: lay.pad(pre(v)), x, nb)
  out = impl(interleave(rows, lay.slices))

  def back(o: jax.Array, p: Callable) -> jax.Array:
    got = deinterleave(o, rows.shape[0], lay.slices)
    return rows_out(lambda r: p(lay.unpad(r)), got, x.shape[:nb])

  if isinstance(post, tuple):
    return tuple(back(o, p) for o, p in zip(out, post, strict=True))
  return back(out, post)


# ----------------------------------------------------------------------------------------
# One leaf's message as rows, run alone or packed with other leaves into one chain.


@dataclasses.dataclass(frozen=True)
class Rows:
  """One leaf's message as the rows a backend moves: what :func:`run_batched` needs, and
  what :func:`run_packed` needs to pack it with other leaves of the same wire format.

  Attributes:
    x: the leaf, with ``nb`` leading batch axes.
    nb: batch axes of ``x``.
    pre: one message -> its unpadded rows ``[*mid, length]``.
    post: one message's unpadded result rows -> its result.
    length: elements of a row.
    unit: elements of the smallest slice (the granule, times the ranks a slice is split
      over).
    block: elements of one codec block (the granule; for per-level codecs the lcm of
      their granules): every codec pass sees whole blocks that start at a multiple of it.
    call: ``(padded rows, slices) -> result rows``: the backend on rows whose last axis
      is a multiple of ``slices * unit``; with ``back``, the pair (result rows, residual
      rows), the residual rows in the input's padded layout.
    wire: what else must match for two leaves to share a chain (hashable; e.g. the
      all_reduce algorithm or the ppermute pairs).
    back: None, or one message's unpadded residual rows -> its residual (the inverse of
      ``pre``): the run then returns (result, residual), both from the one call
      (:mod:`jcoccl._src.base.residual`).
    codec: the compressor ``call`` encodes with (for ``joint``).
    joint: None, or ``[(padded row, codec), ...] -> [what call returns, ...]``: rows of
      several codecs of one backend, algorithm and group through ONE collective chain,
      their payloads laid side by side (:func:`run_joint`), each with the bits that
      ``call`` gives it (one slice each).
  """

  x: jax.Array
  nb: int
  pre: Callable[[jax.Array], jax.Array]
  post: Callable[[jax.Array], jax.Array]
  length: int
  unit: int
  block: int
  call: Callable[[jax.Array, int], jax.Array]
  wire: tuple = ()
  back: Callable[[jax.Array], jax.Array] | None = None
  codec: Any = None
  joint: Callable[[list[tuple[jax.Array, Any]]], list] | None = None

  @property
  def posts(self) -> Callable | tuple[Callable, ...]:
    """What turns each array ``call`` returns back into one message's (see ``back``)."""
    return self.post if self.back is None else (self.post, self.back)

  def run(self, chunks: int) -> Any:
    """This leaf alone through the backend, in ``chunks`` slices (see :func:`slices`):
    its result, or with ``back`` the pair (result, residual)."""
    lay = RowLayout.of(self.length, self.unit, chunks)
    return run_batched(
      lay, self.pre, self.x, self.nb, lambda r: self.call(r, lay.slices), self.posts
    )


def run_packed(members: list[Rows], chunks: int) -> list[jax.Array]:
  """Several leaves of one wire format through ONE backend call: each message padded to
  whole codec blocks, all laid end to end in one row (per destination row), the total
  padded to whole slices of whole units; each result cut back out.

  A codec block never straddles two messages and starts at a multiple of ``block`` (slice
  and rank boundaries are multiples of ``unit``, itself a multiple of ``block``), so a
  codec whose blocks are encoded, summed and decoded independently of each other gives
  every element the same bits as :meth:`Rows.run` of its leaf alone, for any ``chunks``
  (slices only regroup whole blocks). A codec that reads across blocks (a row-wide scale)
  or draws random bits by position does not have this property: the caller packs only
  codecs that are block-wise.

  How the row is built and cut (:func:`pack_parts`, :func:`unpack_parts`): on CPU with
  jcoccl._cpu, one ``jcoccl_pack_rows`` and one ``jcoccl_unpack_rows`` call (XLA:CPU runs
  each slice or pad as a kernel of its own: 200 leaves cost 200 unpack kernels per device,
  more than the collective); elsewhere XLA ops. Both give the same row.

  Args:
    members: the leaves, sharing ``unit``, ``block``, ``call`` (up to closures over equal
      parameters), the rows' leading shape and dtype.
    chunks: the requested slices of the packed row (clamped as :func:`slices` does, and
      to :data:`MAX_SLICES`: slicing does not change the bits).

  Returns:
    Each member's result (with ``back``: the pair (result, residual)), as :meth:`Rows.run`
    would give it.

  Example:
    >>> twice = lambda r, k: 2 * r
    >>> a, b = (Rows(jnp.ones(n), 0, jnp.ravel, lambda r: r, n, 8, 4, twice) for n in (3, 6))
    >>> [y.tolist() for y in run_packed([a, b], 1)]
    [[2.0, 2.0, 2.0], [2.0, 2.0, 2.0, 2.0, 2.0, 2.0]]
  """
  row, lay, spans = _pack(members, chunks)
  return _unpack(members[0].call(row, lay.slices), members, spans)


def run_joint(groups: list[list[Rows]]) -> list[list[Any]]:
  """Several packed chains of one backend, algorithm and group, each with its own codec
  (a long-block one for long leaves, a fitted short-block one for short leaves), through
  ONE collective chain: their payloads travel side by side (``Rows.joint``), each chain
  padded to whole units of its own codec, so no short leaf is padded to a long block.

  Each element has the bits :func:`run_packed` of its own chain gives it (payload bytes
  are only moved, never re-coded); one slice per chain.

  Args:
    groups: the chains; every member's ``joint`` is set, one slice each.

  Returns:
    Per chain, each member's result as :func:`run_packed` gives it.
  """
  joint = groups[0][0].joint
  if joint is None:
    raise ValueError("run_joint: these rows' backend has no joint chain (Rows.joint is None)")
  packed = [_pack(members, 1) for members in groups]
  outs = joint([(row, members[0].codec) for (row, _, _), members in zip(packed, groups)])
  return [_unpack(o, m, spans) for o, m, (_, _, spans) in zip(outs, groups, packed)]


def _pack(members: list[Rows], chunks: int) -> tuple[jax.Array, RowLayout, list[Span]]:
  """The packed row of ``members`` (see :func:`run_packed`), its layout and spans."""
  parts, spans = [], []
  for m in members:
    rows = rows_in(m.pre, m.x, m.nb)  # [B, *mid, length]
    b = rows.shape[0]
    parts.append(jnp.moveaxis(rows, 0, -2).reshape(rows.shape[1:-1] + (b * m.length,)))
    spans.append(Span(b, m.length, padded_len(m.length, m.block)))
  first = members[0]
  lay = RowLayout.of(sum(s.count * s.padded for s in spans), first.unit, min(chunks, MAX_SLICES))
  return pack_parts(parts, spans, lay.padded), lay, spans


def _unpack(out: Any, members: list[Rows], spans: list[Span]) -> list[Any]:
  """Each member's result cut out of a packed chain's output ``out`` (a tuple with
  residuals: then pairs)."""
  outs = out if isinstance(out, tuple) else (out,)
  results: list[list] = [[] for _ in members]
  for j, o in enumerate(outs):  # the results, then the residuals, cut as the input was
    for got, m, part, sp in zip(results, members, unpack_parts(o, spans), spans):
      part = jnp.moveaxis(part.reshape(part.shape[:-1] + (sp.count, sp.length)), -2, 0)
      post = m.posts[j] if isinstance(m.posts, tuple) else m.posts
      got.append(rows_out(post, part, m.x.shape[: m.nb]))
  return [tuple(got) if isinstance(out, tuple) else got[0] for got in results]

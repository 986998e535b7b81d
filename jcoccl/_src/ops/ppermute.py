"""Compressed ppermute (send/recv): encode once, lax.ppermute the payload, decode once."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jcoccl._src.base.axes import group_size, rank_key
from jcoccl._src.base.lax_errors import lax_errors, with_hint
from jcoccl._src.compressors import layout as L
from jcoccl._src.compressors.compressor_args import SAME, canonical_args, is_lone_array
from jcoccl._src.compressors.payloads import decode_rows, encode_rows, side_by_side
from jcoccl._src.compressors.rows import Rows
from jcoccl._src.native import _backend
from jcoccl._src.ops import primitives as P


def ppermute(
  x: Any,
  axis_name: Any,
  perm: Any,
  *,
  compressor: Any = None,
  backend: str = "auto",
  chunks: int = 1,
  min_bytes: int | None = None,
  grad_compressor: Any = SAME,
  key: Any = None,
) -> Any:
  """Sends ``x`` from rank ``src`` to rank ``dst`` for each pair of ``perm``, as
  ``jax.lax.ppermute``; ranks that receive nothing get zeros.

  The payload is encoded once and decoded once at the destination. The transpose is the
  inverse permutation with ``grad_compressor``.

  Args:
    x: array or pytree of arrays.
    axis_name: mesh axis name or tuple of names (ranks are linear indices over them).
    perm: list or tuple of (source, destination) pairs (TypeError otherwise, as lax's);
      no source or destination twice, every index an int in [-n, n) (a negative one
      counts from the end, as lax's). A perm lax rejects raises lax's error and words
      first (:mod:`jcoccl._src.base.lax_errors`).
    compressor: Compressor, spec string, or None (exact: calls lax.ppermute).
    backend: "auto" (the fused engine where :func:`jcoccl.init` made it able to run this
      call, else "xla"), "xla" or "fused" (ValueError saying why when it cannot).
    chunks: split the message into this many independently processed slices (cut at
      granule boundaries: the same bits as chunks=1). Values above the number of granules
      the message holds are clamped to it; more than 64 slices raises ValueError.
    min_bytes: leaves smaller than this (bytes) go uncompressed; None = the default.
    grad_compressor: compressor of the backward ppermute; default: ``compressor``.
    key: PRNG key for stochastic-rounding compressors; leaf i of several rounds with
      ``jax.random.fold_in(key, i)``, so leaves round independently; under jax.grad or
      jax.jvp the derivative's collective rounds with the key folded once more.

  Pytree leaves that are not float32/bfloat16/float16 (and leaves under ``min_bytes``) go
  exactly; a lone array of another dtype with a lossy compressor raises TypeError.

  Returns:
    The received array(s), shaped like ``x``.

  Example:
    >>> y = jcoccl.ppermute(x, "pipe", [(0, 1), (1, 2)], compressor="int8")  # doctest: +SKIP
  """
  # lax's order: perm's type, the axis names, then (lax: when it lowers) the pairs.
  with lax_errors("ppermute", lax.ppermute, x, axis_name, perm):
    if not isinstance(perm, (list, tuple)):  # an iterator would be spent by the first look
      raise TypeError(
        "perm must be a list or a tuple of (source, destination) pairs, got perm of type "
        f"{type(perm).__name__}"
      )
    axes, comp, gcomp = canonical_args(axis_name, compressor, grad_compressor, chunks)
    perm = check_perm(perm, group_size(axes))
  return P.apply_tree(
    "ppermute",
    x,
    key,
    axes=axes,
    compressor=comp,
    grad_compressor=gcomp,
    backend=backend,
    chunks=chunks,
    min_bytes=min_bytes,
    strict=is_lone_array(x),
    perm=perm,
  )


def check_perm(perm: Any, n: int) -> tuple:
  """``perm`` as lax.ppermute reads it, as (source, destination) pairs in [0, n).

  lax's rule (applied when it lowers the op; here when the op is traced): the indices,
  modulo ``n``, must not repeat a source or a destination; then each indexes the group, so
  it is an int in [-n, n), a negative one counting from the end. A perm lax rejects gets
  lax's exception and words (Python's, where lax's rule is plain indexing), then jcoccl's
  (:func:`jcoccl._src.base.lax_errors.with_hint`).

  Args:
    perm: a list or tuple of pairs.
    n: the group size.

  Returns:
    The pairs, each index in [0, n).

  Example:
    >>> check_perm([(0, 1), (-1, 0)], 4)
    ((0, 1), (3, 0))
  """
  group = tuple(range(n))
  hint = f"perm must be (source, destination) pairs of ints in [{-n}, {n}) (the group size)"
  try:
    pairs = tuple(map(tuple, perm))  # what lax binds
    wrapped = [(s % n, d % n) for s, d in pairs]
  except (TypeError, ValueError) as e:
    raise with_hint(e, ValueError(f"{hint}; got {perm!r}"), "ppermute") from None
  for name, idx in (("source", [s for s, _ in wrapped]), ("destination", [d for _, d in wrapped])):
    if len(set(idx)) != len(idx):
      lax_text = f"ppermute sources and destinations must be unique, got {pairs}."
      ours = ValueError(f"perm has a duplicate {name} (modulo the group size {n}): {perm!r}")
      raise with_hint(ValueError(lax_text), ours, "ppermute")
  out = []
  for s, d in pairs:
    try:
      out.append((group[s], group[d]))
    except (TypeError, IndexError) as e:
      ours = ValueError(f"perm pair {(s, d)} is out of range: {hint}")
      raise with_hint(e, ours, "ppermute") from None
  return tuple(out)


def _exact(x: jax.Array, axes: tuple, *, perm: tuple) -> jax.Array:
  return lax.ppermute(x, axes, perm)


def _rows(
  x: jax.Array,
  key: Any,
  *,
  axes: tuple,
  perm: tuple,
  compressor: Any,
  backend: str,
  batch: int,
  **_: Any,
) -> Rows | None:
  """The leaf as one row (None: the exact lax.ppermute runs)."""
  comp = P.load(compressor)
  if comp is None:
    return None
  shape = x.shape[batch:]
  impl = _backend.implementation("ppermute", backend)
  return Rows(
    x,
    batch,
    L.flat_row,
    lambda r: r.reshape(shape),
    math.prod(shape),
    comp.granule,
    comp.granule,
    lambda r, k: impl(r, axes=axes, perm=perm, compressor=comp, chunks=k, key=key),
    wire=(perm,),
    codec=comp,
    joint=(lambda pairs: _joint(pairs, axes, perm)) if impl is _xla_ppermute else None,
  )


def _forward(x: jax.Array, key: Any, **params: Any) -> jax.Array:
  rows = _rows(x, key, **params)
  if rows is None:
    return lax.ppermute(x, params["axes"], params["perm"])
  return rows.run(params["chunks"])


def _grad_args(params: dict, invert: bool) -> dict:
  perm = params["perm"]
  if invert:  # the dual: every pair sent back
    perm = tuple((d, s) for s, d in perm)
  return P.grad_args(params, perm=perm)


P.register(
  P.Op(
    "ppermute",
    out_shape=lambda shape, params: shape,
    reduces=lambda params: False,
    forward=_forward,
    rows=_rows,
    check=lambda x, n, axes, *, perm: dict(perm=perm),
    exact=_exact,
    tangent_args=lambda params: _grad_args(params, False),
    dual_args=lambda params: _grad_args(params, True),
  )
)


# ----------------------------------------------------------------------------------------
# XLA backend.


def _receives(axes: tuple, perm: tuple) -> jax.Array:
  """Whether this rank is a destination of ``perm`` (a bool scalar)."""
  if not perm:
    return jnp.zeros((), bool)
  dsts = jnp.array([d for _, d in perm])
  return jnp.any(lax.axis_index(axes) == dsts)


def _joint(pairs: list[tuple[jax.Array, Any]], axes: tuple, perm: tuple, key: Any = None) -> list:
  """The compressed permutation of several rows, each with its own codec, their payloads
  side by side in one ppermute (``Rows.joint``; one row: a slice of the xla backend)."""
  receives = _receives(axes, perm)
  bufs = [encode_rows(c, xs[None], key=key) for xs, c in pairs]
  got = side_by_side(bufs, lambda b: lax.ppermute(b, axes, perm))
  # A rank that receives nothing holds an all-zero buffer: lax.ppermute gives zeros,
  # and a zero payload need not decode to zeros (e.g. scale fields), so mask it.
  # A scalar zero, not zeros_like(xs): that would carry xs's sharding, which under a
  # partial-auto shard_map names a mesh other than the context's.
  return [
    jnp.where(receives, decode_rows(c, g, xs.shape[-1], xs.dtype)[0], jnp.zeros((), xs.dtype))
    for (xs, c), g in zip(pairs, got)
  ]


def _xla_ppermute(
  x: jax.Array, *, axes: tuple, perm: tuple, compressor: Any, chunks: int, key: Any
) -> jax.Array:
  def one(xs: jax.Array, i: int) -> jax.Array:
    if compressor is None:
      return lax.ppermute(xs, axes, perm)
    return _joint([(xs, compressor)], axes, perm, rank_key(key, axes, i))[0]

  return L.chunked(one, x, chunks)


_backend.register("xla", "ppermute", _xla_ppermute)

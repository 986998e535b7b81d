"""Compressed ppermute (send/recv): encode once, lax.ppermute the payload, decode once."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jcoccl._src import _backend
from jcoccl._src import _common as C
from jcoccl._src import layout as L
from jcoccl._src import primitives as P


def ppermute(
  x: Any,
  axis_name: Any,
  perm: Any,
  *,
  compressor: Any = None,
  backend: str = "auto",
  chunks: int = 1,
  min_bytes: int | None = None,
  grad_compressor: Any = C.SAME,
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
      no source or destination twice, every index in [0, n).
    compressor: Compressor, spec string, or None (exact: calls lax.ppermute).
    backend: "auto" (the fused engine where :func:`jcoccl.init` made it able to run this
      call, else "xla"), "xla" or "fused" (ValueError saying why when it cannot).
    chunks: split the message into this many independently processed slices (cut at
      granule boundaries: the same bits as chunks=1). Values above the number of granules
      the message holds are clamped to it; more than 64 slices raises ValueError.
    min_bytes: leaves smaller than this (bytes) go uncompressed; None = the default.
    grad_compressor: compressor of the backward ppermute; default: ``compressor``.
    key: PRNG key for stochastic-rounding compressors.

  Pytree leaves that are not float32/bfloat16/float16 (and leaves under ``min_bytes``) go
  exactly; a lone array of another dtype with a lossy compressor raises TypeError.

  Returns:
    The received array(s), shaped like ``x``.

  Example:
    >>> y = jcoccl.ppermute(x, "pipe", [(0, 1), (1, 2)], compressor="int8")  # doctest: +SKIP
  """
  if not isinstance(perm, (list, tuple)):  # as lax.ppermute: an iterator is a mistake
    raise TypeError(
      "`perm` passed to jcoccl.ppermute must be a list or a tuple of (source, destination) "
      f"pairs, as for jax.lax.ppermute; got perm of type {type(perm).__name__}"
    )
  axes, comp, gcomp = C.canonical_args(axis_name, compressor, grad_compressor, chunks)
  n = C.group_size(axes)
  perm = check_perm(perm, n)
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
    strict=C.is_lone_array(x),
    perm=perm,
  )


def check_perm(perm: Any, n: int) -> tuple:
  """``perm`` as a tuple of (src, dst) int pairs; ValueError on duplicates/out of range."""
  try:
    pairs = tuple((int(s), int(d)) for s, d in perm)
  except (TypeError, ValueError):
    raise ValueError(
      f"perm must be a sequence of (source, destination) int pairs, got {perm!r}"
    ) from None
  for s, d in pairs:
    if not (0 <= s < n and 0 <= d < n):
      raise ValueError(
        f"perm pair {(s, d)} is out of range: indices must be in [0, {n}) for a group of size {n}"
      )
  srcs, dsts = [s for s, _ in pairs], [d for _, d in pairs]
  if len(set(srcs)) != len(srcs):
    raise ValueError(f"perm has a duplicate source: {perm!r}")
  if len(set(dsts)) != len(dsts):
    raise ValueError(f"perm has a duplicate destination: {perm!r}")
  return pairs


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
) -> L.Rows | None:
  """The leaf as one row (None: the exact lax.ppermute runs)."""
  comp = P.load(compressor)
  if comp is None:
    return None
  shape = x.shape[batch:]
  impl = _backend.implementation("ppermute", backend)
  return L.Rows(
    x,
    batch,
    L.flat_row,
    lambda r: r.reshape(shape),
    math.prod(shape),
    comp.granule,
    comp.granule,
    lambda r, k: impl(r, axes=axes, perm=perm, compressor=comp, chunks=k, key=key),
    wire=(perm,),
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


def _xla_ppermute(
  x: jax.Array, *, axes: tuple, perm: tuple, compressor: Any, chunks: int, key: Any
) -> jax.Array:
  receives = jnp.zeros((), bool)
  if perm:
    dsts = jnp.array([d for _, d in perm])
    receives = jnp.any(lax.axis_index(axes) == dsts)

  def one(xs: jax.Array, i: int) -> jax.Array:
    if compressor is None:
      return lax.ppermute(xs, axes, perm)
    buf = C.encode_rows(compressor, xs[None], key=C.rank_key(key, axes, i))
    got = lax.ppermute(buf, axes, perm)
    # A rank that receives nothing holds an all-zero buffer: lax.ppermute gives zeros,
    # and a zero payload need not decode to zeros (e.g. scale fields), so mask it.
    # A scalar zero, not zeros_like(xs): that would carry xs's sharding, which under a
    # partial-auto shard_map names a mesh other than the context's.
    return jnp.where(
      receives, C.decode_rows(compressor, got, xs.shape[-1], xs.dtype)[0], jnp.zeros((), xs.dtype)
    )

  return L.chunked(one, x, chunks)


_backend.register("xla", "ppermute", _xla_ppermute)

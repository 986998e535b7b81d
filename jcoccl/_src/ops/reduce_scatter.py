"""Compressed reduce_scatter ("one_shot"): encode each destination chunk once, exchange the
payloads with one all_to_all, decode and sum in float32 in source-rank order."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jcoccl._src import _compat
from jcoccl._src.base import residual as R
from jcoccl._src.base.axes import group_size, rank_key
from jcoccl._src.compressors import layout as L
from jcoccl._src.compressors.compressor_args import SAME, canonical_args, is_lone_array
from jcoccl._src.compressors.payloads import decode_rows, decode_sum, encode_rows, side_by_side
from jcoccl._src.compressors.rows import Rows
from jcoccl._src.native import _backend
from jcoccl._src.ops import primitives as P


def reduce_scatter(
  x: Any,
  axis_name: Any,
  *,
  scatter_dimension: int = 0,
  tiled: bool = False,
  compressor: Any = None,
  algorithm: str = "auto",
  backend: str = "auto",
  chunks: int = 1,
  min_bytes: int | None = None,
  grad_compressor: Any = SAME,
  key: Any = None,
  axis_index_groups: Any = None,
  residual: Any = None,
) -> Any:
  """Sums ``x`` over ``axis_name`` and scatters the result, as ``jax.lax.psum_scatter``.

  Algorithm "one_shot" (the only one; "auto" means it): each rank splits its input into
  the n destination chunks and encodes each once (``encode_rows`` over [n, chunk]); one
  ``lax.all_to_all`` moves the uint8 payloads; each rank decodes the n payloads it got and
  sums them in float32 in source-rank order (``decode_sum``), casting once. One
  quantization per element, never a ring of re-quantizations. The transpose is a
  compressed :func:`jcoccl.all_gather` with ``grad_compressor``.

  Args:
    x: array or pytree of arrays (local values inside ``jax.shard_map``).
    axis_name: mesh axis name or tuple of names.
    scatter_dimension: the dimension to scatter (as lax.psum_scatter). With
      ``tiled=False`` its size must equal the group size; with ``tiled=True`` it must be
      divisible by it.
    tiled: keep the scattered dimension (size / n) instead of removing it.
    compressor: Compressor, spec string, or None (exact: calls lax.psum_scatter).
    algorithm: "auto" or "one_shot".
    backend: "auto" (the fused engine where :func:`jcoccl.init` made it able to run this
      call, else "xla"), "xla" or "fused" (ValueError saying why when it cannot).
    chunks: split each destination chunk into this many independently processed slices
      (cut at granule boundaries: the same bits as chunks=1). Values above the number of
      granules a destination chunk holds are clamped to it; more than 64 slices raises
      ValueError.
    min_bytes: leaves smaller than this (bytes) go uncompressed; None = the default.
    grad_compressor: compressor of the backward all_gather; default: ``compressor``.
    key: PRNG key for stochastic-rounding compressors; leaf i of several rounds with
      ``jax.random.fold_in(key, i)``, so leaves round independently; under jax.grad or
      jax.jvp the derivative's collective rounds with the key folded once more.
    axis_index_groups: as lax's; given, the exact lax op runs (the compressed algorithms
      work over whole mesh axes).
    residual: error feedback, as :func:`jcoccl.all_reduce`'s: None, or what each leaf
      owes (float32, a pytree like ``x``, the whole input's shape). A compressed leaf
      sends ``x + residual`` and the call also returns what its encoder lost of the n
      destination chunks it sent; an exact leaf carries its residual forward.

  Pytree leaves that are not float32/bfloat16/float16 (and leaves under ``min_bytes``) go
  exactly; a lone array of another dtype with a lossy compressor raises TypeError.

  Returns:
    This rank's reduced shard(s), shaped like ``lax.psum_scatter``'s; with ``residual``,
    the pair (shards, new residuals).

  Example:
    >>> y = jcoccl.reduce_scatter(g, "data", tiled=True, compressor="int4")  # doctest: +SKIP
  """
  if algorithm not in ("auto", "one_shot"):
    raise ValueError(
      f"algorithm must be 'auto' or 'one_shot' for reduce_scatter, got {algorithm!r}"
    )
  axes, comp, gcomp = canonical_args(axis_name, compressor, grad_compressor, chunks, tiled)
  if axis_index_groups is not None:
    out = lax.psum_scatter(
      x, axes, scatter_dimension=scatter_dimension, axis_index_groups=axis_index_groups, tiled=tiled
    )
    return out if residual is None else (out, residual)
  return P.apply_tree(
    "reduce_scatter",
    x,
    key,
    axes=axes,
    compressor=comp,
    grad_compressor=gcomp,
    backend=backend,
    chunks=chunks,
    min_bytes=min_bytes,
    strict=is_lone_array(x),
    scatter_dimension=scatter_dimension,
    tiled=tiled,
    residual=residual,
  )


def check_scatter(shape: tuple, dim: Any, tiled: bool, n: int) -> int:
  """Validates scatter_dimension against lax.psum_scatter's rules; returns it normalised."""
  if not shape:
    raise ValueError("reduce_scatter needs an input of rank >= 1 (x is a scalar)")
  if not isinstance(dim, int) or not -len(shape) <= dim < len(shape):
    raise ValueError(
      f"scatter_dimension must be an int in [{-len(shape)}, {len(shape)}), got {dim!r}"
    )
  dim %= len(shape)
  if tiled and shape[dim] % n:
    raise ValueError(
      f"scatter_dimension {dim} has size {shape[dim]}, which is not divisible by the "
      f"group size {n} (tiled=True needs a multiple of it)"
    )
  if not tiled and shape[dim] != n:
    raise ValueError(
      f"scatter_dimension {dim} has size {shape[dim]}, but tiled=False needs it to equal "
      f"the group size {n} (or pass tiled=True)"
    )
  return dim


def _check(x: jax.Array, n: int, axes: tuple, *, scatter_dimension: Any, tiled: bool) -> dict:
  del axes
  return dict(scatter_dimension=check_scatter(x.shape, scatter_dimension, tiled, n), tiled=tiled)


def _exact(x: jax.Array, axes: tuple, *, scatter_dimension: int, tiled: bool) -> jax.Array:
  return lax.psum_scatter(x, axes, scatter_dimension=scatter_dimension, tiled=tiled)


def from_block(flat: jax.Array, block: tuple, dim: int, tiled: bool) -> jax.Array:
  """One destination block (a row of :func:`jcoccl._src.compressors.layout.to_rows`) -> psum_scatter's
  output layout."""
  out = L.from_rows(flat, block, dim)
  return out if tiled else jnp.squeeze(out, dim)


def _out_shape(shape: tuple, params: dict) -> tuple:
  n, dim = group_size(params["axes"]), params["scatter_dimension"]
  if params["tiled"]:
    return shape[:dim] + (shape[dim] // n,) + shape[dim + 1 :]
  return shape[:dim] + shape[dim + 1 :]


def _rows(
  x: jax.Array,
  key: Any,
  *,
  axes: tuple,
  scatter_dimension: int,
  tiled: bool,
  compressor: Any,
  backend: str,
  batch: int,
  residual: bool = False,
  **_: Any,
) -> Rows | None:
  """The leaf as one row per destination rank (None: the exact lax.psum_scatter runs).
  Packed with other leaves, destination row j holds every leaf's block j, so each leaf's
  scattered dimension lands on the rank lax.psum_scatter gives it."""
  dim = scatter_dimension
  comp = P.load(compressor)
  if comp is None:
    return None
  if set(axes) & _compat.unreduced_axes(x):
    x = _compat.unreduced_as_varying(x, axes)  # each device's partial is one operand
  n = group_size(axes)
  block = L.row_block(x.shape[batch:], dim, n)
  impl = _backend.implementation("reduce_scatter", backend)
  more = {"residual": True} if residual else {}
  return Rows(
    x,
    batch,
    lambda v: L.to_rows(v, dim, n)[0],
    lambda r: from_block(r, block, dim, tiled),
    math.prod(block),
    comp.granule,
    comp.granule,
    lambda r, k: impl(r, axes=axes, compressor=comp, chunks=k, key=key, **more),
    codec=comp,
    joint=(lambda pairs: _joint(pairs, axes, residual)) if impl is _xla_reduce_scatter else None,
  )


def _back(shape: tuple, params: dict) -> Any:
  """Inverse of the rows' ``pre``: ``[n, block]`` destination rows -> the message."""
  dim, n = params["scatter_dimension"], group_size(params["axes"])
  block = L.row_block(shape, dim, n)
  return lambda r: jnp.moveaxis(r.reshape((n * block[0],) + tuple(block[1:])), 0, dim)


def _forward(x: jax.Array, key: Any, **params: Any) -> jax.Array:
  rows = _rows(x, key, **params)
  if rows is None:
    dim = params["scatter_dimension"] + params["batch"]
    return lax.psum_scatter(x, params["axes"], scatter_dimension=dim, tiled=params["tiled"])
  return rows.run(params["chunks"])


P.register(
  P.Op(
    "reduce_scatter",
    out_shape=_out_shape,
    reduces=lambda params: False,
    forward=_forward,
    rows=_rows,
    back=_back,
    check=_check,
    exact=_exact,
    row_length=lambda size, n: size // n,
    # lax.psum_scatter of an unreduced value transposes to all_gather(to="reduced").
    unreduced_transpose=lambda ct, params: lax.all_gather(
      ct, params["axes"], axis=params["scatter_dimension"], tiled=params["tiled"], to="reduced"
    ),
    tangent_args=lambda params: P.grad_args(
      params, tiled=params["tiled"], scatter_dimension=params["scatter_dimension"]
    ),
    # The dual, all_gather, stacks or tiles along the scattered dimension.
    dual_args=lambda params: P.grad_args(
      params, tiled=params["tiled"], axis=params["scatter_dimension"]
    ),
  )
)


# ----------------------------------------------------------------------------------------
# XLA backend.


def scatter_rows(
  x: jax.Array, axes: tuple, compressor: Any, chunks: int, key: Any, residual: bool = False
) -> Any:
  """dtype[n, C] (row j for rank j) -> dtype[C], the sum over source ranks; with
  ``residual`` (a compressor given) also float32[n, C], what the encoder lost of x."""

  def one(xs: jax.Array, i: int) -> Any:
    if compressor is None:
      return lax.psum_scatter(xs, axes, scatter_dimension=0, tiled=False)
    return _joint([(xs, compressor)], axes, residual, rank_key(key, axes, i))[0]

  return L.chunked(one, x, chunks)


def _xla_reduce_scatter(
  x: jax.Array, *, axes: tuple, compressor: Any, chunks: int, key: Any, residual: bool = False
) -> Any:
  return scatter_rows(x, axes, compressor, chunks, key, residual)


def _joint(
  pairs: list[tuple[jax.Array, Any]], axes: tuple, residual: bool, key: Any = None
) -> list:
  """The compressed reduce-scatter of several destination-row arrays (``dtype[n, C]``,
  row j for rank j), each with its own codec, their payloads side by side in one
  all-to-all (``Rows.joint``; one array: :func:`scatter_rows`' slice).

  Returns:
    Per array, its sum over source ranks (with ``residual``, the pair (sum, residual)).
  """
  bufs = [encode_rows(c, xs, key=key) for xs, c in pairs]
  # Row i of what arrives came from rank i.
  got = side_by_side(bufs, lambda b: lax.all_to_all(b, axes, 0, 0, tiled=True))
  outs: list = []
  for (xs, c), g, buf in zip(pairs, got, bufs):
    out = decode_sum(c, g, xs.shape[-1], xs.dtype)
    lost = R.lost(xs, decode_rows(c, buf, xs.shape[-1], xs.dtype)) if residual else None
    outs.append((out, lost) if residual else out)
  return outs


_backend.register("xla", "reduce_scatter", _xla_reduce_scatter)

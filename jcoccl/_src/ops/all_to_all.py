"""Compressed all_to_all: encode each destination chunk once, exchange the uint8 payloads
with one lax.all_to_all, decode each received chunk once."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jcoccl._src.base.axes import group_size, rank_key
from jcoccl._src.compressors import layout as L
from jcoccl._src.compressors.compressor_args import SAME, canonical_args, is_lone_array
from jcoccl._src.compressors.payloads import decode_rows, encode_rows, side_by_side
from jcoccl._src.compressors.rows import Rows
from jcoccl._src.native import _backend
from jcoccl._src.ops import primitives as P


def all_to_all(
  x: Any,
  axis_name: Any,
  split_axis: int,
  concat_axis: int,
  *,
  tiled: bool = False,
  compressor: Any = None,
  backend: str = "auto",
  chunks: int = 1,
  min_bytes: int | None = None,
  grad_compressor: Any = SAME,
  key: Any = None,
  axis_index_groups: Any = None,
) -> Any:
  """Exchanges chunks of ``x`` between the ranks of ``axis_name``, as ``jax.lax.all_to_all``.

  ``x`` is split along ``split_axis`` into n chunks (chunk j goes to rank j) and the
  received chunks are concatenated (``tiled=True``) or stacked (``tiled=False``: the split
  axis, of size n, is removed and a new axis of size n is inserted at ``concat_axis``)
  along ``concat_axis`` in source-rank order. Each chunk is encoded once and decoded once.
  The transpose is the inverse all_to_all (split and concat axes swapped) with
  ``grad_compressor``.

  Args:
    x: array or pytree of arrays.
    axis_name: mesh axis name or tuple of names.
    split_axis: axis to split (size divisible by n; equal to n when ``tiled=False``).
    concat_axis: axis along which received chunks are concatenated/stacked.
    tiled: as lax.all_to_all.
    compressor: Compressor, spec string, or None (exact: calls lax.all_to_all).
    backend: "auto" (the fused engine where :func:`jcoccl.init` made it able to run this
      call, else "xla"), "xla" or "fused" (ValueError saying why when it cannot).
    chunks: split each chunk into this many independently processed slices (cut at
      granule boundaries: the same bits as chunks=1). Values above the number of granules
      a chunk holds are clamped to it; more than 64 slices raises ValueError.
    min_bytes: leaves smaller than this (bytes) go uncompressed; None = the default.
    grad_compressor: compressor of the backward all_to_all; default: ``compressor``.
    key: PRNG key for stochastic-rounding compressors; leaf i of several rounds with
      ``jax.random.fold_in(key, i)``, so leaves round independently; under jax.grad or
      jax.jvp the derivative's collective rounds with the key folded once more.
    axis_index_groups: as lax's; given, the exact lax op runs (the compressed algorithms
      work over whole mesh axes).

  Pytree leaves that are not float32/bfloat16/float16 (and leaves under ``min_bytes``) go
  exactly; a lone array of another dtype with a lossy compressor raises TypeError.

  Returns:
    Array(s) shaped like ``lax.all_to_all``'s output.

  Example:
    >>> y = jcoccl.all_to_all(x, "expert", 0, 0, tiled=True, compressor="fp8")  # doctest: +SKIP
  """
  axes, comp, gcomp = canonical_args(axis_name, compressor, grad_compressor, chunks, tiled)
  if axis_index_groups is not None:
    return jax.tree_util.tree_map(
      lambda leaf: lax.all_to_all(
        leaf, axes, split_axis, concat_axis, axis_index_groups=axis_index_groups, tiled=tiled
      ),
      x,
    )
  return P.apply_tree(
    "all_to_all",
    x,
    key,
    axes=axes,
    compressor=comp,
    grad_compressor=gcomp,
    backend=backend,
    chunks=chunks,
    min_bytes=min_bytes,
    strict=is_lone_array(x),
    split_axis=split_axis,
    concat_axis=concat_axis,
    tiled=tiled,
  )


def _check_axes(
  shape: tuple, split_axis: Any, concat_axis: Any, tiled: bool, n: int
) -> tuple[int, int]:
  nd = len(shape)
  if nd == 0:
    raise ValueError("all_to_all needs an input of rank >= 1 (x is a scalar)")
  if not isinstance(split_axis, int) or not -nd <= split_axis < nd:
    raise ValueError(f"split_axis must be an int in [{-nd}, {nd}), got {split_axis!r}")
  out_nd = nd  # tiled keeps the rank; non-tiled removes one axis and inserts one
  if not isinstance(concat_axis, int) or not -out_nd <= concat_axis < out_nd:
    raise ValueError(f"concat_axis must be an int in [{-out_nd}, {out_nd}), got {concat_axis!r}")
  split_axis %= nd
  concat_axis %= out_nd
  if tiled and shape[split_axis] % n:
    raise ValueError(
      f"split_axis {split_axis} has size {shape[split_axis]}, not divisible "
      f"by the group size {n} (tiled=True)"
    )
  if not tiled and shape[split_axis] != n:
    raise ValueError(
      f"split_axis {split_axis} has size {shape[split_axis]}, but "
      f"tiled=False needs it to equal the group size {n}"
    )
  return split_axis, concat_axis


def _check(
  x: jax.Array, n: int, axes: tuple, *, split_axis: Any, concat_axis: Any, tiled: bool
) -> dict:
  del axes
  sa, ca = _check_axes(x.shape, split_axis, concat_axis, tiled, n)
  return dict(split_axis=sa, concat_axis=ca, tiled=tiled)


def _exact(
  x: jax.Array, axes: tuple, *, split_axis: int, concat_axis: int, tiled: bool
) -> jax.Array:
  return lax.all_to_all(x, axes, split_axis, concat_axis, tiled=tiled)


def _out_shape(shape: tuple, params: dict) -> tuple:
  n = group_size(params["axes"])
  sa, ca = params["split_axis"], params["concat_axis"]
  if not params["tiled"]:
    rest = shape[:sa] + shape[sa + 1 :]
    return rest[:ca] + (n,) + rest[ca:]
  out = list(shape)
  out[sa] //= n
  out[ca] *= n
  return tuple(out)


def _rows(
  x: jax.Array,
  key: Any,
  *,
  axes: tuple,
  split_axis: int,
  concat_axis: int,
  tiled: bool,
  compressor: Any,
  backend: str,
  batch: int,
  **_: Any,
) -> Rows | None:
  """The leaf as one row per destination rank (None: the exact lax.all_to_all runs).
  Packed with other leaves, destination row j holds every leaf's block j."""
  sa, ca = split_axis, concat_axis
  comp = P.load(compressor)
  if comp is None:
    return None
  n = group_size(axes)
  block = L.row_block(x.shape[batch:], sa, n)
  impl = _backend.implementation("all_to_all", backend)

  def post(r: jax.Array) -> jax.Array:
    blocks = L.from_rows(r, block, sa)  # [n, *x block]
    if not tiled:
      return jnp.moveaxis(jnp.squeeze(blocks, sa + 1), 0, ca)
    bshape = blocks.shape[1:]
    return jnp.moveaxis(blocks, 0, ca).reshape(bshape[:ca] + (n * bshape[ca],) + bshape[ca + 1 :])

  return Rows(
    x,
    batch,
    lambda v: L.to_rows(v, sa, n)[0],
    post,
    math.prod(block),
    comp.granule,
    comp.granule,
    lambda r, k: impl(r, axes=axes, compressor=comp, chunks=k, key=key),
    codec=comp,
    joint=(lambda pairs: _joint(pairs, axes)) if impl is _xla_all_to_all else None,
  )


def _forward(x: jax.Array, key: Any, **params: Any) -> jax.Array:
  rows = _rows(x, key, **params)
  if rows is None:
    sa, ca = params["split_axis"] + params["batch"], params["concat_axis"] + params["batch"]
    return lax.all_to_all(x, params["axes"], sa, ca, tiled=params["tiled"])
  return rows.run(params["chunks"])


def _grad_args(params: dict, swap: bool) -> dict:
  sa, ca = params["split_axis"], params["concat_axis"]
  if swap:  # the dual: the inverse exchange
    sa, ca = ca, sa
  return P.grad_args(params, split_axis=sa, concat_axis=ca, tiled=params["tiled"])


P.register(
  P.Op(
    "all_to_all",
    out_shape=_out_shape,
    reduces=lambda params: False,
    forward=_forward,
    rows=_rows,
    check=_check,
    exact=_exact,
    row_length=lambda size, n: size // n,
    tangent_args=lambda params: _grad_args(params, False),
    dual_args=lambda params: _grad_args(params, True),
  )
)


# ----------------------------------------------------------------------------------------
# XLA backend.


def _xla_all_to_all(
  x: jax.Array, *, axes: tuple, compressor: Any, chunks: int, key: Any
) -> jax.Array:

  def one(xs: jax.Array, i: int) -> jax.Array:
    if compressor is None:
      return lax.all_to_all(xs, axes, 0, 0, tiled=True)
    return _joint([(xs, compressor)], axes, rank_key(key, axes, i))[0]

  return L.chunked(one, x, chunks)


def _joint(pairs: list[tuple[jax.Array, Any]], axes: tuple, key: Any = None) -> list:
  """The compressed exchange of several destination-row arrays, each with its own codec,
  their payloads side by side in one all-to-all (``Rows.joint``; one array: a slice of
  the xla backend)."""
  bufs = [encode_rows(c, xs, key=key) for xs, c in pairs]
  got = side_by_side(bufs, lambda b: lax.all_to_all(b, axes, 0, 0, tiled=True))
  return [decode_rows(c, g, xs.shape[-1], xs.dtype) for (xs, c), g in zip(pairs, got)]


_backend.register("xla", "all_to_all", _xla_all_to_all)

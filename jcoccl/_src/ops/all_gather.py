"""Compressed all_gather: encode the local shard once, gather the payloads, decode once."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jcoccl._src.base.axes import group_size, rank_key
from jcoccl._src.base.lax_errors import lax_errors
from jcoccl._src.compressors import layout as L
from jcoccl._src.compressors.compressor_args import SAME, canonical_args, is_lone_array
from jcoccl._src.compressors.payloads import (
  decode_rows,
  encode_rows,
  gather_decode,
  gather_method,
  gather_payloads,
  side_by_side,
)
from jcoccl._src.compressors.rows import Rows
from jcoccl._src.native import _backend
from jcoccl._src.ops import primitives as P


def all_gather(
  x: Any,
  axis_name: Any,
  *,
  axis: int = 0,
  tiled: bool = False,
  compressor: Any = None,
  backend: str = "auto",
  chunks: int = 1,
  min_bytes: int | None = None,
  grad_compressor: Any = SAME,
  key: Any = None,
  to: str = "varying",
  axis_index_groups: Any = None,
) -> Any:
  """Gathers ``x`` from every rank of ``axis_name``, as ``jax.lax.all_gather``.

  Each rank encodes its shard once, the uint8 payloads are gathered with
  ``lax.all_gather``, and every rank decodes all of them (one quantization per element).
  The transpose (reverse-mode AD) is a compressed :func:`jcoccl.reduce_scatter` with
  ``grad_compressor``.

  Args:
    x: array or pytree of arrays (local shard inside ``jax.shard_map``).
    axis_name: mesh axis name or tuple of names.
    axis: where the gathered axis goes (as lax.all_gather).
    tiled: concatenate along ``axis`` instead of stacking a new axis.
    compressor: Compressor, spec string, or None (exact: calls lax.all_gather).
    backend: "auto" (the fused engine where :func:`jcoccl.init` made it able to run this
      call, else "xla"), "xla" or "fused" (ValueError saying why when it cannot).
    chunks: split the message into this many independently processed slices (cut at
      granule boundaries: the same bits as chunks=1). Values above the number of granules
      the message holds are clamped to it; more than 64 slices raises ValueError.
    min_bytes: leaves smaller than this (bytes) go uncompressed; None = the default
      (``jcoccl.set_config_defaults(min_bytes=...)``, 4 MiB).
    grad_compressor: compressor of the backward reduce_scatter; default: ``compressor``.
    key: PRNG key for stochastic-rounding compressors; leaf i of several rounds with
      ``jax.random.fold_in(key, i)``, so leaves round independently; under jax.grad or
      jax.jvp the derivative's collective rounds with the key folded once more.
    to: the result's type over ``axis_name``, as lax.all_gather's: "varying", or
      "invarying" (every rank decodes the same payloads in the same order, so the result
      is the same everywhere; its transpose takes this rank's block, no communication);
      "reduced" runs the exact lax.all_gather.
    axis_index_groups: as lax.all_gather's; given, the exact lax.all_gather runs (the
      compressed algorithms gather over whole mesh axes).

  Pytree leaves that are not float32/bfloat16/float16 (and leaves under ``min_bytes``) go
  exactly; a lone array of another dtype with a lossy compressor raises TypeError.

  Returns:
    The gathered array(s), shaped like ``lax.all_gather``'s.

  Example:
    >>> y = jcoccl.all_gather(x, "data", compressor="int8", min_bytes=0)  # doctest: +SKIP
  """
  axes, comp, gcomp = canonical_args(axis_name, compressor, grad_compressor, chunks, tiled)
  with lax_errors("all_gather", lax.all_gather, x, axis_name, axis=axis, tiled=tiled, to=to):
    if to not in TOS:
      raise ValueError(f"to must be one of {TOS}, got {to!r}")
  if axis_index_groups is not None or to == "reduced":
    return lax.all_gather(
      x, axes, axis_index_groups=axis_index_groups, axis=axis, tiled=tiled, to=to
    )
  return P.apply_tree(
    "all_gather",
    x,
    key,
    axes=axes,
    compressor=comp,
    grad_compressor=gcomp,
    backend=backend,
    chunks=chunks,
    min_bytes=min_bytes,
    strict=is_lone_array(x),
    axis=axis,
    tiled=tiled,
    to=to,
  )


TOS = ("varying", "invarying", "reduced")


def _check(
  x: jax.Array, n: int, axes: tuple, *, axis: Any, tiled: bool, to: str = "varying"
) -> dict:
  del n, axes
  out_ndim = x.ndim if tiled else x.ndim + 1
  if not isinstance(axis, int) or not -out_ndim <= axis < out_ndim:
    raise ValueError(f"axis must be an int in [{-out_ndim}, {out_ndim}), got {axis!r}")
  if tiled and x.ndim == 0:
    raise ValueError("tiled=True needs an input of rank >= 1 (x is a scalar)")
  return dict(axis=axis % out_ndim, tiled=tiled, to=to)


def _exact(x: jax.Array, axes: tuple, *, axis: int, tiled: bool, to: str) -> jax.Array:
  return lax.all_gather(x, axes, axis=axis, tiled=tiled, to=to)


def _out_shape(shape: tuple, params: dict) -> tuple:
  n, axis = group_size(params["axes"]), params["axis"]
  if params["tiled"]:
    return shape[:axis] + (n * shape[axis],) + shape[axis + 1 :]
  return shape[:axis] + (n,) + shape[axis:]


def _rows(
  x: jax.Array,
  key: Any,
  *,
  axes: tuple,
  axis: int,
  tiled: bool,
  compressor: Any,
  backend: str,
  batch: int,
  **_: Any,
) -> Rows | None:
  """The leaf as one row, gathered into one row per source rank (None: the exact
  lax.all_gather runs). to="invarying" lowers as "varying": the bytes are the same on
  every rank either way."""
  comp = P.load(compressor)
  if comp is None:
    return None
  n = group_size(axes)
  shape = x.shape[batch:]
  impl = _backend.implementation("all_gather", backend)

  def post(r: jax.Array) -> jax.Array:
    stacked = r.reshape((n,) + shape)  # [n, *shape], rank order
    return arrange(stacked, axis, tiled)

  return Rows(
    x,
    batch,
    L.flat_row,
    post,
    math.prod(shape),
    comp.granule,
    comp.granule,
    lambda r, k: impl(r, axes=axes, compressor=comp, chunks=k, key=key),
    codec=comp,
    joint=_joint_of(impl, axes),
  )


def _forward(x: jax.Array, key: Any, **params: Any) -> jax.Array:
  rows = _rows(x, key, **params)
  if rows is None:
    axis, p = params["axis"] + params["batch"], params
    return lax.all_gather(x, p["axes"], axis=axis, tiled=p["tiled"], to=p["to"])
  return rows.run(params["chunks"])


def arrange(stacked: jax.Array, axis: int, tiled: bool) -> jax.Array:
  """[n, *shape] in rank order -> lax.all_gather's layout for ``axis``/``tiled``."""
  moved = jnp.moveaxis(stacked, 0, axis)
  if not tiled:
    return moved
  shape = stacked.shape[1:]
  n = stacked.shape[0]
  return moved.reshape(shape[:axis] + (n * shape[axis],) + shape[axis + 1 :])


def _own_block(ct: jax.Array, params: dict) -> jax.Array:
  """This rank's block of an invariant cotangent (all_gather to="invarying")."""
  axes, axis = params["axes"], params["axis"]
  size = ct.shape[axis] // group_size(axes) if params["tiled"] else 1
  out = lax.dynamic_slice_in_dim(ct, lax.axis_index(axes) * size, size, axis)
  return out if params["tiled"] else jnp.squeeze(out, axis)


P.register(
  P.Op(
    "all_gather",
    out_shape=_out_shape,
    reduces=lambda params: params["to"] == "invarying",
    forward=_forward,
    rows=_rows,
    check=_check,
    exact=_exact,
    invariant_transpose=_own_block,
    tangent_args=lambda params: P.grad_args(
      params, tiled=params["tiled"], axis=params["axis"], to=params["to"]
    ),
    # The dual, reduce_scatter, scatters the dimension the gather stacked or tiled.
    dual_args=lambda params: P.grad_args(
      params, tiled=params["tiled"], scatter_dimension=params["axis"]
    ),
  )
)


# ----------------------------------------------------------------------------------------
# XLA backend.


def gather_rows(
  x: jax.Array, axes: tuple, compressor: Any, chunks: int, key: Any, invariant: bool = False
) -> jax.Array:
  """dtype[C] -> dtype[n, C] (row i = rank i's x); ``invariant`` makes the result
  device-invariant over ``axes`` (used inside all_reduce)."""
  to = "invarying" if invariant else "varying"

  def one(xs: jax.Array, i: int) -> jax.Array:
    if compressor is None:
      return lax.all_gather(xs, axes, axis=0, tiled=False, to=to)
    buf = encode_rows(compressor, xs[None], key=rank_key(key, axes, i))
    return gather_decode(
      compressor, buf[0], axes, xs.shape[-1], xs.dtype, sum_rows=False, invariant=invariant
    )

  return L.chunked(one, x, chunks)


def _xla_all_gather(
  x: jax.Array, *, axes: tuple, compressor: Any, chunks: int, key: Any
) -> jax.Array:
  return gather_rows(x, axes, compressor, chunks, key)


def _joint_of(impl: Any, axes: tuple) -> Any:
  """``Rows.joint`` of the xla backend with XLA's all-gather of payloads, else None."""
  if impl is not _xla_all_gather or gather_method() == "all_to_all":
    return None

  def joint(pairs: list[tuple[jax.Array, Any]]) -> list:
    bufs = [encode_rows(c, xs[None]) for xs, c in pairs]
    every = side_by_side(bufs, lambda b: gather_payloads(b[0], axes, invariant=False))
    return [decode_rows(c, e, xs.shape[-1], xs.dtype) for (xs, c), e in zip(pairs, every)]

  return joint


_backend.register("xla", "all_gather", _xla_all_gather)

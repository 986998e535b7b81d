"""Compressed all_to_all: encode each destination chunk once, exchange the uint8 payloads
with one lax.all_to_all, decode each received chunk once."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jcoccl._src import _backend
from jcoccl._src import _common as C


def all_to_all(x: Any, axis_name: Any, split_axis: int, concat_axis: int, *,
               tiled: bool = False, compressor: Any = None, backend: str = "auto",
               chunks: int = 1, min_bytes: int | None = None,
               grad_compressor: Any = C.SAME, key: Any = None) -> Any:
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
    key: PRNG key for stochastic-rounding compressors.

  Returns:
    Array(s) shaped like ``lax.all_to_all``'s output.

  Example:
    >>> y = jcoccl.all_to_all(x, "expert", 0, 0, tiled=True, compressor="fp8")  # doctest: +SKIP
  """
  axes, comp, gcomp = C.canonical_args(axis_name, compressor, grad_compressor, chunks, tiled)
  return jax.tree_util.tree_map(
      lambda leaf: a2a_leaf(leaf, axes, split_axis, concat_axis, tiled, comp, gcomp,
                            backend, chunks, min_bytes, key), x)


@dataclasses.dataclass(frozen=True)
class _Cfg:
  axes: tuple
  split_axis: int
  concat_axis: int
  tiled: bool
  compressor: Any
  grad_compressor: Any
  backend: str
  chunks: int
  min_bytes: Any
  vma: frozenset = frozenset()


def _check_axes(shape: tuple, split_axis: Any, concat_axis: Any, tiled: bool,
                n: int) -> tuple[int, int]:
  nd = len(shape)
  if nd == 0:
    raise ValueError("all_to_all needs an input of rank >= 1 (x is a scalar)")
  if not isinstance(split_axis, int) or not -nd <= split_axis < nd:
    raise ValueError(f"split_axis must be an int in [{-nd}, {nd}), got {split_axis!r}")
  out_nd = nd if tiled else nd  # non-tiled removes one axis and inserts one
  if not isinstance(concat_axis, int) or not -out_nd <= concat_axis < out_nd:
    raise ValueError(f"concat_axis must be an int in [{-out_nd}, {out_nd}), got "
                     f"{concat_axis!r}")
  split_axis %= nd
  concat_axis %= out_nd
  if tiled and shape[split_axis] % n:
    raise ValueError(f"split_axis {split_axis} has size {shape[split_axis]}, not divisible "
                     f"by the group size {n} (tiled=True)")
  if not tiled and shape[split_axis] != n:
    raise ValueError(f"split_axis {split_axis} has size {shape[split_axis]}, but "
                     f"tiled=False needs it to equal the group size {n}")
  return split_axis, concat_axis


def a2a_leaf(x: jax.Array, axes: tuple, split_axis: Any, concat_axis: Any, tiled: bool,
             comp: Any, gcomp: Any, backend: str, chunks: int, min_bytes: Any,
             key: Any) -> jax.Array:
  """all_to_all of one array (arguments already canonicalised)."""
  x = jnp.asarray(x)
  n = C.group_size(axes)
  sa, ca = _check_axes(x.shape, split_axis, concat_axis, tiled, n)
  c = C.effective_compressor(x, comp, min_bytes)
  gc = C.grad_for(x, gcomp)
  _backend.validate("all_to_all", backend)
  if c is None and gc is None:
    return lax.all_to_all(x, axes, sa, ca, tiled=tiled)
  x = C.ensure_varying(x, axes)
  cfg = _Cfg(axes, sa, ca, tiled, c, gc, backend, chunks, min_bytes, C.vma_of(x))
  return _a2a_vjp(cfg, x, key)


def _a2a_fwd_impl(cfg: _Cfg, x: jax.Array, key: Any) -> jax.Array:
  if cfg.compressor is None:
    return lax.all_to_all(x, cfg.axes, cfg.split_axis, cfg.concat_axis, tiled=cfg.tiled)
  n = C.group_size(cfg.axes)
  sa, ca = cfg.split_axis, cfg.concat_axis
  moved = jnp.moveaxis(x, sa, 0)
  block = (moved.shape[0] // n,) + moved.shape[1:]
  rows = moved.reshape(n, -1)
  c = rows.shape[1]
  g = cfg.compressor.granule
  k = C.slices(cfg.chunks, c, g)
  rows = C.pad_last(rows, C.padded_len(c, k * g))
  _, impl = _backend.resolve("all_to_all", cfg.backend, cfg.axes, compressor=cfg.compressor,
                             dtype=x.dtype)
  got = impl(rows, axes=cfg.axes, compressor=cfg.compressor, chunks=k, key=key)
  blocks = jnp.moveaxis(got[:, :c].reshape((n,) + block), 1, sa + 1)  # [n, *x block]
  if not cfg.tiled:
    return jnp.moveaxis(jnp.squeeze(blocks, sa + 1), 0, ca)
  shape = blocks.shape[1:]
  return jnp.moveaxis(blocks, 0, ca).reshape(shape[:ca] + (n * shape[ca],) + shape[ca + 1:])


def _a2a_transpose(cfg: _Cfg, ct: jax.Array) -> jax.Array:
  return a2a_leaf(ct, cfg.axes, cfg.concat_axis, cfg.split_axis, cfg.tiled,
                  cfg.grad_compressor, cfg.grad_compressor, cfg.backend, cfg.chunks,
                  cfg.min_bytes, None)


_a2a_vjp = C.linear_collective(_a2a_fwd_impl, _a2a_transpose)


# ----------------------------------------------------------------------------------------
# XLA backend.

def _xla_all_to_all(x: jax.Array, *, axes: tuple, compressor: Any, chunks: int,
                    key: Any) -> jax.Array:

  def one(xs: jax.Array, i: int) -> jax.Array:
    if compressor is None:
      return lax.all_to_all(xs, axes, 0, 0, tiled=True)
    buf = C.encode_rows(compressor, xs, key=C.rank_key(key, axes, i))
    got = lax.all_to_all(buf, axes, 0, 0, tiled=True)
    return C.decode_rows(compressor, got, xs.shape[-1], xs.dtype)

  return C.chunked(one, x, chunks)


_backend.register("xla", "all_to_all", _xla_all_to_all)

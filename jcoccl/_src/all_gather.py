"""Compressed all_gather: encode the local shard once, gather the payloads, decode once."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jcoccl._src import _backend
from jcoccl._src import _common as C

SAME = C.SAME


def all_gather(x: Any, axis_name: Any, *, axis: int = 0, tiled: bool = False,
               compressor: Any = None, backend: str = "auto", chunks: int = 1,
               min_bytes: int | None = None, grad_compressor: Any = SAME,
               key: Any = None) -> Any:
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
      (:func:`jcoccl.set_default_min_bytes`, 4 MiB).
    grad_compressor: compressor of the backward reduce_scatter; default: ``compressor``.
    key: PRNG key for stochastic-rounding compressors.

  Returns:
    The gathered array(s), shaped like ``lax.all_gather``'s.

  Example:
    >>> y = jcoccl.all_gather(x, "data", compressor="int8", min_bytes=0)  # doctest: +SKIP
  """
  axes, comp, gcomp = C.canonical_args(axis_name, compressor, grad_compressor, chunks, tiled)
  return jax.tree_util.tree_map(
      lambda leaf: gather_leaf(leaf, axes, axis, tiled, comp, gcomp, backend, chunks,
                               min_bytes, key), x)


@dataclasses.dataclass(frozen=True)
class _Cfg:
  axes: tuple
  axis: int
  tiled: bool
  compressor: Any
  grad_compressor: Any
  backend: str
  chunks: int
  min_bytes: Any
  vma: frozenset = frozenset()


def gather_leaf(x: jax.Array, axes: tuple, axis: int, tiled: bool, comp: Any, gcomp: Any,
                backend: str, chunks: int, min_bytes: Any, key: Any) -> jax.Array:
  """all_gather of one array (arguments already canonicalised)."""
  x = jnp.asarray(x)
  C.group_size(axes)  # validates axis names
  out_ndim = x.ndim if tiled else x.ndim + 1
  if not isinstance(axis, int) or not -out_ndim <= axis < out_ndim:
    raise ValueError(f"axis must be an int in [{-out_ndim}, {out_ndim}), got {axis!r}")
  axis = axis % out_ndim
  if tiled and x.ndim == 0:
    raise ValueError("tiled=True needs an input of rank >= 1 (x is a scalar)")
  c = C.effective_compressor(x, comp, min_bytes)
  gc = C.grad_for(x, gcomp)
  _backend.validate("all_gather", backend)
  if c is None and gc is None:
    return lax.all_gather(x, axes, axis=axis, tiled=tiled)
  x = C.ensure_varying(x, axes)
  cfg = _Cfg(axes, axis, tiled, c, gc, backend, chunks, min_bytes, C.vma_of(x))
  return _gather_vjp(cfg, x, key)


def _gather_fwd_impl(cfg: _Cfg, x: jax.Array, key: Any) -> jax.Array:
  if cfg.compressor is None:
    return lax.all_gather(x, cfg.axes, axis=cfg.axis, tiled=cfg.tiled)
  n = C.group_size(cfg.axes)
  m = x.size
  g = cfg.compressor.granule
  k = C.slices(cfg.chunks, m, g)
  flat = C.pad_last(x.reshape(-1), C.padded_len(m, k * g))
  _, impl = _backend.resolve("all_gather", cfg.backend, cfg.axes, compressor=cfg.compressor,
                             dtype=x.dtype)
  rows = impl(flat, axes=cfg.axes, compressor=cfg.compressor, chunks=k, key=key)
  stacked = rows[:, :m].reshape((n,) + x.shape)  # [n, *x.shape], rank order
  return arrange(stacked, cfg.axis, cfg.tiled)


def arrange(stacked: jax.Array, axis: int, tiled: bool) -> jax.Array:
  """[n, *shape] in rank order -> lax.all_gather's layout for ``axis``/``tiled``."""
  moved = jnp.moveaxis(stacked, 0, axis)
  if not tiled:
    return moved
  shape = stacked.shape[1:]
  n = stacked.shape[0]
  return moved.reshape(shape[:axis] + (n * shape[axis],) + shape[axis + 1:])


def _gather_transpose(cfg: _Cfg, ct: jax.Array) -> jax.Array:
  from jcoccl._src import reduce_scatter as rs
  return rs.scatter_leaf(ct, cfg.axes, cfg.axis, cfg.tiled, cfg.grad_compressor,
                         cfg.grad_compressor, cfg.backend, cfg.chunks, cfg.min_bytes, None)


_gather_vjp = C.linear_collective(_gather_fwd_impl, _gather_transpose)


# ----------------------------------------------------------------------------------------
# XLA backend.

def gather_rows(x: jax.Array, axes: tuple, compressor: Any, chunks: int, key: Any,
                invariant: bool = False) -> jax.Array:
  """dtype[C] -> dtype[n, C] (row i = rank i's x); ``invariant`` makes the result
  device-invariant over ``axes`` (used inside all_reduce)."""
  to = "invarying" if invariant else "varying"

  def one(xs: jax.Array, i: int) -> jax.Array:
    if compressor is None:
      return lax.all_gather(xs, axes, axis=0, tiled=False, to=to)
    buf = C.encode_rows(compressor, xs[None], key=C.rank_key(key, axes, i))
    return C.gather_decode(compressor, buf[0], axes, xs.shape[-1], xs.dtype, sum_rows=False,
                           invariant=invariant)

  return C.chunked(one, x, chunks)


def _xla_all_gather(x: jax.Array, *, axes: tuple, compressor: Any, chunks: int,
                    key: Any) -> jax.Array:
  return gather_rows(x, axes, compressor, chunks, key)


_backend.register("xla", "all_gather", _xla_all_gather)

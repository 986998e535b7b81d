"""Compressed reduce_scatter ("one_shot"): encode each destination chunk once, exchange the
payloads with one all_to_all, decode and sum in float32 in source-rank order."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jcoccl._src import _backend
from jcoccl._src import _common as C


def reduce_scatter(x: Any, axis_name: Any, *, scatter_dimension: int = 0,
                   tiled: bool = False, compressor: Any = None, algorithm: str = "auto",
                   backend: str = "auto", chunks: int = 1, min_bytes: int | None = None,
                   grad_compressor: Any = C.SAME, key: Any = None) -> Any:
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
    key: PRNG key for stochastic-rounding compressors.

  Returns:
    This rank's reduced shard(s), shaped like ``lax.psum_scatter``'s.

  Example:
    >>> y = jcoccl.reduce_scatter(g, "data", tiled=True, compressor="int4")  # doctest: +SKIP
  """
  if algorithm not in ("auto", "one_shot"):
    raise ValueError(f"algorithm must be 'auto' or 'one_shot' for reduce_scatter, "
                     f"got {algorithm!r}")
  axes, comp, gcomp = C.canonical_args(axis_name, compressor, grad_compressor, chunks, tiled)
  return jax.tree_util.tree_map(
      lambda leaf: scatter_leaf(leaf, axes, scatter_dimension, tiled, comp, gcomp, backend,
                                chunks, min_bytes, key), x)


@dataclasses.dataclass(frozen=True)
class _Cfg:
  axes: tuple
  dim: int
  tiled: bool
  compressor: Any
  grad_compressor: Any
  backend: str
  chunks: int
  min_bytes: Any
  vma: frozenset = frozenset()


def check_scatter(shape: tuple, dim: Any, tiled: bool, n: int) -> int:
  """Validates scatter_dimension against lax.psum_scatter's rules; returns it normalised."""
  if not shape:
    raise ValueError("reduce_scatter needs an input of rank >= 1 (x is a scalar)")
  if not isinstance(dim, int) or not -len(shape) <= dim < len(shape):
    raise ValueError(
        f"scatter_dimension must be an int in [{-len(shape)}, {len(shape)}), got {dim!r}")
  dim %= len(shape)
  if tiled and shape[dim] % n:
    raise ValueError(
        f"scatter_dimension {dim} has size {shape[dim]}, which is not divisible by the "
        f"group size {n} (tiled=True needs a multiple of it)")
  if not tiled and shape[dim] != n:
    raise ValueError(
        f"scatter_dimension {dim} has size {shape[dim]}, but tiled=False needs it to equal "
        f"the group size {n} (or pass tiled=True)")
  return dim


def scatter_leaf(x: jax.Array, axes: tuple, dim: int, tiled: bool, comp: Any, gcomp: Any,
                 backend: str, chunks: int, min_bytes: Any, key: Any) -> jax.Array:
  """reduce_scatter of one array (arguments already canonicalised)."""
  x = jnp.asarray(x)
  n = C.group_size(axes)
  dim = check_scatter(x.shape, dim, tiled, n)
  c = C.effective_compressor(x, comp, min_bytes)
  gc = C.grad_for(x, gcomp)
  _backend.validate("reduce_scatter", backend)
  if c is None and gc is None:
    return lax.psum_scatter(x, axes, scatter_dimension=dim, tiled=tiled)
  x = C.ensure_varying(x, axes)
  cfg = _Cfg(axes, dim, tiled, c, gc, backend, chunks, min_bytes, C.vma_of(x))
  return _scatter_vjp(cfg, x, key)


def to_rows(x: jax.Array, dim: int, n: int) -> tuple[jax.Array, tuple]:
  """[.., S, ..] -> ([n, c] destination rows, the shape of one row's block, moved layout)."""
  moved = jnp.moveaxis(x, dim, 0)
  block = (moved.shape[0] // n,) + moved.shape[1:]
  return moved.reshape(n, -1), block


def from_block(flat: jax.Array, block: tuple, dim: int, tiled: bool) -> jax.Array:
  """One destination block (flat, moved layout) -> psum_scatter's output layout."""
  out = jnp.moveaxis(flat.reshape(block), 0, dim)
  return out if tiled else jnp.squeeze(out, dim)


def _scatter_fwd_impl(cfg: _Cfg, x: jax.Array, key: Any) -> jax.Array:
  if cfg.compressor is None:
    return lax.psum_scatter(x, cfg.axes, scatter_dimension=cfg.dim, tiled=cfg.tiled)
  n = C.group_size(cfg.axes)
  rows, block = to_rows(x, cfg.dim, n)
  c = rows.shape[1]
  g = cfg.compressor.granule
  k = C.slices(cfg.chunks, c, g)
  rows = C.pad_last(rows, C.padded_len(c, k * g))
  _, impl = _backend.resolve("reduce_scatter", cfg.backend, cfg.axes,
                             compressor=cfg.compressor, dtype=x.dtype)
  out = impl(rows, axes=cfg.axes, compressor=cfg.compressor, chunks=k, key=key)
  return from_block(out[:c], block, cfg.dim, cfg.tiled)


def _scatter_transpose(cfg: _Cfg, ct: jax.Array) -> jax.Array:
  from jcoccl._src import all_gather as ag
  return ag.gather_leaf(ct, cfg.axes, cfg.dim, cfg.tiled, cfg.grad_compressor,
                        cfg.grad_compressor, cfg.backend, cfg.chunks, cfg.min_bytes, None)


_scatter_vjp = C.linear_collective(_scatter_fwd_impl, _scatter_transpose)


# ----------------------------------------------------------------------------------------
# XLA backend.

def scatter_rows(x: jax.Array, axes: tuple, compressor: Any, chunks: int,
                 key: Any) -> jax.Array:
  """dtype[n, C] (row j for rank j) -> dtype[C], the sum over source ranks."""

  def one(xs: jax.Array, i: int) -> jax.Array:
    if compressor is None:
      return lax.psum_scatter(xs, axes, scatter_dimension=0, tiled=False)
    buf = C.encode_rows(compressor, xs, key=C.rank_key(key, axes, i))
    got = lax.all_to_all(buf, axes, 0, 0, tiled=True)  # row i came from rank i
    return C.decode_sum(compressor, got, xs.shape[-1], xs.dtype)

  return C.chunked(one, x, chunks)


def _xla_reduce_scatter(x: jax.Array, *, axes: tuple, compressor: Any, chunks: int,
                        key: Any) -> jax.Array:
  return scatter_rows(x, axes, compressor, chunks, key)


_backend.register("xla", "reduce_scatter", _xla_reduce_scatter)

"""Compressed ppermute (send/recv): encode once, lax.ppermute the payload, decode once."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jcoccl._src import _backend
from jcoccl._src import _common as C


def ppermute(x: Any, axis_name: Any, perm: Any, *, compressor: Any = None,
             backend: str = "auto", chunks: int = 1, min_bytes: int | None = None,
             grad_compressor: Any = C.SAME, key: Any = None) -> Any:
  """Sends ``x`` from rank ``src`` to rank ``dst`` for each pair of ``perm``, as
  ``jax.lax.ppermute``; ranks that receive nothing get zeros.

  The payload is encoded once and decoded once at the destination. The transpose is the
  inverse permutation with ``grad_compressor``.

  Args:
    x: array or pytree of arrays.
    axis_name: mesh axis name or tuple of names (ranks are linear indices over them).
    perm: sequence of (source, destination) pairs; no source or destination twice, every
      index in [0, n).
    compressor: Compressor, spec string, or None (exact: calls lax.ppermute).
    backend: "auto" (the fused engine where :func:`jcoccl.init` made it able to run this
      call, else "xla"), "xla" or "fused" (ValueError saying why when it cannot).
    chunks: split the message into this many independently processed slices (cut at
      granule boundaries: the same bits as chunks=1). Values above the number of granules
      the message holds are clamped to it; more than 64 slices raises ValueError.
    min_bytes: leaves smaller than this (bytes) go uncompressed; None = the default.
    grad_compressor: compressor of the backward ppermute; default: ``compressor``.
    key: PRNG key for stochastic-rounding compressors.

  Returns:
    The received array(s), shaped like ``x``.

  Example:
    >>> y = jcoccl.ppermute(x, "pipe", [(0, 1), (1, 2)], compressor="int8")  # doctest: +SKIP
  """
  axes, comp, gcomp = C.canonical_args(axis_name, compressor, grad_compressor, chunks)
  n = C.group_size(axes)
  perm = check_perm(perm, n)
  return jax.tree_util.tree_map(
      lambda leaf: permute_leaf(leaf, axes, perm, comp, gcomp, backend, chunks, min_bytes,
                                key), x)


def check_perm(perm: Any, n: int) -> tuple:
  """``perm`` as a tuple of (src, dst) int pairs; ValueError on duplicates/out of range."""
  try:
    pairs = tuple((int(s), int(d)) for s, d in perm)
  except (TypeError, ValueError):
    raise ValueError(f"perm must be a sequence of (source, destination) int pairs, got "
                     f"{perm!r}") from None
  for s, d in pairs:
    if not (0 <= s < n and 0 <= d < n):
      raise ValueError(f"perm pair {(s, d)} is out of range: indices must be in [0, {n}) "
                       f"for a group of size {n}")
  srcs, dsts = [s for s, _ in pairs], [d for _, d in pairs]
  if len(set(srcs)) != len(srcs):
    raise ValueError(f"perm has a duplicate source: {perm!r}")
  if len(set(dsts)) != len(dsts):
    raise ValueError(f"perm has a duplicate destination: {perm!r}")
  return pairs


@dataclasses.dataclass(frozen=True)
class _Cfg:
  axes: tuple
  perm: tuple
  compressor: Any
  grad_compressor: Any
  backend: str
  chunks: int
  min_bytes: Any
  vma: frozenset = frozenset()


def permute_leaf(x: jax.Array, axes: tuple, perm: tuple, comp: Any, gcomp: Any,
                 backend: str, chunks: int, min_bytes: Any, key: Any) -> jax.Array:
  """ppermute of one array (arguments already canonicalised)."""
  x = jnp.asarray(x)
  c = C.effective_compressor(x, comp, min_bytes)
  gc = C.grad_for(x, gcomp)
  _backend.validate("ppermute", backend)
  if c is None and gc is None:
    return lax.ppermute(x, axes, perm)
  x = C.ensure_varying(x, axes)
  cfg = _Cfg(axes, perm, c, gc, backend, chunks, min_bytes, C.vma_of(x))
  return _permute_vjp(cfg, x, key)


def _permute_fwd_impl(cfg: _Cfg, x: jax.Array, key: Any) -> jax.Array:
  if cfg.compressor is None:
    return lax.ppermute(x, cfg.axes, cfg.perm)
  m = x.size
  g = cfg.compressor.granule
  k = C.slices(cfg.chunks, m, g)
  flat = C.pad_last(x.reshape(-1), C.padded_len(m, k * g))
  _, impl = _backend.resolve("ppermute", cfg.backend, cfg.axes, compressor=cfg.compressor,
                             dtype=x.dtype)
  got = impl(flat, axes=cfg.axes, perm=cfg.perm, compressor=cfg.compressor, chunks=k,
             key=key)
  return got[:m].reshape(x.shape)


def _permute_transpose(cfg: _Cfg, ct: jax.Array) -> jax.Array:
  inverse = tuple((d, s) for s, d in cfg.perm)
  return permute_leaf(ct, cfg.axes, inverse, cfg.grad_compressor, cfg.grad_compressor,
                      cfg.backend, cfg.chunks, cfg.min_bytes, None)


_permute_vjp = C.linear_collective(_permute_fwd_impl, _permute_transpose)


# ----------------------------------------------------------------------------------------
# XLA backend.

def _xla_ppermute(x: jax.Array, *, axes: tuple, perm: tuple, compressor: Any, chunks: int,
                  key: Any) -> jax.Array:
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
    return jnp.where(receives, C.decode_rows(compressor, got, xs.shape[-1], xs.dtype)[0],
                     jnp.zeros_like(xs))

  return C.chunked(one, x, chunks)


_backend.register("xla", "ppermute", _xla_ppermute)

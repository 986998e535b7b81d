"""The fused backend's collectives: what each op lays out and asks the engine for.

Each implementation (signatures: jcoccl/_src/native/_backend.py) takes the rows of the "xla"
backend, puts their slices first (:func:`jcoccl._src.compressors.layout.slice_major`, the engine's
``[k, ...]`` layout), makes one engine call through ``call`` (the communicators'
:func:`jcoccl._src.engine.fused_comms.collective_call`) and puts the result back in row order.
Taking ``call`` as an argument keeps this module free of the communicator state.

Example:
  >>> impls = implementations(collective_call)  # doctest: +SKIP
  >>> sorted(impls)                             # doctest: +SKIP
  ['all_gather', 'all_reduce', 'all_to_all', 'ppermute', 'reduce_scatter']
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jcoccl._src.base.axes import group_size
from jcoccl._src.compressors import layout as L

Call = Callable[..., jax.Array]  # the engine call over a collective's communicator

# Each engine algorithm's input and output as a [k, ...] array of k slices, for rows of m
# elements over n ranks: "rows" is [k, m], "ranks" is [k, n, m] (m per destination rank,
# or per source rank on the way out). The engine sizes its buffers from k, n and m alike.
_SHAPES = {
  "one_shot": ("rows", "rows"),
  "two_shot": ("ranks", "ranks"),
  "hierarchical": ("ranks", "ranks"),
  "reduce_scatter": ("ranks", "rows"),
  "all_gather": ("rows", "ranks"),
  "all_to_all": ("ranks", "ranks"),
  "ppermute": ("rows", "rows"),
}
ALGORITHMS = tuple(_SHAPES)


def engine_shapes(algo: str, k: int, n: int, m: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """(input shape, output shape) of one engine call of ``algo``: ``k`` slices of rows of
  ``m`` elements over ``n`` ranks (two_shot and hierarchical: ``m`` per rank; ``n`` the
  inner ranks for hierarchical).

  Example:
    >>> engine_shapes("reduce_scatter", 2, 4, 8), engine_shapes("all_gather", 1, 4, 8)
    (((2, 4, 8), (2, 8)), ((1, 8), (1, 4, 8)))
  """
  if algo not in _SHAPES:
    raise ValueError(f"algo must be one of {ALGORITHMS}, got {algo!r}")
  dims = {"rows": (k, m), "ranks": (k, n, m)}
  ins, outs = _SHAPES[algo]
  return dims[ins], dims[outs]


def _out(algo: str, xs: jax.Array, n: int = 1) -> tuple[int, ...]:
  """The output shape of ``algo`` on the slice-major input ``xs`` ([k, m] or [k, n, m])."""
  return engine_shapes(algo, xs.shape[0], n, xs.shape[-1])[1]


def _all_reduce(
  call: Call, x: jax.Array, *, axes: tuple, compressor: Any, algorithm: str, chunks: int, key: Any
) -> jax.Array:
  del key  # round-to-nearest only (checked in fused_ffi.codec_attrs)
  axes = tuple(axes)
  k = chunks
  xs = L.slice_major(x, k)  # [k, w]
  w = xs.shape[-1]
  if algorithm == "one_shot":
    out = call(
      "all_reduce", "one_shot", xs, _out("one_shot", xs), axes, compressor, k, w, reduces=True
    )
  elif algorithm == "two_shot":
    n = group_size(axes)
    xs = L.rank_rows(xs, n)  # [k, n, w / n]
    m = xs.shape[-1]
    out = call(
      "all_reduce", "two_shot", xs, _out("two_shot", xs, n), axes, compressor, k, m, reduces=True
    )
  elif algorithm == "hierarchical":
    if len(axes) < 2:
      raise ValueError("algorithm='hierarchical' needs a tuple of at least two axes")
    outer, inner = compressor
    n = group_size(axes[-1:])
    xs = L.rank_rows(xs, n)  # [k, n_inner, w / n_inner]
    m = xs.shape[-1]
    shape = _out("hierarchical", xs, n)
    out = call(
      "all_reduce", "hierarchical", xs, shape, axes, inner, k, m, reduces=True, outer=outer
    )
  else:
    raise ValueError(f"algorithm must be one_shot, two_shot or hierarchical, got {algorithm!r}")
  return L.from_slice_major(out.reshape(k, -1))


def _reduce_scatter(
  call: Call, x: jax.Array, *, axes: tuple, compressor: Any, chunks: int, key: Any
) -> jax.Array:
  del key
  k = chunks
  xs = L.slice_major(x, k)  # [k, n, m]
  m = xs.shape[-1]
  shape = _out("reduce_scatter", xs)
  out = call(
    "reduce_scatter", "reduce_scatter", xs, shape, tuple(axes), compressor, k, m, reduces=False
  )
  return L.from_slice_major(out)


def _all_gather(
  call: Call, x: jax.Array, *, axes: tuple, compressor: Any, chunks: int, key: Any
) -> jax.Array:
  del key
  axes = tuple(axes)
  n = group_size(axes)
  k = chunks
  xs = L.slice_major(x, k)  # [k, m]
  m = xs.shape[-1]
  shape = _out("all_gather", xs, n)
  out = call("all_gather", "all_gather", xs, shape, axes, compressor, k, m, reduces=False)
  return L.from_slice_major(out)  # [n, k * m]


def _all_to_all(
  call: Call, x: jax.Array, *, axes: tuple, compressor: Any, chunks: int, key: Any
) -> jax.Array:
  del key
  k = chunks
  xs = L.slice_major(x, k)  # [k, n, m]
  n, m = xs.shape[1:]
  shape = _out("all_to_all", xs, n)
  out = call("all_to_all", "all_to_all", xs, shape, tuple(axes), compressor, k, m, reduces=False)
  return L.from_slice_major(out)


def _ppermute(
  call: Call,
  x: jax.Array,
  *,
  axes: tuple,
  perm: Sequence[tuple[int, int]],
  compressor: Any,
  chunks: int,
  key: Any,
) -> jax.Array:
  del key
  axes = tuple(axes)
  n = group_size(axes)
  dst = np.full((n,), -1, np.int32)  # the engine's perm: destination per rank, or -1
  for s, d in perm:
    dst[int(s)] = int(d)
  k = chunks
  xs = L.slice_major(x, k)  # [k, m]
  m = xs.shape[-1]
  shape = _out("ppermute", xs)
  out = call("ppermute", "ppermute", xs, shape, axes, compressor, k, m, reduces=False, perm=dst)
  return L.from_slice_major(out)


def implementations(call: Call) -> dict[str, Call]:
  """The fused backend's implementation of each op, making its engine call with ``call``.

  Args:
    call: ``call(op, algo, x, out_shape, axes, compressor, k, m, *, reduces, outer=None,
      perm=None)``, e.g. :func:`jcoccl._src.engine.fused_comms.collective_call`.

  Returns:
    {op name: implementation} for every op of :data:`jcoccl._src.native._backend.OPS`.
  """
  ops: dict[str, Callable[..., Any]] = {
    "all_reduce": _all_reduce,
    "reduce_scatter": _reduce_scatter,
    "all_gather": _all_gather,
    "all_to_all": _all_to_all,
    "ppermute": _ppermute,
  }
  return {name: functools.partial(fn, call) for name, fn in ops.items()}

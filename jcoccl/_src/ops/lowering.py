"""Lowering one ``jcoccl_<op>`` equation: its leaves bucketed by wire format, the leaves
of a bucket packed into one row layout and sent as ONE encode -> collective -> decode
chain (:func:`jcoccl._src.compressors.rows.run_packed`), with the same bits per leaf as alone.

Example:
  >>> packable(jnp.zeros(1000)), packable(jnp.zeros(1 << 18))
  (True, False)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jcoccl._src.compressors.rows import Rows, run_packed
from jcoccl._src.native import _backend
from jcoccl._src.ops.op_spec import Op
from jcoccl._src.ops.params import load, spec_of


def blockwise(c: Any) -> bool:
  """Whether ``c`` (a compressor, None, or a per-level tuple) declares itself block-wise
  (``Compressor.blockwise``; a wrapper: its inner codec too), so that its leaves may be
  packed: packing whole blocks end to end leaves every block's bits unchanged. A custom or
  plugin codec promises only that row lengths are multiples of its granule (it may read
  the whole row), so unless it declares so its leaves go alone.

  Example:
    >>> blockwise(load("hadamard(int4)")), blockwise(None)
    (True, True)
  """
  if c is None:
    return True
  if isinstance(c, tuple):
    return all(blockwise(v) for v in c)
  return bool(getattr(c, "blockwise", False)) and blockwise(getattr(c, "inner", None))


# A leaf of this many bytes or more goes alone, as DDP's bucket cap leaves a large gradient
# in a bucket of its own: packing copies a leaf into the row and its result (and residual)
# back out, two or three passes over its bytes, which for large leaves cost more than the
# chain they save (XLA:CPU, GPT 'wide' train step of benchmarks/train_e2e.py, 20 gradient
# leaves of 4 KiB to 16 MiB: all packed, 1.5x the step time of per-leaf chains).
PACK_MAX_BYTES = 1 << 20


def packable(x: jax.Array) -> bool:
  """Whether leaf ``x`` is small enough to share a packed chain (:data:`PACK_MAX_BYTES`).

  Example:
    >>> packable(jnp.zeros(1000)), packable(jnp.zeros(1 << 18))
    (True, False)
  """
  return math.prod(jnp.shape(x)) * jnp.dtype(x.dtype).itemsize < PACK_MAX_BYTES


def bucket_key(x: jax.Array, params: dict, rows: Any) -> tuple:
  """What two leaves of one equation must share to travel as one chain: the group (with
  the op, it fixes the rows' leading shape), the codec, the backend, the slices, the
  dtype, and the op's own wire parameters (all_reduce's algorithm, ppermute's pairs)."""
  return (
    params["axes"],
    params["compressor"],
    params["backend"],
    params["chunks"],
    jnp.dtype(x.dtype).name,
    rows.unit,
    rows.block,
    rows.wire,
  )


def _at_lowering(o: Op, x: jax.Array, lp: dict) -> dict:
  """Leaf parameters with auto's "fused" checked against the lowering's concrete mesh
  (:func:`jcoccl._src.native._backend.at_lowering`)."""
  if lp.get("backend") != "fused":
    return lp
  algo = {"algorithm": lp["algorithm"]} if "algorithm" in lp else {}
  c = load(lp["compressor"])
  return _backend.at_lowering(o.name, lp, compressor=c, dtype=x.dtype, **algo)


def _packs(o: Op, x: jax.Array, key: Any, n: int, lp: dict) -> bool:
  """Whether leaf ``x`` (one of ``n``) may share a packed chain (see :func:`lower_leaves`)."""
  return (
    o.rows is not None
    and key is None
    and n > 1
    and packable(x)
    and blockwise(load(lp["compressor"]))
  )


def fitted(o: Op, xs: Sequence[jax.Array], key: Any, lps: Sequence[dict]) -> list[dict]:
  """The leaves' parameters with each chain's codec fitted to its longest row
  (``Compressor.fit``): a chain whose every row is shorter than one codec block (a
  LayerNorm vector alone under int8's 256, or a bucket of them) sends short blocks with the
  same bits instead of zero-padded long ones. A chain that also holds a longer leaf keeps
  its block: fitting the short leaves apart would cost a chain of their own per step, whose
  latency outweighs the padding it saves (a few hundred bytes per leaf).

  Args:
    o: the op.
    xs: the leaves (with their vmap batch axes).
    key: the call's PRNG key, or None.
    lps: the leaves' parameters.

  Returns:
    ``lps``, with a copy naming the fitted codec for the leaves of each fitted chain (an
    example: ``Compressor.fit``).
  """
  chains: dict[tuple, list[int]] = {}
  length: dict[int, int] = {}
  for i, (x, lp) in enumerate(zip(xs, lps)):
    c = load(lp["compressor"])
    fit = getattr(c, "fit", None)  # None: the exact path or per-level codecs
    # A codec that keeps its block for a one-element row keeps it for every row.
    if o.rows is None or fit is None or fit(1) == c:
      continue
    rows = o.rows(x, None, **lp)
    if rows is None:
      continue
    length[i] = rows.length
    pack = _packs(o, x, key, len(xs), lp)
    chains.setdefault(bucket_key(x, lp, rows) if pack else ("alone", i), []).append(i)
  out = list(lps)
  for members in chains.values():
    c = load(lps[members[0]]["compressor"])
    small = c.fit(max(length[i] for i in members))
    if small != c:
      for i in members:
        out[i] = {**lps[i], "compressor": spec_of(small)}
  return out


def lower_leaves(o: Op, xs: Sequence[jax.Array], key: Any, lps: Sequence[dict]) -> list:
  """The forward of every leaf of one equation (``lps[i]``: leaf i's parameters), the
  leaves bucketed: those with equal :func:`bucket_key` run as ONE chain
  (:func:`jcoccl._src.compressors.rows.run_packed`), bit-identical per leaf to
  :attr:`Op.forward` alone. A leaf goes alone when it is the only one of its bucket, when
  it has :data:`PACK_MAX_BYTES` or more (:func:`packable`), when the call has a PRNG key
  (leaf i of several rounds with ``fold_in(key, i)``, its random stream drawn by position
  in its own row), when its codec is
  not :func:`blockwise`, or on the exact path.

  With the ``residual`` parameter each leaf's encoder residual follows the results: the
  same call returns both, and each is cut back out of its rows (:attr:`Rows.back`).

  Returns:
    The results (then the residuals), in the order of ``xs``.
  """
  n = len(xs)
  residual = bool(lps and lps[0].get("residual"))
  outs: list = [None] * (2 * n if residual else n)
  buckets: dict[tuple, list[tuple[int, Rows]]] = {}
  lps = fitted(o, xs, key, [_at_lowering(o, x, lp) for x, lp in zip(xs, lps)])
  for i, (x, lp) in enumerate(zip(xs, lps)):
    pack = _packs(o, x, key, n, lp)
    # Each leaf draws its own random stream: with one key for all, leaves of one shape would
    # round alike, their errors correlated instead of independent.
    k = key if key is None or n == 1 else jax.random.fold_in(key, i)
    rows = o.rows(x, k, **lp) if o.rows is not None and (pack or residual) else None
    if rows is None:
      outs[i] = o.forward(x, k, **lp)
      continue
    if residual and o.back is not None:  # the call returns (result, residual) rows
      rows = dataclasses.replace(rows, back=o.back(x.shape[lp["batch"] :], lp))
    buckets.setdefault(bucket_key(x, lp, rows) if pack else ("alone", i), []).append((i, rows))
  for members in buckets.values():
    chunks = lps[members[0][0]]["chunks"]
    same = [r for _, r in members]
    ys = [same[0].run(chunks)] if len(same) == 1 else run_packed(same, chunks)
    for (i, _), y in zip(members, ys):
      if isinstance(y, tuple):
        outs[i], outs[n + i] = y
      else:
        outs[i] = y
  return outs

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

from jcoccl._src.compressors.layout import padded_len
from jcoccl._src.compressors.rows import Rows, run_joint, run_packed
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


def fitted(
  o: Op, xs: Sequence[jax.Array], key: Any, lps: Sequence[dict]
) -> tuple[list[dict], dict[int, int]]:
  """The leaves' parameters with short leaves' codec fitted to them (``Compressor.fit``),
  so that a leaf shorter than one codec block (a LayerNorm vector under int8's 256) is not
  sent zero-padded to a whole long block, with the same bits.

  A chain (the leaves :func:`lower_leaves` would pack together) whose every row is short
  gets one codec fitted to its longest row. In a chain that also holds longer leaves the
  short ones get a fitted codec of their own where the backend can send two codecs' rows
  through one collective chain (``Rows.joint``: the xla backend) and that sends fewer
  bytes than padding them; elsewhere they keep the chain's block, since a chain of their
  own would cost a collective step per step, more than the padding (a few hundred bytes
  per leaf).

  Args:
    o: the op.
    xs: the leaves (with their vmap batch axes).
    key: the call's PRNG key, or None.
    lps: the leaves' parameters.

  Returns:
    ``lps``, with a copy naming the fitted codec for every fitted leaf (an example:
    ``Compressor.fit``); and for the leaves of each chain split in two, the chain's number
    (:func:`lower_leaves` then sends the two halves as one joint chain).
  """
  chains: dict[tuple, list[int]] = {}
  rows: dict[int, Rows] = {}
  for i, (x, lp) in enumerate(zip(xs, lps)):
    c = load(lp["compressor"])
    fit = getattr(c, "fit", None)  # None: the exact path or per-level codecs
    # A codec that keeps its block for a one-element row keeps it for every row.
    if o.rows is None or fit is None or fit(1) == c:
      continue
    r = o.rows(x, None, **lp)
    if r is None:
      continue
    rows[i] = r
    pack = _packs(o, x, key, len(xs), lp)
    chains.setdefault(bucket_key(x, lp, r) if pack else ("alone", i), []).append(i)
  out = list(lps)
  joint: dict[int, int] = {}
  for n, members in enumerate(chains.values()):
    c = load(lps[members[0]]["compressor"])
    short = [i for i in members if c.fit(rows[i].length) != c]
    if not short:
      continue
    small = c.fit(max(rows[i].length for i in short))
    if len(short) < len(members) and not _splits(o, xs, c, small, members, short, rows, lps):
      continue
    for i in short:
      out[i] = {**lps[i], "compressor": spec_of(small)}
    if len(short) < len(members):
      joint.update((i, n) for i in members)
  return out, joint


def _chain_elements(members: Sequence[int], rows: dict[int, Rows], block: int, unit: int) -> int:
  """Elements of the packed row of ``members`` (as :func:`run_packed` lays it, one slice)
  with codec ``block`` and slice ``unit``."""
  total = sum(_count(rows[i]) * padded_len(rows[i].length, block) for i in members)
  return padded_len(total, unit)


def _count(r: Rows) -> int:
  """Messages in leaf ``r`` (its vmap batch)."""
  return math.prod(r.x.shape[: r.nb])


def _splits(
  o: Op,
  xs: Sequence[jax.Array],
  c: Any,
  small: Any,
  members: list[int],
  short: list[int],
  rows: dict[int, Rows],
  lps: Sequence[dict],
) -> bool:
  """Whether the chain ``members`` goes as two codecs' rows in one joint chain: its backend
  sends them so (``Rows.joint``), in one slice, and they are fewer bytes than ``c`` alone."""
  first = rows[members[0]]
  if o.rows is None or first.joint is None or lps[members[0]]["chunks"] != 1:
    return False
  s = short[0]
  fit = o.rows(xs[s], None, **{**lps[s], "compressor": spec_of(small)})
  if fit is None or fit.joint is None:
    return False
  long = [i for i in members if i not in short]
  dt = first.x.dtype
  whole = c.row_nbytes(_chain_elements(members, rows, first.block, first.unit), dt)
  apart = c.row_nbytes(_chain_elements(long, rows, first.block, first.unit), dt)
  apart += small.row_nbytes(_chain_elements(short, rows, small.granule, fit.unit), dt)
  return apart < whole


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
  lps, joint = fitted(o, xs, key, [_at_lowering(o, x, lp) for x, lp in zip(xs, lps)])
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
  chains: dict[Any, list[list[tuple[int, Rows]]]] = {}
  for k, members in buckets.items():  # the two halves of a split chain go as one
    j = joint.get(members[0][0])
    chains.setdefault(k if j is None else ("joint", j), []).append(members)
  for groups in chains.values():
    if len(groups) > 1:
      ys = [y for g in run_joint([[r for _, r in m] for m in groups]) for y in g]
      members = [m for g in groups for m in g]
    else:
      members = groups[0]
      chunks = lps[members[0][0]]["chunks"]
      same = [r for _, r in members]
      ys = [same[0].run(chunks)] if len(same) == 1 else run_packed(same, chunks)
    for (i, _), y in zip(members, ys):
      if isinstance(y, tuple):
        outs[i], outs[n + i] = y
      else:
        outs[i] = y
  return outs

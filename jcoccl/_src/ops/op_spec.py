"""The one record each collective is described by (:class:`Op`), and the registry of the
ops and their primitives.

Each op module (all_reduce.py, all_gather.py, ...) describes its collective with an
:class:`Op` and registers it (:func:`jcoccl._src.ops.primitives.register`); :func:`op` imports
an op's module on first use. The op names and their duals (:data:`DUALS`) are
:mod:`jcoccl._src.base.op_names`'s.

Example:
  >>> DUALS["all_gather"]
  'reduce_scatter'
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

from jcoccl._src.base.op_names import DUALS as DUALS
from jcoccl._src.compressors import compressor_args
from jcoccl._src.compressors.threshold import effective_compressor


@dataclasses.dataclass(frozen=True)
class Op:
  """One collective's spec, the row the generic driver (:func:`plan`, :func:`apply`) and
  the primitive's rules read (see :mod:`jcoccl._src.ops.primitives`).

  Attributes:
    name: the op (a key of :data:`DUALS`).
    out_shape: ``(element shape, params) -> element output shape``.
    reduces: ``params -> bool``: the output is invariant over ``axes`` (all_reduce;
      all_gather with ``to="invarying"``).
    forward: ``(x, key, **params) -> y``: the collective on ``x``, which has
      ``params["batch"]`` leading batch axes; ``key`` is a PRNG key or None.
    check: ``(x, n, axes, **op_args) -> op_args``: the op's own argument checks on one
      array over a group of ``n`` ranks, returning them normalised (e.g. negative axes).
    exact: ``(x, axes, **op_args) -> y``: the lax collective with the same semantics (the
      path of uncompressed leaves and of axes bound off the mesh).
    tangent_args: ``params -> args`` of :func:`plan` for the tangent (grad compressor).
    dual_args: ``params -> args`` of the dual op's :func:`plan` for the cotangent.
    invariant_transpose: ``(ct, params) -> ct_x`` where the output is invariant over
      ``axes`` under check_vma and so is the cotangent: no communication is needed (lax's
      psum: a broadcast; all_gather to="invarying": this rank's block).
    row_length: ``(size, n) -> elements`` of one row of the message (the whole message, or
      one destination's block).
    settle: ``(x, c, axes, chunks=, **op_args) -> (c, call)``: the compressor as it runs
      (``call["chunks"]``, when given, replaces the slices) and the
      op's extra call parameters (all_reduce: the algorithm, which the backend check and
      the slice unit need).
    unit: ``(c, axes, **call) -> elements`` of the smallest slice.
    effective: ``(x, compressor, min_bytes, strict) -> compressor or None`` after the
      dtype and size threshold; ``grad_for`` the same for the backward compressor.
    unreduced_transpose: ``(ct, params) -> ct_x`` for the ops that sum an input unreduced
      over ``axes`` as lax does (psum, psum_scatter: each device's partial is its
      operand), the cotangent typed as lax types it; None: such an input takes the lax op,
      which raises lax's error.
    rows: ``(x, key, **params) -> Rows or None``: the leaf as the backend's rows
      (:class:`jcoccl._src.compressors.rows.Rows`; None where the exact lax op runs), for packing
      the leaves of one equation (``forward`` is then ``rows(...).run(chunks)``); None:
      every leaf is lowered on its own. With ``params["residual"]`` its ``call``
      returns (result rows, the encoder's residual rows in the input's layout).
    back: ``(element shape, params) -> fn``, ``fn`` the inverse of the rows' ``pre``
      (one message's rows -> the message), for an op that can return its encoder's
      residual (:mod:`jcoccl._src.base.residual`); None: it cannot.
  """

  name: str
  out_shape: Callable[..., tuple]
  reduces: Callable[[dict], bool]
  forward: Callable[..., Any]
  check: Callable[..., dict]
  exact: Callable[..., Any]
  tangent_args: Callable[[dict], dict]
  dual_args: Callable[[dict], dict]
  invariant_transpose: Callable[..., Any] | None = None
  row_length: Callable[[int, int], int] = lambda size, n: size
  settle: Callable[..., tuple] = lambda x, c, axes, **_: (c, {})
  unit: Callable[..., int] = lambda c, axes, **_: c.granule
  effective: Callable[..., Any] = effective_compressor
  grad_for: Callable[..., Any] = compressor_args.grad_for
  unreduced_transpose: Callable[..., Any] | None = None
  rows: Callable[..., Any] | None = None
  back: Callable[..., Any] | None = None


_OPS: dict[str, Op] = {}
_PRIMS: dict[str, Any] = {}


def op(name: str) -> Op:
  """The registered :class:`Op` ``name`` (its module is imported on first use)."""
  if name not in _OPS:
    importlib.import_module(f"jcoccl._src.ops.{name}")
  return _OPS[name]


def primitive(name: str) -> Any:
  """The primitive ``jcoccl_<name>``."""
  op(name)
  return _PRIMS[name]


def add(o: Op, p: Any) -> None:
  """Registers the op ``o`` and its primitive ``p``."""
  if o.name not in DUALS:
    raise ValueError(f"op must be one of {tuple(DUALS)}, got {o.name!r}")
  _OPS[o.name] = o
  _PRIMS[o.name] = p

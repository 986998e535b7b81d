"""Mesh axes of the collectives: names canonicalised, group sizes, vmap-bound axes, the
varying-axes typing of check_vma, and per-rank PRNG keys.

Example:
  >>> canonical_axes("data"), canonical_axes(["pod", "data"])
  (('data',), ('pod', 'data'))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax import lax
from jax.sharding import PartitionSpec as P

from jcoccl._src import _compat


def canonical_axes(axis_name: Any, empty: bool = False) -> tuple[str, ...]:
  """``axis_name`` (a name or a tuple/list of names) as a tuple, non-empty unless ``empty``
  (the collectives take ``()`` as lax's do: a group of one, whose result is the lax op's
  over no axis).

  Example:
    >>> canonical_axes("data"), canonical_axes(["pod", "data"]), canonical_axes((), empty=True)
    (('data',), ('pod', 'data'), ())
  """
  axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
  if not axes and not empty:
    raise ValueError("axis_name must be a mesh axis name or a non-empty tuple of them")
  if len(set(axes)) != len(axes):
    raise ValueError(f"axis_name has duplicate names: {axis_name!r}")
  return axes


class AxisNameError(NameError, ValueError):
  """An axis name not bound where the collective runs (a NameError, as lax raises, and a
  ValueError, as earlier jcoccl versions raised). The message is lax's (``lax.axis_size``'s;
  the ops put their lax op's in its place, :mod:`jcoccl._src.base.lax_errors`), then jcoccl's
  ``hint``."""

  def __init__(self, message: str, hint: str = "") -> None:
    super().__init__(message)
    self.hint = hint


def group_size(axes: Sequence[Any]) -> int:
  """Product of the sizes of ``axes``; raises :class:`AxisNameError` for unbound names."""
  size = 1
  for a in axes:
    try:
      size *= lax.axis_size(a)
    except (NameError, KeyError, ValueError) as e:
      hint = (
        f"axis_name {a!r} is not a mesh axis bound here: call the op inside jax.shard_map "
        "over a mesh with that axis"
      )
      raise AxisNameError(f"{e}\n(jcoccl: {hint})", hint) from None
  return int(size)


def off_mesh(axes: Sequence[str]) -> bool:
  """True when some of ``axes`` are bound by ``jax.vmap(..., axis_name=...)`` rather than by
  a mesh, or there are none (``()``): values there live in one program and nothing crosses
  a wire, so the collective runs exactly (the lax op)."""
  names = _compat.mesh_axis_names()
  return not axes or any(a not in names for a in axes)


def ensure_varying(x: jax.Array, axes: Sequence[str]) -> jax.Array:
  """Marks ``x`` as varying over ``axes`` (as lax collectives do implicitly) under check_vma."""
  if not _compat.check_vma_enabled():
    return x
  # Unreduced axes stay so: the sum over them is the collective's (see all_reduce).
  have = _compat.varying_axes(x) | _compat.unreduced_axes(x)
  missing = tuple(a for a in axes if a not in have)
  return lax.pcast(x, missing, to="varying") if missing else x


def vma_of(x: jax.Array) -> frozenset:
  """The axes ``x`` varies over (empty outside check_vma)."""
  return _compat.varying_axes(x) if _compat.check_vma_enabled() else frozenset()


def match_vma(x: jax.Array, vma: frozenset) -> jax.Array:
  """Marks ``x`` varying over the axes of ``vma`` it lacks (cotangents must carry the
  primal's varying axes)."""
  missing = tuple(sorted(a for a in vma if a not in _compat.varying_axes(x)))
  return lax.pcast(x, missing, to="varying") if missing else x


def rank_key(key: Any, axes: Sequence[str], chunk: int) -> Any:
  """A per-rank, per-chunk PRNG key (None stays None)."""
  if key is None:
    return None
  idx = lax.axis_index(tuple(axes))
  return jax.random.fold_in(jax.random.fold_in(key, idx), chunk)


def names_of(entry: Any) -> tuple:
  """The mesh axis names of one spec entry (a name, a tuple, None or UNCONSTRAINED)."""
  if entry is None or entry is P.UNCONSTRAINED:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


def strip(spec: Any, axes: tuple[str, ...], keep: bool) -> P:
  """``spec`` with, per dimension, only the names in ``axes`` (keep) or only the others."""
  out = []
  for entry in tuple(spec):
    names = tuple(a for a in names_of(entry) if (a in axes) == keep)
    out.append(None if not names else names[0] if len(names) == 1 else names)
  while out and out[-1] is None:
    out.pop()
  return P(*out)

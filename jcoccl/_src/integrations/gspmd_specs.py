"""PartitionSpecs for :func:`jcoccl.value_and_grad`: reading, checking and splitting them.

``param_specs`` may be given in the form of the differentiated arguments (a pytree of
PartitionSpecs with their structure), in another pytree form with the same leaf paths (an
``nnx.Module``'s specs for an ``nnx.State``, or the State's for a Module), or omitted: then
each leaf's spec is read from the array (a concrete array's NamedSharding, or the type of an
array on an Explicit mesh). Given specs are checked against the arrays' rank, the mesh's
axis names and, where it is known, the array's actual sharding; a mismatch is an error
naming the leaf's path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jcoccl._src import _compat
from jcoccl._src.base.axes import names_of as names_of
from jcoccl._src.base.axes import strip as strip


def data_axes(axes: Any) -> tuple[str, ...]:
  names = tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)
  if not names or not all(isinstance(a, str) for a in names) or len(set(names)) != len(names):
    raise ValueError(f"axes must be a mesh axis name or a tuple of distinct names, got {axes!r}")
  return names


def argnums_of(argnums: Any) -> tuple[int, ...]:
  nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
  if not nums or not all(isinstance(i, int) and i >= 0 for i in nums):
    raise ValueError(f"argnums must be a non-negative int or a tuple of them, got {argnums!r}")
  return nums


def is_spec(x: Any) -> bool:
  return isinstance(x, P)


def spec_entry(axes: tuple[str, ...]) -> Any:
  """How a PartitionSpec names ``axes`` on one dimension: the name, or the tuple."""
  return axes[0] if len(axes) == 1 else axes


def strip_names(spec: P, axes: tuple[str, ...]) -> P:
  """``spec`` without ``axes`` anywhere (dimensions, unreduced, reduced), same length."""
  parts: list[Any] = []
  for entry in spec:
    if entry is P.UNCONSTRAINED:
      parts.append(entry)
      continue
    names = tuple(a for a in names_of(entry) if a not in axes)
    parts.append(None if not names else names[0] if len(names) == 1 else names)
  unreduced = frozenset(spec.unreduced) - set(axes)
  reduced = frozenset(spec.reduced) - set(axes)
  kind = spec.unreduced_kind if unreduced else None
  return P(*parts, unreduced=unreduced, reduced=reduced, unreduced_kind=kind)


def known_spec(x: Any) -> P | None:
  """The PartitionSpec of ``x`` where it is known before partitioning (else None)."""
  sharding = getattr(x, "sharding", None)
  if isinstance(x, jax.Array) and not _compat.is_traced(x):
    return sharding.spec if isinstance(sharding, NamedSharding) else None
  try:
    aval_sharding = jax.typeof(x).sharding
  except (TypeError, AttributeError):
    return None
  mesh = getattr(aval_sharding, "mesh", None)
  if mesh is None or mesh.empty or not mesh.are_all_axes_explicit:
    return None
  return aval_sharding.spec


def normalized(spec: P, ndim: int) -> tuple:
  """Per dimension, the tuple of axis names (so P('a') == P(('a',), None))."""
  entries = [names_of(e) for e in spec]
  return tuple(entries + [()] * (ndim - len(entries)))


def _key_name(k: Any) -> str:
  for attr in ("name", "key", "idx"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def _path(path: Sequence[Any]) -> tuple[str, ...]:
  """A leaf path as names: GetAttrKey('l') and DictKey('l') alike (Module vs State forms)."""
  return tuple(_key_name(k) for k in path)


def _by_path(specs: Any, like: Any) -> list:
  """``specs`` matched to the leaves of ``like`` by leaf path (any pytree form)."""
  given = {_path(p): s for p, s in jax.tree_util.tree_leaves_with_path(specs, is_leaf=is_spec)}
  out = []
  for path, _ in jax.tree_util.tree_leaves_with_path(like):
    key = _path(path)
    if key not in given:
      raise ValueError(
        f"param_specs has no spec for the parameter {jax.tree_util.keystr(path)}: give the "
        "PartitionSpecs of the differentiated arguments (the Module's or the State's "
        "nnx.get_partition_spec, or a pytree of the arguments' structure), or omit "
        "param_specs to read them from the arrays"
      )
    out.append(given[key])
  return out


def resolve(param_specs: Any, diff: Any, mesh: Any) -> list[P]:
  """One checked PartitionSpec per leaf of ``diff`` (the differentiated arguments).

  Args:
    param_specs: the user's specs (any form, see the module docstring) or None.
    diff: the differentiated arguments' pytree.
    mesh: the mesh (abstract or concrete) whose axis names the specs may use.

  Returns:
    The specs, in the order of ``jax.tree_util.tree_leaves(diff)``.

  Raises:
    ValueError: a spec missing, naming an unknown axis, longer than its leaf's rank, or
      other than the array's own sharding; the message names the leaf's path.
  """
  leaves = jax.tree_util.tree_leaves_with_path(diff)
  if param_specs is None:
    return [known_spec(x) or P() for _, x in leaves]
  try:
    treedef: Any = jax.tree_util.tree_structure(diff)
    specs = treedef.flatten_up_to(param_specs)
  except (ValueError, TypeError):
    specs = _by_path(param_specs, diff)
  out = []
  for (path, x), spec in zip(leaves, specs):
    where = f"param_specs{jax.tree_util.keystr(path)}"
    out.append(_check(where, spec, x, mesh))
  return out


def _check(where: str, spec: Any, x: Any, mesh: Any) -> P:
  if spec is None:
    spec = P()
  if not isinstance(spec, P):
    raise ValueError(f"{where}: expected a PartitionSpec, got {type(spec).__name__} {spec!r}")
  ndim = len(jax.typeof(x).shape)
  if len(spec) > ndim:
    raise ValueError(
      f"{where}: {spec} has {len(spec)} entries, the parameter has rank {ndim} "
      f"(shape {tuple(jax.typeof(x).shape)})"
    )
  unknown = [a for e in spec for a in names_of(e) if a not in mesh.axis_names]
  if unknown:
    raise ValueError(
      f"{where}: {spec} names {unknown[0]!r}, which the mesh does not have (its axes: "
      f"{tuple(mesh.axis_names)})"
    )
  actual = known_spec(x)
  if actual is not None and normalized(actual, ndim) != normalized(spec, ndim):
    raise ValueError(
      f"{where}: {spec}, but the array is sharded as {actual}; pass the spec it has "
      "(or omit param_specs to read them from the arrays)"
    )
  return spec


def data_dim(spec: P, axes: tuple[str, ...], where: str) -> tuple[int, tuple[str, ...]] | None:
  """(dimension, data axes) a spec shards over the data axes; None: replicated over them.

  One dimension may name data axes: all of them (FSDP) or a subset (HSDP: sharded over the
  subset, replicated over the rest), in the mesh's data-axis order.
  """
  dims = [d for d, e in enumerate(spec) if any(a in axes for a in names_of(e))]
  if not dims:
    return None
  names = tuple(a for a in names_of(spec[dims[0]]) if a in axes)
  if len(dims) > 1 or names != tuple(a for a in axes if a in names):
    raise ValueError(
      f"{where}: {spec} shards over the data axes {axes} on more than one dimension or "
      "out of their order; a parameter is sharded over them (or a subset of them, HSDP) on "
      "one dimension, in the order of axes"
    )
  return dims[0], names

"""Error-feedback state kept between steps: one float32 residual per device and leaf.

The ops take and return the residual of one device (``residual=`` of :func:`jcoccl.all_reduce`
and :func:`jcoccl.reduce_scatter`, shaped like that device's input). Between steps the
residuals of all devices are one array per leaf, stacked on a leading dimension over the
devices that each own one (``axes``): a leaf whose block on one device has shape ``b`` is
``(n, *b)``, sharded as ``P(axes, *rest)``, where ``n`` is the number of devices of ``axes``
and ``rest`` the leaf's spec without them. The state is checkpointed like any array and passed
to ``jax.shard_map`` with its own specs as ``in_specs`` and ``out_specs`` (each leaf's
``.sharding.spec``; ``P(axes)`` where shard_map is manual over ``axes`` alone); inside,
:func:`local` gives each device its residuals and :func:`stacked` turns the new ones back into
the state's form.

Example:
  >>> state = jcoccl.residuals.init(grads_like, mesh, "data")          # doctest: +SKIP
  >>> specs = jax.tree.map(lambda e: e.sharding.spec, state)      # shard_map's in/out_specs
  >>> def step(g, state):                                           # inside shard_map
  ...   g, e = jcoccl.all_reduce(g, "data", compressor="int8",
  ...                            residual=jcoccl.residuals.local(state))
  ...   return g, jcoccl.residuals.stacked(e)
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jcoccl._src import _compat
from jcoccl._src.base.axes import canonical_axes, names_of, strip


def init(params: Any, mesh: Any, axes: Any, specs: Any = None) -> Any:
  """Zero residuals, one per device of ``axes`` and leaf of ``params``, placed on ``mesh``.

  Each device's residual is shaped like its block of the leaf: a dimension that ``specs``
  shards over some of ``axes`` is divided by their sizes (the block each device reduces),
  and the spec's other axes still shard the state as they shard the leaf. Works eagerly (one
  compiled program places every leaf) and inside ``jax.jit`` (the state then carries the
  sharding the step expects).

  Args:
    params: a pytree of arrays or ``jax.ShapeDtypeStruct``s (only shapes are read).
    mesh: a ``jax.sharding.Mesh`` or ``AbstractMesh`` with ``axes``.
    axes: the mesh axis name, or tuple of names, whose devices each keep their own residual.
    specs: a pytree of PartitionSpecs with ``params``' structure, one per leaf; None reads
      each concrete array's NamedSharding spec and takes other leaves as replicated.

  Returns:
    A pytree like ``params`` of float32 zeros of shape ``(n, *block)``.

  Example:
    >>> mesh = jax.make_mesh((8,), ("data",))                          # doctest: +SKIP
    >>> state = init({"w": jnp.ones((4, 6))}, mesh, "data")
    >>> state["w"].shape
    (8, 4, 6)
  """
  names = canonical_axes(axes)
  missing = [a for a in names if a not in mesh.axis_names]
  if missing:
    raise ValueError(f"axes: {tuple(missing)} are not axes of the mesh {tuple(mesh.axis_names)}")
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  if specs is None:
    spec_leaves = [_spec_of(x) for _, x in leaves]
  else:
    structure: Any = jax.tree_util.tree_structure(params)
    try:
      spec_leaves = structure.flatten_up_to(specs)
    except (ValueError, TypeError) as err:
      raise ValueError(f"specs: not one PartitionSpec per leaf of params: {err}") from None
  n = math.prod(mesh.shape[a] for a in names)
  shapes, shardings = [], []
  for (path, x), spec in zip(leaves, spec_leaves):
    block, rest = _block(tuple(jnp.shape(x)), spec, names, mesh, jax.tree_util.keystr(path))
    shapes.append((n, *block))
    shardings.append(NamedSharding(mesh, P(names, *rest)))
  return jax.tree_util.tree_unflatten(treedef, _zeros(shapes, shardings))


def local(state: Any) -> Any:
  """This device's residuals, inside ``jax.shard_map`` (the state's leaves are ``(1, *b)``).

  Args:
    state: the state from :func:`init` (or a step), as a shard_map body sees it.

  Returns:
    The same pytree with each leaf's leading dimension dropped: ``residual=`` of the ops.

  Example:
    >>> jcoccl.residuals.local({"w": jnp.zeros((1, 4))})["w"].shape
    (4,)
  """

  def one(e: jax.Array) -> jax.Array:
    if jnp.ndim(e) == 0 or jnp.shape(e)[0] != 1:
      raise ValueError(
        f"state: a leaf of shape {jnp.shape(e)} is not one device's slice (1, ...) of the "
        "stacked residuals; pass the state to jax.shard_map with its own specs as in_specs "
        "(each leaf's .sharding.spec, as jcoccl.residuals.init(params, mesh, axes) placed it)"
      )
    return e[0]

  return jax.tree_util.tree_map(one, state)


def stacked(residuals: Any) -> Any:
  """The new residuals of this device in the state's form (a leading dimension of 1).

  Args:
    residuals: what the ops returned for ``residual=``.

  Returns:
    The pytree with each leaf as ``(1, *b)``, for shard_map's ``out_specs`` (the state's
    specs).

  Example:
    >>> jcoccl.residuals.stacked({"w": jnp.zeros(4)})["w"].shape
    (1, 4)
  """
  return jax.tree_util.tree_map(lambda e: e[None], residuals)


def _spec_of(x: Any) -> P:
  sharding = getattr(x, "sharding", None)
  if isinstance(sharding, NamedSharding) and not _compat.is_traced(x):
    return sharding.spec
  return P()


def _block(
  shape: tuple, spec: Any, axes: tuple[str, ...], mesh: Any, where: str
) -> tuple[tuple, tuple]:
  """One device's block of ``shape`` under ``spec``'s ``axes``, and the spec's other axes."""
  if not isinstance(spec, P):
    raise ValueError(f"specs{where}: expected a PartitionSpec, got {spec!r}")
  if len(spec) > len(shape):
    raise ValueError(f"specs{where}: {spec} has more entries than the leaf's rank {len(shape)}")
  entries = tuple(spec) + (None,) * (len(shape) - len(spec))
  block = []
  for dim, (size, entry) in enumerate(zip(shape, entries)):
    unknown = [a for a in names_of(entry) if a not in mesh.axis_names]
    if unknown:
      raise ValueError(f"specs{where}: {tuple(unknown)} are not axes of the mesh")
    split = math.prod(mesh.shape[a] for a in names_of(entry) if a in axes)
    if size % split:
      raise ValueError(
        f"specs{where}: dimension {dim} ({size}) does not split over {entry!r} ({split} devices)"
      )
    block.append(size // split)
  rest = tuple(strip(P(*entries), axes, keep=False))
  return tuple(block), rest


def _zeros(shapes: list, shardings: list) -> list:
  """float32 zeros placed as ``shardings``: one program eagerly, constraints in a trace."""
  abstract = any(isinstance(s.mesh, jax.sharding.AbstractMesh) for s in shardings)
  if not _compat.is_traced(jnp.zeros(())) and not abstract:
    make = lambda: [jnp.zeros(s, jnp.float32) for s in shapes]
    return jax.jit(make, out_shardings=shardings)()
  return [_placed(jnp.zeros(s, jnp.float32), sh) for s, sh in zip(shapes, shardings)]


def _placed(z: jax.Array, sharding: NamedSharding) -> jax.Array:
  types = dict(zip(sharding.mesh.axis_names, sharding.mesh.axis_types))
  spec_axes = [a for e in sharding.spec for a in names_of(e)]
  if spec_axes and all(types[a] == AxisType.Explicit for a in spec_axes):
    return jax.sharding.reshard(z, sharding)
  return lax.with_sharding_constraint(z, sharding)

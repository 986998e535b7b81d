"""Gradient sums over the data level and 'pipe', with error feedback, and the global norm.

Data level: gradients summed with all_reduce (optionally with error feedback: each rank keeps
its own compression residual and adds it to the next step's gradient), or in ZeRO mode
reduce-scattered level by level (inside the node, then across nodes: ZeRO++'s qgZ, each level
with its own compressor and residual, so each element is quantized once per level).
Gradients of the replicated ``outer`` parameters are also summed over 'pipe'.

Example:
  >>> sync = GradSync(placement, coll, recipe, ZeroShards(placement, coll), zero=False)
  >>> ef = sync.init_ef(params)
  >>> grads, ef = sync.sync(grads, ef)  # inside shard_map
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import jcoccl
from models.collectives import Collectives
from models.recipe import Recipe
from models.sharding import DATA_AXIS, NODE, Placement, is_spec
from models.zero import ZeroShards


class GradSync:
  """The data level's gradient sum and its error-feedback state.

  Args:
    place: the mesh, its sizes and the parameters' specs.
    coll: the collectives.
    recipe: its ``error_feedback`` switch keeps residuals for the lossy data-level sums.
    shards: the ZeRO shard layout (used in ZeRO mode).
    zero: ZeRO mode (reduce_scatter instead of all_reduce on the data level).
  """

  def __init__(
    self, place: Placement, coll: Collectives, recipe: Recipe, shards: ZeroShards, zero: bool
  ):
    self.place, self.coll, self.recipe, self.shards, self.zero = place, coll, recipe, shards, zero

  def data_op(self) -> str:
    return "reduce_scatter" if self.zero else "all_reduce"

  def uses_error_feedback(self) -> bool:
    return self.place.n_data > 1 and bool(self.ef_levels())

  def ef_levels(self) -> tuple[str, ...]:
    """The data-level axes whose gradient sum keeps an error-feedback residual: those with a
    lossy compressor, when the recipe asks for error feedback."""
    if not self.recipe.error_feedback:
      return ()
    levels = self.shards.scatter_levels() if self.zero else (DATA_AXIS,)
    return tuple(a for a in levels if self.coll.compressor(a, self.data_op()) is not None)

  def sync(self, grads: dict, ef: Any = None, zero: bool = False) -> tuple[dict, Any]:
    """Sums gradients over 'data' (all) and over 'pipe' (the replicated outer parameters).

    With ``zero``, each leaf is flattened, padded (``ZeroShards.pad_flat``) and
    reduce-scattered over the data level: the result is this rank's flat shard of the sum.

    Returns:
      (summed gradients, the new residuals ``ef``).
    """
    # Every sum takes the whole pytree in one call, which jcoccl sends as one chain per
    # (codec, algorithm, dtype) for the leaves under 1 MiB (a larger leaf goes alone:
    # jcoccl._src.ops.primitives.PACK_MAX_BYTES) instead of one collective per leaf.
    if zero:
      grads, ef = self.scatter(jax.tree.map(self.shards.pad_flat, grads), ef)
    elif self.place.sizes["data"] > 1:
      if ef is not None:
        grads, local_ef = self.coll.ef_reduce(grads, jcoccl.residuals.local(ef), "data")
        ef = jcoccl.residuals.stacked(local_ef)
      else:
        grads = self.coll.all_reduce(grads, "data")
    if self.place.sizes["pipe"] > 1:
      grads = {**grads, "outer": self.coll.all_reduce(grads["outer"], "pipe")}
    return grads, ef

  def scatter(self, grads: dict, ef: dict | None) -> tuple[dict, dict | None]:
    """ZeRO's reduce_scatter of flat, padded gradients over the data level: this rank's shard.

    Level by level (``ZeroShards.scatter_levels``, inside the node first): each level's
    compressor quantizes each element once (its input on this rank: the local gradient, then
    the node's partial sum of this rank's slice), with that level's error-feedback residual
    (``ef[axis]``, per device) when it has one. Shards come out in the order that
    ``ZeroShards.local_shards`` and ``ZeroShards.gather`` use.
    """
    new_ef: dict | None = {} if ef is not None else None
    for axis in self.shards.scatter_levels():
      if ef is not None and new_ef is not None and axis in ef:
        local_ef = jcoccl.residuals.local(ef[axis])
        grads, local_ef = self.coll.ef_reduce(grads, local_ef, axis, "reduce_scatter")
        new_ef[axis] = jcoccl.residuals.stacked(local_ef)
      else:
        grads = self.coll.reduce_scatter(grads, axis)
    return grads, new_ef

  def ef_specs(self) -> Any:
    """Error-feedback residuals are per-device state (each rank's own compression error; the
    'outer' ones even differ across 'pipe'): a leading axis over every device. In ZeRO mode
    they are flat (the padded leaf that each level reduce-scatters) and keyed by level:
    ``{axis: tree}`` for the axes of :meth:`ef_levels`."""
    every = tuple(self.place.mesh.axis_names)
    tree = jax.tree.map(
      lambda s: P(every, *([None] * (1 if self.zero else len(s)))),
      self.place.specs,
      is_leaf=is_spec,
    )
    return {axis: tree for axis in self.ef_levels()} if self.zero else tree

  def init_ef(self, params: dict) -> Any:
    """Zero residuals for the train step when the recipe asks for error feedback (else None):
    ``jcoccl.residuals.init`` over every mesh axis, of each device's block of the parameters,
    or in ZeRO mode of the flat padded leaf each level reduce-scatters (the leaf's ZeRO length
    times the data ranks, divided by the levels before it)."""
    if not self.uses_error_feedback():
      return None
    place, levels = self.place, self.shards.scatter_levels()
    every = tuple(place.mesh.axis_names)
    if not self.zero:
      return jcoccl.residuals.init(params, place.mesh, every, place.specs)

    def flat(level: str) -> dict:
      before = int(np.prod([place.sizes[a] for a in levels[: levels.index(level)]]))
      size = lambda p, s: self.shards.shard_len(p.shape, s) * place.n_data // before
      return jax.tree.map(
        lambda p, s: jax.ShapeDtypeStruct((size(p, s),), jnp.float32),
        params,
        place.specs,
        is_leaf=is_spec,
      )

    return {a: jcoccl.residuals.init(flat(a), place.mesh, every) for a in self.ef_levels()}

  def global_norm(self, grads: dict, axes: tuple[str, ...] = ("tensor", "pipe")) -> jax.Array:
    """The gradient norm over all shards: each device adds its share, divided by replication
    over 'tensor'/'pipe', summed over ``axes`` (also 'data' for ZeRO shards, whose padding is 0)."""
    sizes, specs = self.place.sizes, self.place.specs
    t, p = sizes["tensor"], sizes["pipe"]
    total = jnp.float32(0.0)
    names = self.place.mesh.axis_names
    axes = tuple(a for a in names if a in axes or (a == NODE and DATA_AXIS in axes))
    for part in ("outer", "blocks"):
      for g, spec in zip(
        jax.tree.leaves(grads[part]), jax.tree.leaves(specs[part], is_leaf=is_spec)
      ):
        repl = (1 if "tensor" in spec else t) * (1 if "pipe" in spec else p)
        total = total + jnp.sum(jnp.square(g.astype(jnp.float32))) / repl
    for axis in axes:
      if sizes[axis] > 1:
        total = self.coll.all_reduce(total, axis, exact=True)
    return jnp.sqrt(total)

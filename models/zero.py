"""ZeRO and ZeRO++ (hpZ, qwZ): each data-level rank's flat 1/n_data shard of every local
parameter, and the gather that rebuilds the parameters from the shards.

In ZeRO mode each gradient leaf is flattened, padded to a multiple of the data-level ranks
(:meth:`ZeroShards.pad_flat`) and reduce-scattered (``models.grad_sync``); AdamW runs on this
rank's float32 master shard (kept with the optimizer state, sharded over 'data'), and the
updated shards are all-gathered (:meth:`ZeroShards.gather`). That all_gather may be lossy
(ZeRO++'s qwZ, e.g. int8): the model then computes with quantized weights while the master
shards stay exact, so quantization errors do not accumulate over steps.

ZeRO++ hierarchy (``[data] nodes = K``): the data level is two mesh axes ("node", "data"),
node outer. Gradients are reduce-scattered inside the node first, then across nodes;
parameters are gathered across nodes first, into the secondary shard that each node holds
(hpZ), then inside the node. The gathered parameters are what the step returns and the next
step's forward and backward passes both use, so the across-node gather runs once per step.

Example:
  >>> shards = ZeroShards(placement, coll)
  >>> master = shards.local_shards(params)   # inside shard_map: this rank's flat shards
  >>> params = shards.gather(master, params)  # every rank's shards, back in shape
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from models.collectives import Collectives
from models.sharding import DATA_AXIS, NODE, Placement, is_spec


class ZeroShards:
  """The ZeRO shard layout of a :class:`models.sharding.Placement`.

  Args:
    place: the mesh, its sizes and the parameters' specs.
    coll: the collectives (the all_gather compressor is qwZ's).
    dtype: the dtype that :meth:`gather` sends (the compute dtype: bfloat16 under mixed
      precision); the gathered parameters come back in the dtype of ``like``.
  """

  def __init__(self, place: Placement, coll: Collectives, dtype: Any = jnp.float32):
    self.place, self.coll, self.dtype = place, coll, jnp.dtype(dtype)

  def scatter_levels(self) -> tuple[str, ...]:
    """The axes that ZeRO's gradient reduce_scatter crosses, in order: inside the node
    ('data') first, then across nodes (ranks of size 1 skipped)."""
    return tuple(a for a in (DATA_AXIS, NODE) if self.place.sizes[a] > 1)

  def shard_len(self, shape: tuple[int, ...], spec: P) -> int:
    """Length of a leaf's ZeRO shard: its local size, padded to a multiple of the data
    level's ranks, / their number."""
    return -(-int(np.prod(self.place.local_shape(shape, spec))) // self.place.n_data)

  def specs(self) -> dict:
    """Specs of ZeRO shards (master weights and optimizer state): flat, split over the data
    level (in shard order: 'data' major, then 'node') and over the axes that split the
    parameter, so each device holds [shard_len]."""
    data = tuple(a for a in (DATA_AXIS, NODE) if a in self.place.data_axes)
    return jax.tree.map(
      lambda s: P((*data, *(a for a in s if a))), self.place.specs, is_leaf=is_spec
    )

  def pad_flat(self, x: jax.Array) -> jax.Array:
    """``x`` flattened and zero-padded to a multiple of the data-level ranks."""
    return jnp.pad(x.reshape(-1), (0, -x.size % self.place.n_data))

  def shard_index(self) -> jax.Array:
    """This rank's shard of the flat leaf: reduce_scatter inside the node gives slice
    ``data`` of ``sizes['data']``, the one across nodes its sub-slice ``node``."""
    if NODE not in self.place.data_axes:
      return lax.axis_index(DATA_AXIS)
    return lax.axis_index(DATA_AXIS) * self.place.sizes[NODE] + lax.axis_index(NODE)

  def local_shards(self, params: dict) -> dict:
    """This rank's ZeRO shard of each local parameter (inside shard_map)."""

    def leaf(x):
      flat = self.pad_flat(x)
      k = flat.size // self.place.n_data
      return lax.dynamic_slice_in_dim(flat, self.shard_index() * k, k)

    return jax.tree.map(leaf, params)

  def gather(self, shards: dict, like: dict) -> dict:
    """Local parameters (shaped like ``like``) from every rank's shard.

    Across nodes first: that all_gather yields the node's secondary shard (hpZ: the 1/data
    slice that every rank of a node keeps, so later gathers stay inside the node), then
    inside the node. Each level quantizes its input once with its all_gather compressor
    (qwZ); the master shards are not changed.
    """

    # Each level gathers the whole pytree in one call (one chain per codec and dtype for the
    # leaves under 1 MiB; a larger leaf goes alone).
    s = jax.tree.map(lambda v: v.astype(self.dtype), shards)
    for axis in reversed(self.scatter_levels()):
      s = self.coll.all_gather(s, axis)
    return jax.tree.map(lambda v, x: v[: x.size].reshape(x.shape).astype(x.dtype), s, like)

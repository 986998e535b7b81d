"""Where everything lives: the ('data', 'tensor', 'pipe') mesh, the stacked parameter layout
and its PartitionSpecs, and the placement of parameters and batches on the mesh.

The model's parameters become ``{"outer": embeddings and final norm, "blocks": every block
parameter stacked on a leading layer axis}``. ``blocks`` is split over 'pipe' on that axis
(stage s holds layers [s*L/P, (s+1)*L/P)) and Megatron-style over 'tensor' (attention heads
and MLP columns); ``outer`` is replicated. Batches are split over 'data' (over ("node",
"data") under ZeRO++'s hierarchy, :func:`split_nodes`).

Example:
  >>> mesh = make_mesh(2, 2, 2)
  >>> place = Placement(split_nodes(mesh, 1, zero=False), param_specs(params, gpt.TENSOR_AXIS))
  >>> placed = jax.device_put(params, place.sharding(place.specs))
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

DATA_AXIS = "data"
AXES = (DATA_AXIS, "tensor", "pipe")
NODE = "node"
# Axis names a policy may name: the mesh's, and ZeRO++'s node level ([node] table).
POLICY_AXES = (NODE, *AXES)


def is_spec(x: Any) -> bool:
  return isinstance(x, P)


# ------------------------------------------------------------------------------------------
# Parameter layout.


def stack_params(model: nnx.Module) -> dict:
  """``{"outer": ..., "blocks": ...}`` with block parameters stacked on a leading layer axis."""
  pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  blocks = pure.pop("blocks")
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[blocks[i] for i in range(len(blocks))])
  return {"outer": pure, "blocks": stacked}


def unstack_params(params: dict) -> dict:
  """Inverse of :func:`stack_params` as a pure dict (``nnx.replace_by_pure_dict`` form)."""
  n = jax.tree.leaves(params["blocks"])[0].shape[0]
  blocks = {i: jax.tree.map(lambda a, i=i: a[i], params["blocks"]) for i in range(n)}
  return {**params["outer"], "blocks": blocks}


def param_specs(params: dict, tensor_axis: Mapping[tuple[str, str], int]) -> dict:
  """PartitionSpecs: blocks over 'pipe' (layer axis) and 'tensor'; the rest replicated."""

  def block_spec(path, leaf):
    names = tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path)
    spec = [None] * leaf.ndim
    spec[0] = "pipe"
    ax = tensor_axis.get(tuple(names[-2:]))
    if ax is not None:
      spec[1 + ax] = "tensor"
    return P(*spec)

  return {
    "outer": jax.tree.map(lambda _: P(), params["outer"]),
    "blocks": jax.tree_util.tree_map_with_path(block_spec, params["blocks"]),
  }


# ------------------------------------------------------------------------------------------
# The mesh.


def make_mesh(data: int, tensor: int, pipe: int) -> jax.sharding.Mesh:
  """A ('data', 'tensor', 'pipe') mesh; across processes, 'data' is the outer (slow) level.

  Devices are taken in (process, device id) order and laid out row-major, so each
  (tensor, pipe) group is consecutive devices. With one process that is the first
  data*tensor*pipe devices; with several, the mesh must use every device and tensor*pipe
  must divide each process's device count: tensor and pipe groups then stay inside one
  process (hosts talk only over 'data', the axis whose gradients jcoccl compresses most).

  Example:
    >>> mesh = make_mesh(2, 2, 2)  # 8 devices; under jcoccl.launch -n 2 with 4 each,
    ...                            # data rank = process, tensor x pipe = its 4 devices
  """
  n = data * tensor * pipe
  if min(data, tensor, pipe) < 1 or n > jax.device_count():
    raise ValueError(
      f"mesh {data}x{tensor}x{pipe} needs {n} devices (each size >= 1); "
      f"{jax.device_count()} are available"
    )
  if jax.process_count() > 1:
    _check_multiprocess_mesh(data, tensor, pipe)
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))[:n]
  return jax.sharding.Mesh(
    np.array(devices).reshape(data, tensor, pipe),
    AXES,
    axis_types=(jax.sharding.AxisType.Auto,) * 3,
  )


def _check_multiprocess_mesh(data: int, tensor: int, pipe: int) -> None:
  procs, local = jax.process_count(), jax.local_device_count()
  if data * tensor * pipe != jax.device_count():
    raise ValueError(
      f"--mesh {data},{tensor},{pipe} uses {data * tensor * pipe} devices; across "
      f"{procs} processes the mesh must use all {jax.device_count()} "
      f"(data x tensor x pipe = processes x devices per process)"
    )
  if local % (tensor * pipe):
    raise ValueError(
      f"--mesh {data},{tensor},{pipe}: tensor x pipe = {tensor * pipe} must divide the "
      f"{local} devices of each process, so that tensor and pipe groups stay inside one "
      f"process (e.g. --mesh {jax.device_count() // local},{local},1)"
    )


def crosses_processes(mesh: jax.sharding.Mesh, axes: tuple[str, ...]) -> bool:
  """Whether some group of devices that differ only along ``axes`` spans several processes.

  Example:
    >>> crosses_processes(make_mesh(2, 2, 2), ("data",))  # two processes of 4: True
  """
  procs = np.vectorize(lambda d: d.process_index)(mesh.devices)
  names = tuple(mesh.axis_names)
  inner = [names.index(a) for a in axes]
  outer = [i for i in range(len(names)) if i not in inner]
  groups = np.transpose(procs, outer + inner).reshape(
    int(np.prod([procs.shape[i] for i in outer])), -1
  )
  return bool((groups != groups[:, :1]).any())


def split_nodes(mesh: jax.sharding.Mesh, nodes: int, zero: bool) -> jax.sharding.Mesh:
  """``mesh`` with its 'data' axis split into ("node", "data") for ``nodes`` > 1 (ZeRO++).

  Devices keep their order: node k holds data ranks [k*D/K, (k+1)*D/K), so under
  ``make_mesh``'s multi-process layout (data outer, in process order) a node is a group of
  consecutive processes (one process each when K = the process count).
  """
  if nodes == 1:
    return mesh
  d = mesh.shape[DATA_AXIS]
  if not zero:
    raise ValueError(
      f"the recipe's [data] nodes = {nodes} needs ZeRO mode ([data] zero = "
      f"true) and a data axis of size > 1 (got {d})"
    )
  if d % nodes:
    raise ValueError(f"the recipe's [data] nodes = {nodes} must divide the data axis size {d}")
  shape = (nodes, d // nodes, mesh.shape["tensor"], mesh.shape["pipe"])
  return jax.sharding.Mesh(
    mesh.devices.reshape(shape), (NODE, *AXES), axis_types=(jax.sharding.AxisType.Auto,) * 4
  )


# ------------------------------------------------------------------------------------------
# Placement.


class Placement:
  """A mesh (after :func:`split_nodes`) and the PartitionSpecs of the stacked parameters.

  Args:
    mesh: axes ``AXES``, or ``(NODE, *AXES)``.
    specs: :func:`param_specs` of the parameters.

  Attributes:
    sizes: every name of ``POLICY_AXES`` -> its mesh size (1 when the mesh lacks it).
    data_axes: the data level, outer to inner: ("node", "data") under ZeRO++'s hierarchy.
    n_data: the number of data-level ranks (the product of ``data_axes``' sizes).
  """

  def __init__(self, mesh: jax.sharding.Mesh, specs: dict):
    self.mesh, self.specs = mesh, specs
    self.sizes = {a: mesh.shape.get(a, 1) for a in POLICY_AXES}
    self.data_axes = tuple(a for a in (NODE, DATA_AXIS) if a in mesh.axis_names)
    self.n_data = self.sizes[NODE] * self.sizes[DATA_AXIS]

  def sharding(self, spec_tree: Any) -> Any:
    """NamedShardings on the mesh for a tree of PartitionSpecs."""
    return jax.tree.map(lambda s: NamedSharding(self.mesh, s), spec_tree, is_leaf=is_spec)

  def shard(self, model: nnx.Module) -> dict:
    """The model's parameters in the stacked layout, placed on the mesh."""
    return jax.device_put(stack_params(model), self.sharding(self.specs))

  def batch_spec(self) -> P:
    return P(self.data_axes if len(self.data_axes) > 1 else DATA_AXIS)

  def batch_sharding(self) -> NamedSharding:
    return NamedSharding(self.mesh, self.batch_spec())

  def make_batch(
    self, n: int, rows: Callable[[np.ndarray], tuple[np.ndarray, ...]]
  ) -> tuple[jax.Array, ...]:
    """Global batch arrays of ``n`` rows on :meth:`batch_sharding`, each process reading only
    its own rows.

    Args:
      n: global batch size (rows).
      rows: ``rows(indices)`` -> arrays whose first dimension matches ``indices``: the
        requested rows of each batch array (e.g. tokens and targets). Called once, with
        the sorted rows that this process's devices hold.

    Returns:
      One global ``jax.Array`` [n, ...] per array that ``rows`` returns.
    """
    sharding = self.batch_sharding()
    index_map = sharding.addressable_devices_indices_map((n,))
    local = sorted({r for idx in index_map.values() for r in range(*idx[0].indices(n))})
    parts = rows(np.asarray(local, np.int64))
    where = {r: i for i, r in enumerate(local)}

    def array(a: np.ndarray) -> jax.Array:
      pick = lambda idx: a[[where[r] for r in range(*idx[0].indices(n))]]
      return jax.make_array_from_callback((n, *a.shape[1:]), sharding, pick)

    return tuple(array(a) for a in parts)

  def local_shape(self, shape: tuple[int, ...], spec: P) -> tuple[int, ...]:
    """The shape of one device's block of a global ``shape`` split by ``spec``."""
    return tuple(
      n // (self.sizes[a] if a else 1) for n, a in zip(shape, tuple(spec) + (None,) * len(shape))
    )

  def shard_map(self, f: Callable, in_specs: tuple, out_specs: Any) -> Callable:
    """``f`` per device over the mesh; every cross-device sum is an explicit collective, so
    varying-axis checks are off."""
    return jax.shard_map(f, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

"""3D parallelism (mesh axes 'data', 'tensor', 'pipe') for GPT-2 and Qwen2 over jcoccl.

Layout: the model's parameters become ``{"outer": embeddings and final norm, "blocks": every
block parameter stacked on a leading layer axis}``. ``blocks`` is split over 'pipe' on that
axis (stage s holds layers [s*L/P, (s+1)*L/P)) and Megatron-style over 'tensor' (attention
heads and MLP columns); ``outer`` is replicated. Batches are split over 'data'.

Inside ``jax.shard_map`` (``check_vma=False``: every value is per device, and every
cross-device sum is an explicit collective):
  * tensor: ``enter`` (identity, backward all_reduce) before each column-parallel projection,
    ``exit`` (all_reduce, backward identity) after each row-parallel one;
  * pipe: GPipe over ppermute (``models.pipeline``), whose transpose carries gradients back;
    gradients of the replicated ``outer`` parameters are summed over 'pipe';
  * data: gradients summed with all_reduce (optionally with error feedback); or, with the
    recipe's ``[data] zero = true`` (models.recipe), ZeRO-style: each gradient leaf
    flattened, padded and reduce-scattered, AdamW run on this rank's float32 master shard
    (1/data of each leaf, kept with the optimizer state, sharded over 'data'), and the
    updated shards all-gathered. That all_gather may be lossy (ZeRO++'s qwZ, e.g. int8): the model then
    computes with quantized weights while the master shards stay exact, so quantization
    errors do not accumulate over steps.
  * ZeRO++ hierarchy (``[data] nodes = K``): the data level becomes two mesh axes
    ("node", "data"), node outer. Gradients are reduce-scattered inside the node first, then
    across nodes (qgZ: each level with its own compressor and error-feedback residual, so
    each element is quantized once per level); parameters are gathered across nodes first,
    into the secondary shard that each node holds (hpZ), then inside the node. The gathered
    parameters are what the step returns and the next step's forward and backward passes
    both use, so the across-node gather runs once per step and the backward pass gathers
    nothing (no per-layer re-gather as in ZeRO-3: parameters stay materialized per device).
Every collective goes through :class:`Collectives`, which calls jcoccl with the compressor
``policy.compressor(axis, op)``.

Example:
  >>> mesh = make_mesh(2, 2, 2)
  >>> par = Parallel3D(model, mesh, Policy(), n_micro=2)
  >>> params = par.shard(model)
  >>> loss, grads = par.loss_and_grads(params, tokens, targets)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jcoccl
from jcoccl.policy import Policy
from models import gpt, pipeline, qwen
from models.layers import LOCAL, Comm, cross_entropy
from models.recipe import Recipe, as_recipe

DATA_AXIS = "data"
AXES = (DATA_AXIS, "tensor", "pipe")
NODE = "node"
# Axis names a policy may name: the mesh's, and ZeRO++'s node level ([node] table).
POLICY_AXES = (NODE, *AXES)


# ------------------------------------------------------------------------------------------
# The one place where models/ calls collectives.


@dataclasses.dataclass
class Collectives:
  """Routes every collective of the models to jcoccl with the policy's compressor.

  ``log`` records (axis, op, shape, dtype, compressor) of each call at trace time: which
  collectives the models issue. Bytes on the wire are measured on the compiled program
  instead (``jcoccl.wire_bytes(step, ..., mesh=mesh)``: what XLA sends, by mesh axis).
  """

  policy: Policy
  log: list = dataclasses.field(default_factory=list)

  def _policy_axis(self, axis: str) -> str:
    # The node level takes the data axis' compressors unless the policy has a [node] table.
    return DATA_AXIS if axis == NODE and NODE not in self.policy.axes else axis

  def compressor(self, axis: str, op: str) -> Any:
    """The policy's compressor of ``op`` on mesh axis ``axis``."""
    return self.policy.compressor(self._policy_axis(axis), op)

  def _record(self, axis: str, op: str, x: jax.Array, c: Any) -> None:
    self.log.append((axis, op, tuple(x.shape), jnp.dtype(x.dtype), c))

  def _options(self, axis: str, op: str) -> dict:
    # The policy's algorithm names an all_reduce algorithm; the other ops take none.
    opts = self.policy.options(self._policy_axis(axis))
    return opts if op == "all_reduce" else {k: v for k, v in opts.items() if k != "algorithm"}

  def all_reduce(self, x: jax.Array, axis: str, *, exact: bool = False) -> jax.Array:
    """Sum over ``axis``; ``exact`` forces the uncompressed path (metrics, norms)."""
    c = None if exact else self.compressor(axis, "all_reduce")
    self._record(axis, "all_reduce", x, c)
    return jcoccl.all_reduce(x, axis, compressor=c, **self._options(axis, "all_reduce"))

  def reduce_scatter(self, x: jax.Array, axis: str) -> jax.Array:
    """Sum over ``axis`` of a flat ``x``, this rank's 1/size slice (tiled on dimension 0)."""
    c = self.compressor(axis, "reduce_scatter")
    self._record(axis, "reduce_scatter", x, c)
    return jcoccl.reduce_scatter(
      x, axis, tiled=True, compressor=c, **self._options(axis, "reduce_scatter")
    )

  def all_gather(self, x: jax.Array, axis: str) -> jax.Array:
    """Concatenation over ``axis`` of every rank's flat ``x`` (tiled on dimension 0)."""
    c = self.compressor(axis, "all_gather")
    self._record(axis, "all_gather", x, c)
    return jcoccl.all_gather(x, axis, tiled=True, compressor=c, **self._options(axis, "all_gather"))

  def ef_reduce(self, grads: Any, state: Any, axis: str, op: str = "all_reduce") -> tuple[Any, Any]:
    """Sums a gradient pytree over ``axis`` with error feedback (jcoccl.error_feedback);
    ``op`` is "all_reduce" or "reduce_scatter" (flat leaves, tiled)."""
    c = self.compressor(axis, op)
    for g in jax.tree.leaves(grads):
      self._record(axis, op, g, c)
    ef, opts = jcoccl.error_feedback(c), self._options(axis, op)
    if op == "reduce_scatter":
      return ef.reduce_scatter(grads, state, axis, tiled=True, **opts)
    return ef.all_reduce(grads, state, axis, **opts)

  def ppermute(self, x: jax.Array, axis: str, perm: list[tuple[int, int]]) -> jax.Array:
    """Sends ``x`` along ``perm``; its VJP sends the cotangent along the inverse permutation."""
    c = self.compressor(axis, "ppermute")
    opts = self._options(axis, "ppermute")
    inverse = [(b, a) for a, b in perm]

    def send(v, p):
      self._record(axis, "ppermute", v, c)
      return jcoccl.ppermute(v, axis, p, compressor=c, **opts)

    @jax.custom_vjp
    def move(v):
      return send(v, perm)

    move.defvjp(lambda v: (send(v, perm), None), lambda _, g: (send(g, inverse),))
    return move(x)


class TensorComm:
  """Megatron's f/g operators over the 'tensor' axis, as custom VJPs (see ``models.layers``)."""

  def __init__(self, coll: Collectives, axis: str = "tensor"):
    @jax.custom_vjp
    def enter(x):
      return x

    enter.defvjp(lambda x: (x, None), lambda _, g: (coll.all_reduce(g, axis),))

    @jax.custom_vjp
    def exit_(x):
      return coll.all_reduce(x, axis)

    exit_.defvjp(lambda x: (coll.all_reduce(x, axis), None), lambda _, g: (g,))
    self.enter, self.exit = enter, exit_


# ------------------------------------------------------------------------------------------
# Parameter layout.


@dataclasses.dataclass(frozen=True)
class _Family:
  layers_field: str
  heads: Callable[[Any], tuple[int, ...]]  # sizes that 'tensor' must divide
  tensor_axis: dict[tuple[str, str], int]


_FAMILIES = {
  gpt.GPT: _Family("n_layer", lambda c: (c.n_head,), gpt.TENSOR_AXIS),
  qwen.Qwen: _Family(
    "num_hidden_layers",
    lambda c: (c.num_attention_heads, c.num_key_value_heads, c.intermediate_size),
    qwen.TENSOR_AXIS,
  ),
}


def _family(model: nnx.Module) -> _Family:
  for cls, fam in _FAMILIES.items():
    if isinstance(model, cls):
      return fam
  raise TypeError(f"model must be a models.gpt.GPT or models.qwen.Qwen, got {type(model).__name__}")


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


def param_specs(params: dict, tensor_axis: dict[tuple[str, str], int]) -> dict:
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
# The parallel model.


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


class Parallel3D:
  """A GPT or Qwen split over a ('data', 'tensor', 'pipe') mesh.

  Args:
    model: the model (its weights are the initial parameters; see :meth:`shard`).
    mesh: a mesh with axes ``AXES``.
    recipe: a :class:`models.recipe.Recipe` (or a jcoccl.Policy alone: every switch off, or
      a mapping for ``Recipe.from_dict``): its policy's compressors per (axis, op) and the
      training switches. ``zero`` turns on ZeRO mode (``self.zero``, when 'data' has more
      than one rank), ``nodes`` (ZeRO mode only) splits the data level into ("node", "data")
      mesh axes: ``self.mesh`` then has axes ``(NODE, *AXES)``, with 'data' the ranks inside
      one node; ``error_feedback`` keeps the data level's compression residuals.
    n_micro: pipeline micro-batches per step (must divide the per-data-rank batch).
  """

  def __init__(
    self,
    model: nnx.Module,
    mesh: jax.sharding.Mesh,
    recipe: Recipe | Policy | None = None,
    *,
    n_micro: int = 1,
  ):
    if tuple(mesh.axis_names) != AXES:
      raise ValueError(f"mesh axis names must be {AXES}, got {tuple(mesh.axis_names)}")
    fam = _family(model)
    self.recipe, self.n_micro = as_recipe(recipe), int(n_micro)
    self.policy = self.recipe.policy
    self.zero = self.recipe.zero and mesh.shape[DATA_AXIS] > 1
    self.mesh = _split_nodes(mesh, self.recipe.nodes, self.zero)
    self.sizes = {a: self.mesh.shape.get(a, 1) for a in POLICY_AXES}
    # The data level, outer to inner: ("node", "data") under ZeRO++'s hierarchy.
    self.data_axes = tuple(a for a in (NODE, DATA_AXIS) if a in self.mesh.axis_names)
    self.n_data = mesh.shape[DATA_AXIS]
    n_layers = getattr(model.cfg, fam.layers_field)
    t, p = self.sizes["tensor"], self.sizes["pipe"]
    if n_layers % p:
      raise ValueError(f"the 'pipe' axis size {p} must divide the number of layers {n_layers}")
    for n in fam.heads(model.cfg):
      if n % t:
        raise ValueError(
          f"the 'tensor' axis size {t} must divide the head counts and MLP "
          f"width {fam.heads(model.cfg)} of the model"
        )
    if self.n_micro < 1:
      raise ValueError(f"n_micro must be >= 1, got {n_micro}")
    stage_cfg = dataclasses.replace(model.cfg, **{fam.layers_field: n_layers // p})
    abstract = nnx.eval_shape(lambda: type(model)(stage_cfg, rngs=nnx.Rngs(0)))
    self._graphdef, self._abstract_state = nnx.split(abstract)
    self.specs = param_specs(jax.eval_shape(lambda: stack_params(model)), fam.tensor_axis)
    self.coll = Collectives(self.policy)

  # -- placement ---------------------------------------------------------------------------
  def sharding(self, spec_tree: Any) -> Any:
    return jax.tree.map(
      lambda s: NamedSharding(self.mesh, s), spec_tree, is_leaf=lambda x: isinstance(x, P)
    )

  def shard(self, model: nnx.Module) -> dict:
    """The model's parameters in the stacked layout, placed on the mesh."""
    return jax.device_put(stack_params(model), self.sharding(self.specs))

  def batch_sharding(self) -> NamedSharding:
    return NamedSharding(self.mesh, self._batch_spec())

  def _batch_spec(self) -> P:
    return P(self.data_axes if len(self.data_axes) > 1 else DATA_AXIS)

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

  # -- local computation --------------------------------------------------------------------
  def _stage(self, params: dict) -> nnx.Module:
    state = jax.tree.map(lambda x: x, self._abstract_state)
    nnx.replace_by_pure_dict(state, unstack_params(params))
    return nnx.merge(self._graphdef, state)

  def _comm(self) -> Comm:
    return TensorComm(self.coll) if self.sizes["tensor"] > 1 else LOCAL

  def _local_loss(self, params: dict, tokens: jax.Array, targets: jax.Array) -> jax.Array:
    """This device's share of the global mean loss (zero off the last stage)."""
    model, comm, n_pipe = self._stage(params), self._comm(), self.sizes["pipe"]
    b, s = tokens.shape
    if b % self.n_micro:
      raise ValueError(f"n_micro={self.n_micro} must divide the per-data-rank batch {b}")
    micro = tokens.reshape(self.n_micro, b // self.n_micro, s)
    x = jax.vmap(model.embed)(micro)
    y = pipeline.gpipe(
      lambda h: model.run_blocks(h, comm),
      x,
      axis_name="pipe",
      n_stages=n_pipe,
      permute=lambda v, perm: self.coll.ppermute(v, "pipe", perm),
    )
    logits = model.head(y.reshape(b, s, -1))
    loss = cross_entropy(logits, targets) / self.n_data
    return jnp.where(pipeline.is_last_stage("pipe", n_pipe), loss, 0.0)

  def _sum_loss(self, loss: jax.Array) -> jax.Array:
    for axis in (*self.data_axes, "pipe"):
      if self.sizes[axis] > 1:
        loss = self.coll.all_reduce(loss, axis, exact=True)
    return loss

  def _data_op(self) -> str:
    return "reduce_scatter" if self.zero else "all_reduce"

  def uses_error_feedback(self) -> bool:
    return self.n_data > 1 and bool(self._ef_levels())

  def _scatter_levels(self) -> tuple[str, ...]:
    """The axes that ZeRO's gradient reduce_scatter crosses, in order: inside the node
    ('data') first, then across nodes (ranks of size 1 skipped)."""
    return tuple(a for a in (DATA_AXIS, NODE) if self.sizes[a] > 1)

  def _ef_levels(self) -> tuple[str, ...]:
    """The data-level axes whose gradient sum keeps an error-feedback residual: those with a
    lossy compressor, when the recipe asks for error feedback."""
    if not self.recipe.error_feedback:
      return ()
    levels = self._scatter_levels() if self.zero else (DATA_AXIS,)
    return tuple(a for a in levels if self.coll.compressor(a, self._data_op()) is not None)

  def _sync_grads(self, grads: dict, ef: Any = None, zero: bool = False) -> tuple[dict, Any]:
    """Sums gradients over 'data' (all) and over 'pipe' (the replicated outer parameters).

    With ``zero``, each leaf is flattened, padded (:meth:`_pad_flat`) and reduce-scattered over
    'data': the result is this rank's flat shard of the summed gradient.
    """
    op = "reduce_scatter" if zero else "all_reduce"
    if zero:
      grads, ef = self._scatter_grads(jax.tree.map(self._pad_flat, grads), ef)
    elif self.sizes["data"] > 1:
      if ef is not None:
        local_ef = jax.tree.map(lambda e: e[0], ef)
        grads, local_ef = self.coll.ef_reduce(grads, local_ef, "data", op)
        ef = jax.tree.map(lambda e: e[None], local_ef)
      else:
        grads = jax.tree.map(lambda g: getattr(self.coll, op)(g, "data"), grads)
    if self.sizes["pipe"] > 1:
      grads = {
        **grads,
        "outer": jax.tree.map(lambda g: self.coll.all_reduce(g, "pipe"), grads["outer"]),
      }
    return grads, ef

  def _scatter_grads(self, grads: dict, ef: dict | None) -> tuple[dict, dict | None]:
    """ZeRO's reduce_scatter of flat, padded gradients over the data level: this rank's shard.

    Level by level (:meth:`_scatter_levels`, inside the node first): each level's
    compressor quantizes each element once (its input on this rank: the local gradient, then
    the node's partial sum of this rank's slice), with that level's error-feedback residual
    (``ef[axis]``, per device) when it has one. Shards come out in the order that
    :meth:`_local_shards` and :meth:`_gather` use.
    """
    new_ef = {} if ef is not None else None
    for axis in self._scatter_levels():
      if ef is not None and axis in ef:
        local_ef = jax.tree.map(lambda e: e[0], ef[axis])
        grads, local_ef = self.coll.ef_reduce(grads, local_ef, axis, "reduce_scatter")
        new_ef[axis] = jax.tree.map(lambda e: e[None], local_ef)
      else:
        grads = jax.tree.map(lambda g, axis=axis: self.coll.reduce_scatter(g, axis), grads)
    return grads, new_ef

  def _local_loss_and_grads(self, params, tokens, targets, ef=None, zero=False):
    loss, grads = jax.value_and_grad(self._local_loss)(params, tokens, targets)
    grads, ef = self._sync_grads(grads, ef, zero)
    return self._sum_loss(loss), grads, ef

  def ef_specs(self) -> dict:
    """Error-feedback residuals are per-device state (each rank's own compression error; the
    'outer' ones even differ across 'pipe'): a leading axis over every device. In ZeRO mode
    they are flat (the padded leaf that each level reduce-scatters) and keyed by level:
    ``{axis: tree}`` for the axes of :meth:`_ef_levels`."""
    every = tuple(self.mesh.axis_names)
    tree = jax.tree.map(
      lambda s: P(every, *([None] * (1 if self.zero else len(s)))),
      self.specs,
      is_leaf=lambda x: isinstance(x, P),
    )
    return {axis: tree for axis in self._ef_levels()} if self.zero else tree

  def _local_shape(self, shape: tuple[int, ...], spec: P) -> tuple[int, ...]:
    return tuple(
      n // (self.sizes[a] if a else 1) for n, a in zip(shape, tuple(spec) + (None,) * len(shape))
    )

  def init_ef(self, params: dict) -> dict | None:
    """Zero residuals for :meth:`train_step` when the recipe asks for error feedback."""
    if not self.uses_error_feedback():
      return None
    ndev = self.mesh.devices.size

    def shapes(level: str | None) -> dict:
      # A level reduce-scatters the flat padded leaf divided by the levels before it.
      before = (
        1
        if level is None
        else int(
          np.prod(
            [self.sizes[a] for a in self._scatter_levels()[: self._scatter_levels().index(level)]]
          )
        )
      )
      local = lambda p, s: (
        (self._shard_len(p.shape, s) * self.n_data // before,)
        if self.zero
        else self._local_shape(p.shape, s)
      )
      return jax.tree.map(
        lambda p, s: (ndev, *local(p, s)), params, self.specs, is_leaf=lambda x: isinstance(x, P)
      )

    zeros = lambda t: jax.tree.map(
      lambda sh: jnp.zeros(sh, jnp.float32), t, is_leaf=lambda x: isinstance(x, tuple)
    )
    make = (
      (lambda: {a: zeros(shapes(a)) for a in self._ef_levels()})
      if self.zero
      else (lambda: zeros(shapes(None)))
    )
    return jax.jit(make, out_shardings=self.sharding(self.ef_specs()))()

  # -- ZeRO: each rank's flat 1/data shard of every (local) parameter ----------------------
  def _shard_len(self, shape: tuple[int, ...], spec: P) -> int:
    """Length of a leaf's ZeRO shard: its local size, padded to a multiple of the data
    level's ranks, / their number."""
    return -(-int(np.prod(self._local_shape(shape, spec))) // self.n_data)

  def zero_specs(self) -> dict:
    """Specs of ZeRO shards (master weights and optimizer state): flat, split over the data
    level (in shard order: 'data' major, then 'node') and over the axes that split the
    parameter, so each device holds [shard_len]."""
    data = tuple(a for a in (DATA_AXIS, NODE) if a in self.data_axes)
    return jax.tree.map(
      lambda s: P((*data, *(a for a in s if a))), self.specs, is_leaf=lambda x: isinstance(x, P)
    )

  def _pad_flat(self, x: jax.Array) -> jax.Array:
    return jnp.pad(x.reshape(-1), (0, -x.size % self.n_data))

  def _shard_index(self) -> jax.Array:
    """This rank's shard of the flat leaf: reduce_scatter inside the node gives slice
    ``data`` of ``sizes['data']``, the one across nodes its sub-slice ``node``."""
    if NODE not in self.data_axes:
      return lax.axis_index(DATA_AXIS)
    return lax.axis_index(DATA_AXIS) * self.sizes[NODE] + lax.axis_index(NODE)

  def _local_shards(self, params: dict) -> dict:
    """This rank's ZeRO shard of each local parameter (inside shard_map)."""

    def leaf(x):
      flat = self._pad_flat(x)
      k = flat.size // self.n_data
      return lax.dynamic_slice_in_dim(flat, self._shard_index() * k, k)

    return jax.tree.map(leaf, params)

  def _gather(self, shards: dict, like: dict) -> dict:
    """Local parameters (shaped like ``like``) from every rank's shard.

    Across nodes first: that all_gather yields the node's secondary shard (hpZ: the 1/data
    slice that every rank of a node keeps, so later gathers stay inside the node), then
    inside the node. Each level quantizes its input once with its all_gather compressor
    (qwZ); the master shards are not changed.
    """

    def leaf(s, x):
      for axis in reversed(self._scatter_levels()):
        s = self.coll.all_gather(s, axis)
      return s[: x.size].reshape(x.shape)

    return jax.tree.map(leaf, shards, like)

  def _shard_map(self, f: Callable, in_specs: tuple, out_specs: Any) -> Callable:
    return jax.shard_map(f, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

  def loss_and_grads(self, params: dict, tokens: jax.Array, targets: jax.Array):
    """Global mean cross entropy and its gradient (stacked layout), computed 3D-parallel.

    Args:
      params: from :meth:`shard`.
      tokens, targets: int32 [batch, seq]; 'data' must divide batch.

    Returns:
      (loss scalar, grads with the layout and sharding of ``params``).
    """
    batch = self._batch_spec()
    f = self._shard_map(
      lambda *a: self._local_loss_and_grads(*a)[:2], (self.specs, batch, batch), (P(), self.specs)
    )
    batch = self.batch_sharding()
    return jax.jit(f)(params, jax.device_put(tokens, batch), jax.device_put(targets, batch))

  def logits_fn(self) -> Callable[[dict, jax.Array], jax.Array]:
    """A jitted ``logits(params, tokens)``: the whole model's float32 logits [batch, seq,
    vocab] computed on the mesh (one micro-batch through the pipeline), replicated on every
    device. ``tokens`` are replicated too, so any batch size works on any 'data' size.

    Example:
      >>> logits = Parallel3D(model, mesh).logits_fn()(params, tokens)
    """

    def local(params, tokens):
      model, n_pipe = self._stage(params), self.sizes["pipe"]
      y = pipeline.gpipe(
        lambda h: model.run_blocks(h, self._comm()),
        model.embed(tokens)[None],
        axis_name="pipe",
        n_stages=n_pipe,
        permute=lambda v, perm: self.coll.ppermute(v, "pipe", perm),
      )[0]
      out = jnp.where(pipeline.is_last_stage("pipe", n_pipe), model.head(y), 0.0)
      # Only the last stage holds real logits; the others add exact zeros.
      return self.coll.all_reduce(out, "pipe", exact=True) if n_pipe > 1 else out

    return jax.jit(self._shard_map(local, (self.specs, P()), P()))

  # -- training -----------------------------------------------------------------------------
  def _global_norm(self, grads: dict, axes: tuple[str, ...] = ("tensor", "pipe")) -> jax.Array:
    """The gradient norm over all shards: each device adds its share, divided by replication
    over 'tensor'/'pipe', summed over ``axes`` (also 'data' for ZeRO shards, whose padding is 0)."""
    t, p = self.sizes["tensor"], self.sizes["pipe"]
    total = jnp.float32(0.0)
    axes = tuple(a for a in self.mesh.axis_names if a in axes or (a == NODE and DATA_AXIS in axes))
    for part, spec_tree in (("outer", self.specs["outer"]), ("blocks", self.specs["blocks"])):
      for g, spec in zip(
        jax.tree.leaves(grads[part]), jax.tree.leaves(spec_tree, is_leaf=lambda x: isinstance(x, P))
      ):
        repl = (1 if "tensor" in spec else t) * (1 if "pipe" in spec else p)
        total = total + jnp.sum(jnp.square(g.astype(jnp.float32))) / repl
    for axis in axes:
      if self.sizes[axis] > 1:
        total = self.coll.all_reduce(total, axis, exact=True)
    return jnp.sqrt(total)

  def opt_specs(self, tx: optax.GradientTransformation, params: dict) -> Any:
    """Specs of the optimizer state: ``tx``'s, with the parameters' specs and P() else; in
    ZeRO mode ``{"master": ..., "tx": ...}``, both on :meth:`zero_specs`."""
    state = jax.eval_shape(tx.init, params)  # only its structure is used
    specs = optax.tree_map_params(
      tx,
      lambda _, s: s,
      state,
      self.zero_specs() if self.zero else self.specs,
      transform_non_params=lambda _: P(),
      is_leaf=lambda x: isinstance(x, P),
    )
    return {"master": self.zero_specs(), "tx": specs} if self.zero else specs

  def init_opt(self, tx: optax.GradientTransformation, params: dict) -> Any:
    """The optimizer state, placed on the mesh. ZeRO mode: ``{"master": float32 master
    shards of ``params``, "tx": tx's state of them}``, each rank holding its own shards."""
    specs = self.opt_specs(tx, params)

    def init_zero(p):
      master = self._local_shards(p)
      return {"master": master, "tx": tx.init(master)}

    init = init_zero if self.zero else tx.init
    f = self._shard_map(init, (self.specs,), specs)
    return jax.jit(f)(params)

  def train_step(
    self, tx: optax.GradientTransformation, params: dict, *, clip_norm: float | None = 1.0
  ) -> Callable:
    """A jitted ``step(params, opt_state, ef, tokens, targets) -> (params, opt_state, ef, metrics)``.

    ``ef`` is :meth:`init_ef`'s residuals (None without error feedback). Gradients are
    clipped to ``clip_norm`` by their global norm (over all shards) before ``tx``; metrics
    are ``loss`` and ``grad_norm``. In ZeRO mode ``tx`` updates each rank's float32 master
    shard (``opt_state["master"]``; gradients reduce-scattered, state sharded) and the new
    shards are all-gathered into the parameters that the next step computes with (through
    the all_gather compressor: quantized weights under qwZ).
    """
    specs, ospecs = self.specs, self.opt_specs(tx, params)
    espec = self.ef_specs() if self.uses_error_feedback() else None

    def local(params, opt_state, ef, tokens, targets):
      loss, grads, ef = self._local_loss_and_grads(params, tokens, targets, ef, self.zero)
      norm = self._global_norm(grads, AXES if self.zero else ("tensor", "pipe"))
      if clip_norm is not None:
        scale = jnp.minimum(1.0, clip_norm / (norm + 1e-6))
        grads = jax.tree.map(lambda g: g * scale, grads)
      metrics = {"loss": loss, "grad_norm": norm}
      if not self.zero:
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, ef, metrics
      updates, tx_state = tx.update(grads, opt_state["tx"], opt_state["master"])
      master = optax.apply_updates(opt_state["master"], updates)
      return (self._gather(master, params), {"master": master, "tx": tx_state}, ef, metrics)

    batch = self._batch_spec()
    f = self._shard_map(
      local,
      (specs, ospecs, espec, batch, batch),
      (specs, ospecs, espec, {"loss": P(), "grad_norm": P()}),
    )
    return jax.jit(f, donate_argnums=(0, 1, 2))


def _split_nodes(mesh: jax.sharding.Mesh, nodes: int, zero: bool) -> jax.sharding.Mesh:
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


def reference_loss_and_grads(model: nnx.Module, tokens: jax.Array, targets: jax.Array):
  """Single-device loss and gradients in the stacked layout, for comparison."""

  def loss_fn(m):
    return cross_entropy(m(tokens), targets)

  loss, g = nnx.value_and_grad(loss_fn)(model)
  gm = nnx.merge(nnx.graphdef(model), g)
  return loss, stack_params(gm)

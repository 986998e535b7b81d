"""3D parallelism (mesh axes 'data', 'tensor', 'pipe') for GPT-2 and Qwen2 over jcoccl: the step.

:class:`Parallel3D` puts together the jobs of its neighbours and runs the model inside
``jax.shard_map`` (``check_vma=False``: every value is per device, and every cross-device
sum is an explicit collective):
  * placement (``models.sharding``): the stacked parameter layout, blocks over 'pipe' and
    'tensor', batches over 'data';
  * tensor: ``enter`` (identity, backward all_reduce) before each column-parallel projection,
    ``exit`` (all_reduce, backward identity) after each row-parallel one
    (``models.collectives.TensorComm``);
  * pipe: GPipe over ppermute (``models.pipeline``), whose transpose carries gradients back;
  * data: gradient sums with all_reduce, error feedback, or ZeRO's reduce_scatter
    (``models.grad_sync``); ZeRO/ZeRO++ master shards and the hpZ/qwZ gather
    (``models.zero``), switched on by the recipe's ``[data]`` table (``models.recipe``).
Every collective goes through ``models.collectives.Collectives``, which calls jcoccl with
the compressor ``policy.compressor(axis, op)``.

Example:
  >>> mesh = make_mesh(2, 2, 2)
  >>> par = Parallel3D(model, mesh, Policy(), n_micro=2)
  >>> params = par.placement.shard(model)
  >>> loss, grads = par.loss_and_grads(params, tokens, targets)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from jcoccl.policy import Policy
from models import pipeline
from models.collectives import Collectives, TensorComm, is_stochastic, step_key
from models.grad_sync import GradSync
from models.layers import LOCAL, Comm, cross_entropy
from models.recipe import Recipe, as_recipe
from models.registry import family_of
from models.sharding import (
  AXES,
  DATA_AXIS,
  NODE,
  POLICY_AXES,
  Placement,
  crosses_processes,
  make_mesh,
  param_specs,
  split_nodes,
  stack_params,
  unstack_params,
)
from models.zero import ZeroShards

__all__ = [
  "AXES",
  "DATA_AXIS",
  "NODE",
  "POLICY_AXES",
  "Collectives",
  "Parallel3D",
  "TensorComm",
  "compute_dtype",
  "crosses_processes",
  "make_mesh",
  "param_specs",
  "reference_loss_and_grads",
  "stack_params",
  "unstack_params",
]


class Parallel3D:
  """A GPT or Qwen split over a ('data', 'tensor', 'pipe') mesh.

  Args:
    model: the model (its weights are the initial parameters: ``placement.shard(model)``).
    mesh: a mesh with axes ``AXES``.
    recipe: a :class:`models.recipe.Recipe` (or a jcoccl.Policy alone: every switch off, or
      a mapping for ``Recipe.from_dict``): its policy's compressors per (axis, op) and the
      training switches. ``zero`` turns on ZeRO mode (``self.zero``, when 'data' has more
      than one rank), ``nodes`` (ZeRO mode only) splits the data level into ("node", "data")
      mesh axes: ``self.mesh`` then has axes ``(NODE, *AXES)``, with 'data' the ranks inside
      one node; ``error_feedback`` keeps the data level's compression residuals.
    n_micro: pipeline micro-batches per step (must divide the per-data-rank batch).
    dtype: the compute dtype, float32 or bfloat16. bfloat16 is the usual mixed-precision
      recipe: the stored parameters (and ZeRO's master shards and AdamW's state) stay
      float32; each step computes with a bfloat16 copy, so activations, the tensor and pipe
      collectives and the gradient sums carry bfloat16, and gradients are cast back to
      float32 for clipping and the optimizer. ZeRO gathers its shards in bfloat16.
    collectives: builds the collectives from the recipe's policy (default
      :class:`models.collectives.Collectives`); a subclass (one that records what it is
      given, or ``models.directed.DirectedCollectives``) sees every call of the step,
      the gradient sums and the ZeRO gathers, since all of them share the one object.
    seed: the run's seed, the root of the stochastic-rounding keys (a codec spec with
      ``:stochastic`` at any point): the train step's keys are a function of (seed, step,
      point, call, device), evaluation and :meth:`logits_fn` draw from fixed keys of the
      seed (``models.collectives``).

  Attributes:
    placement: the mesh and the parameters' specs (``models.sharding.Placement``): its
      ``shard(model)`` places the parameters, its ``make_batch`` the batches.
    shards: the ZeRO shard layout (``models.zero.ZeroShards``).
    grad_sync: the data level's gradient sums (``models.grad_sync.GradSync``): its
      ``init_ef(params)`` gives the error-feedback residuals of :meth:`train_step`.
    coll: the collectives that every part of the step calls.
  """

  def __init__(
    self,
    model: nnx.Module,
    mesh: jax.sharding.Mesh,
    recipe: Recipe | Policy | None = None,
    *,
    n_micro: int = 1,
    dtype: Any = jnp.float32,
    collectives: Callable[[Policy], Collectives] = Collectives,
    seed: int = 0,
  ):
    self.dtype = compute_dtype(dtype)
    self.seed = int(seed)
    if tuple(mesh.axis_names) != AXES:
      raise ValueError(f"mesh axis names must be {AXES}, got {tuple(mesh.axis_names)}")
    fam = family_of(model)
    self.recipe, self.n_micro = as_recipe(recipe), int(n_micro)
    self.policy = self.recipe.policy
    self.zero = self.recipe.zero and mesh.shape[DATA_AXIS] > 1
    split = split_nodes(mesh, self.recipe.nodes, self.zero)
    n_layers = fam.layers(model.cfg)
    t, p = mesh.shape["tensor"], mesh.shape["pipe"]
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
    abstract = nnx.eval_shape(
      lambda: type(model)(fam.with_layers(model.cfg, n_layers // p), rngs=nnx.Rngs(0))
    )
    self._graphdef, self._abstract_state = nnx.split(abstract)
    specs = param_specs(jax.eval_shape(lambda: stack_params(model)), fam.tensor_axis)
    self.placement = Placement(split, specs)
    self.coll = collectives(self.policy)
    self.shards = ZeroShards(self.placement, self.coll, self.dtype)
    self.grad_sync = GradSync(self.placement, self.coll, self.recipe, self.shards, self.zero)
    self.mesh, self.specs, self.sizes = self.placement.mesh, specs, self.placement.sizes
    self.data_axes, self.n_data = self.placement.data_axes, self.placement.n_data

  @property
  def stochastic(self) -> bool:
    """True when any compressor of the step rounds stochastically: its train step then
    needs the step number (:meth:`train_step`)."""
    codecs = [c for a in self.policy.axes.values() for c in a.compressors.values()]
    codecs += list(getattr(self.coll, "directions", {}).values())
    return any(is_stochastic(c) for c in codecs)

  # -- local computation --------------------------------------------------------------------
  def _compute(self, params: Any) -> Any:
    """``params`` in the compute dtype (the float32 originals stay the master weights)."""
    if self.dtype == jnp.float32:
      return params
    return jax.tree.map(lambda p: p.astype(self.dtype), params)

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

  def _keys(self, purpose: str, step: Any = None, batch_split: bool = True) -> tuple:
    """(base key, device coordinates) of a program's key stream (inside shard_map):
    :func:`step_key` and ``{axis: lax.axis_index(axis)}``, the data axes left out where
    the batch is replicated (``batch_split`` False: :meth:`logits_fn`)."""
    axes = [a for a in self.mesh.axis_names if batch_split or a in ("tensor", "pipe")]
    return step_key(self.seed, purpose, step), {a: jax.lax.axis_index(a) for a in axes}

  def _local_loss_and_grads(self, params, tokens, targets, ef=None, zero=False, keys=None):
    # keys None: the caller's key stream (if any) stays open.
    with self.coll.keyed(*keys) if keys is not None else contextlib.nullcontext():
      low = self._compute(params)
      loss, grads = jax.value_and_grad(self._local_loss)(low, tokens, targets)
      grads, ef = self.grad_sync.sync(grads, ef, zero)
    # Summed in the compute dtype on the wire; clipped and applied in float32.
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    return self._sum_loss(loss), grads, ef

  def loss_and_grads(self, params: dict, tokens: jax.Array, targets: jax.Array):
    """Global mean cross entropy and its gradient (stacked layout), computed 3D-parallel.

    Args:
      params: from ``placement.shard(model)``.
      tokens, targets: int32 [batch, seq]; 'data' must divide batch.

    Returns:
      (loss scalar, grads with the layout and sharding of ``params``).
    """
    batch = self.placement.batch_spec()

    def local(params, tokens, targets):
      keys = self._keys("eval")  # evaluation rounds with fixed keys: reproducible
      return self._local_loss_and_grads(params, tokens, targets, keys=keys)[:2]

    f = self.placement.shard_map(local, (self.specs, batch, batch), (P(), self.specs))
    batch = self.placement.batch_sharding()
    return jax.jit(f)(params, jax.device_put(tokens, batch), jax.device_put(targets, batch))

  def logits_fn(self) -> Callable[[dict, jax.Array], jax.Array]:
    """A jitted ``logits(params, tokens)``: the whole model's float32 logits [batch, seq,
    vocab] computed on the mesh (one micro-batch through the pipeline), replicated on every
    device. ``tokens`` are replicated too, so any batch size works on any 'data' size.

    Example:
      >>> logits = Parallel3D(model, mesh).logits_fn()(params, tokens)
    """

    def local(params, tokens):
      model, n_pipe = self._stage(self._compute(params)), self.sizes["pipe"]
      with self.coll.keyed(*self._keys("sample", batch_split=False)):
        y = pipeline.gpipe(
          lambda h: model.run_blocks(h, self._comm()),
          model.embed(tokens)[None],
          axis_name="pipe",
          n_stages=n_pipe,
          permute=lambda v, perm: self.coll.ppermute(v, "pipe", perm),
        )[0]
      logits = model.head(y).astype(jnp.float32)
      out = jnp.where(pipeline.is_last_stage("pipe", n_pipe), logits, 0.0)
      # Only the last stage holds real logits; the others add exact zeros.
      return self.coll.all_reduce(out, "pipe", exact=True) if n_pipe > 1 else out

    return jax.jit(self.placement.shard_map(local, (self.specs, P()), P()))

  # -- training -----------------------------------------------------------------------------
  def opt_specs(self, tx: optax.GradientTransformation, params: dict) -> Any:
    """Specs of the optimizer state: ``tx``'s, with the parameters' specs and P() else; in
    ZeRO mode ``{"master": ..., "tx": ...}``, both on ``shards.specs()``."""
    state = jax.eval_shape(tx.init, params)  # only its structure is used
    specs = optax.tree_map_params(
      tx,
      lambda _, s: s,
      state,
      self.shards.specs() if self.zero else self.specs,
      transform_non_params=lambda _: P(),
      is_leaf=lambda x: isinstance(x, P),
    )
    return {"master": self.shards.specs(), "tx": specs} if self.zero else specs

  def init_opt(self, tx: optax.GradientTransformation, params: dict) -> Any:
    """The optimizer state, placed on the mesh. ZeRO mode: ``{"master": float32 master
    shards of ``params``, "tx": tx's state of them}``, each rank holding its own shards."""
    specs = self.opt_specs(tx, params)

    def init_zero(p):
      master = self.shards.local_shards(p)
      return {"master": master, "tx": tx.init(master)}

    init = init_zero if self.zero else tx.init
    f = self.placement.shard_map(init, (self.specs,), specs)
    return jax.jit(f)(params)

  def train_step(
    self, tx: optax.GradientTransformation, params: dict, *, clip_norm: float | None = 1.0
  ) -> Callable:
    """A jitted ``step(params, opt_state, ef, tokens, targets, step=None) -> (params,
    opt_state, ef, metrics)``.

    ``step`` (an int32 scalar, traced: one program for every step) is the step number,
    which stochastic rounding needs: each compressed call that rounds stochastically draws a
    key from (seed, step, point, call, device). Without it such a call is an error at trace
    time; a step with no stochastic codec ignores it.

    ``ef`` is ``grad_sync.init_ef(params)``'s residuals (None without error feedback). Gradients are
    clipped to ``clip_norm`` by their global norm (over all shards) before ``tx``; metrics
    are ``loss`` and ``grad_norm``. In ZeRO mode ``tx`` updates each rank's float32 master
    shard (``opt_state["master"]``; gradients reduce-scattered, state sharded) and the new
    shards are all-gathered into the parameters that the next step computes with (through
    the all_gather compressor: quantized weights under qwZ).
    """
    specs, ospecs = self.specs, self.opt_specs(tx, params)
    espec = self.grad_sync.ef_specs() if self.grad_sync.uses_error_feedback() else None

    def local(params, opt_state, ef, tokens, targets, step=None):
      # One key stream for the whole step: ZeRO's gather of the updated shards draws too.
      with self.coll.keyed(*((None,) if step is None else self._keys("train", step))):
        return update(params, opt_state, ef, tokens, targets)

    def update(params, opt_state, ef, tokens, targets):
      loss, grads, ef = self._local_loss_and_grads(params, tokens, targets, ef, self.zero)
      norm = self.grad_sync.global_norm(grads, AXES if self.zero else ("tensor", "pipe"))
      if clip_norm is not None:
        scale = jnp.minimum(1.0, clip_norm / (norm + 1e-6))
        grads = jax.tree.map(lambda g: g * scale, grads)
      metrics = {"loss": loss, "grad_norm": norm}
      if not self.zero:
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, ef, metrics
      updates, tx_state = tx.update(grads, opt_state["tx"], opt_state["master"])
      master = optax.apply_updates(opt_state["master"], updates)
      return (self.shards.gather(master, params), {"master": master, "tx": tx_state}, ef, metrics)

    batch = self.placement.batch_spec()
    out = (specs, ospecs, espec, {"loss": P(), "grad_norm": P()})
    plain = self.placement.shard_map(local, (specs, ospecs, espec, batch, batch), out)
    keyed = self.placement.shard_map(local, (specs, ospecs, espec, batch, batch, P()), out)

    def step_fn(params, opt_state, ef, tokens, targets, step=None):
      if step is None:
        return plain(params, opt_state, ef, tokens, targets)
      return keyed(params, opt_state, ef, tokens, targets, jnp.asarray(step, jnp.int32))

    return jax.jit(step_fn, donate_argnums=(0, 1, 2))


def compute_dtype(dtype: Any) -> jnp.dtype:
  """``dtype`` checked as a compute dtype of :class:`Parallel3D`.

  Raises:
    ValueError: not float32 or bfloat16 (float16 would need loss scaling, which the step
      does not do).
  """
  try:
    d = jnp.dtype(dtype)
  except TypeError:
    d = None
  if d not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
    raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
  return d


def reference_loss_and_grads(model: nnx.Module, tokens: jax.Array, targets: jax.Array):
  """Single-device loss and gradients in the stacked layout, for comparison."""

  def loss_fn(m):
    return cross_entropy(m(tokens), targets)

  loss, g = nnx.value_and_grad(loss_fn)(model)
  gm = nnx.merge(nnx.graphdef(model), g)
  return loss, stack_params(gm)

"""The one place where models/ calls collectives: each goes to jcoccl with the policy's
compressor for its mesh axis and op.

``Collectives`` routes all_reduce, reduce_scatter, all_gather, ppermute and the
error-feedback sums; ``TensorComm`` builds Megatron's f/g operators on 'tensor' from it.
The sums and gathers take a pytree in one call: jcoccl packs the leaves that share a codec,
algorithm and dtype into one encode -> collective -> decode chain (bitwise each leaf's
result alone), so a model's gradients travel as a few messages, not one per leaf.

Example:
  >>> coll = Collectives(Policy.from_dict({"data": {"all_reduce": "int8"}}))
  >>> coll.all_reduce(g, "data")  # inside shard_map: int8 all_reduce over 'data'
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

import jcoccl
from jcoccl.policy import Policy
from models.sharding import DATA_AXIS, NODE


@dataclasses.dataclass
class Collectives:
  """Routes every collective of the models to jcoccl with the policy's compressor.

  ``log`` records (axis, op, shape, dtype, compressor) of each leaf of each call at trace
  time: which collectives the models issue. Bytes on the wire are measured on the compiled
  program instead (``jcoccl.wire_bytes(step, ..., mesh=mesh)``: what XLA sends, by mesh
  axis).
  """

  policy: Policy
  log: list = dataclasses.field(default_factory=list)

  def _policy_axis(self, axis: str) -> str:
    # The node level takes the data axis' compressors unless the policy has a [node] table.
    return DATA_AXIS if axis == NODE and NODE not in self.policy.axes else axis

  def compressor(self, axis: str, op: str) -> Any:
    """The policy's compressor of ``op`` on mesh axis ``axis``."""
    return self.policy.compressor(self._policy_axis(axis), op)

  def _record(self, axis: str, op: str, x: Any, c: Any) -> None:
    for leaf in jax.tree.leaves(x):
      self.log.append((axis, op, tuple(leaf.shape), jnp.dtype(leaf.dtype), c))

  def _options(self, axis: str, op: str) -> dict:
    # The policy's algorithm names an all_reduce algorithm; the other ops take none.
    opts = self.policy.options(self._policy_axis(axis), op)
    return opts if op == "all_reduce" else {k: v for k, v in opts.items() if k != "algorithm"}

  def all_reduce(self, x: Any, axis: str, *, exact: bool = False) -> Any:
    """Sum over ``axis`` of an array or pytree (one call); ``exact`` forces the
    uncompressed path (metrics, norms)."""
    c = None if exact else self.compressor(axis, "all_reduce")
    self._record(axis, "all_reduce", x, c)
    return jcoccl.all_reduce(x, axis, compressor=c, **self._options(axis, "all_reduce"))

  def reduce_scatter(self, x: Any, axis: str) -> Any:
    """Sum over ``axis`` of a flat ``x`` (or a pytree of them, in one call), this rank's
    1/size slice (tiled on dimension 0)."""
    c = self.compressor(axis, "reduce_scatter")
    self._record(axis, "reduce_scatter", x, c)
    return jcoccl.reduce_scatter(
      x, axis, tiled=True, compressor=c, **self._options(axis, "reduce_scatter")
    )

  def all_gather(self, x: Any, axis: str) -> Any:
    """Concatenation over ``axis`` of every rank's flat ``x`` (or a pytree of them, in one
    call), tiled on dimension 0."""
    c = self.compressor(axis, "all_gather")
    self._record(axis, "all_gather", x, c)
    return jcoccl.all_gather(x, axis, tiled=True, compressor=c, **self._options(axis, "all_gather"))

  def ef_reduce(self, grads: Any, state: Any, axis: str, op: str = "all_reduce") -> tuple[Any, Any]:
    """Sums a gradient pytree over ``axis`` with error feedback (jcoccl.error_feedback);
    ``op`` is "all_reduce" or "reduce_scatter" (flat leaves, tiled)."""
    c = self.compressor(axis, op)
    self._record(axis, op, grads, c)
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

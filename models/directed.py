"""Parallel3D with a compressor per traffic point: the forward collective and its transpose
can take different codecs (``--direction``, ``[directions]`` of a policy file, ``--adapt``).

Points (:data:`models.directions.POINTS`): ``tensor.forward`` (the Megatron activation sums
after each row-parallel projection), ``tensor.backward`` (the activation-gradient sums before
each column-parallel one), ``pipe.forward`` / ``pipe.backward`` (GPipe's ppermute of
activations and of their cotangents) and ``data`` (the gradient sum). A point not named
takes the policy's per-axis compressor.

The collectives can also report, through a tap (``models.error_probe.Tap``), the error each
candidate codec would inject into the step's real traffic; the training path passes none.

Example:
  >>> par = DirectedParallel(model, mesh, recipe, directions={"tensor.backward": "hadamard(int3)"})
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

import jcoccl
from jcoccl.policy import Policy
from models.collectives import Collectives
from models.directions import check_directions
from models.layers import LOCAL, Comm
from models.parallel import Parallel3D
from models.registry import family_of
from models.sharding import DATA_AXIS


class DirectedCollectives(Collectives):
  """:class:`models.collectives.Collectives` with a compressor per point (:data:`POINTS`).

  A named point takes its own codec (None: exact), sent with ``min_bytes=0`` so that it
  compresses every message; other traffic takes the policy's per-axis compressor. The
  ``data`` point sets the data level's all_reduce/reduce_scatter compressor (error feedback
  follows the recipe). With a :class:`models.error_probe.Tap`, every tensor/pipe call and the data sums also
  report their candidate codecs' errors (the step itself uses the directed codecs).

  Args:
    policy: the per-axis compressors of the points not named.
    directions: ``{point: codec spec or compressor}`` (:data:`POINTS`; "none" = exact).
    tap: a :class:`models.error_probe.Tap` to measure candidate codecs (None: no measurement).
    pipe_stages: the mesh's 'pipe' size (a tensor layer's global index counts stages).

  Example:
    >>> coll = DirectedCollectives(Policy(), {"pipe.backward": "int4"}, pipe_stages=2)
  """

  def __init__(
    self,
    policy: Policy,
    directions: Mapping[str, Any] | None = None,
    tap=None,
    *,
    pipe_stages: int = 1,
  ):
    super().__init__(policy)
    self.directions = check_directions(directions or {})
    self.tap = tap
    self.pipe_stages = pipe_stages  # the mesh's 'pipe' size: a tensor layer's stage
    # (point, shape, dtype) of every tensor, pipe and data-gradient message traced.
    self.points_log: list[tuple[str, tuple, Any]] = []

  def compressor(self, axis: str, op: str) -> Any:
    if (
      self._policy_axis(axis) == DATA_AXIS
      and op in ("all_reduce", "reduce_scatter")
      and "data" in self.directions
    ):
      return self.directions["data"]
    return super().compressor(axis, op)

  def _options(self, axis: str, op: str) -> dict:
    opts = super()._options(axis, op)
    if self._policy_axis(axis) == DATA_AXIS and "data" in self.directions:
      opts["min_bytes"] = 0
    return opts

  def _point(self, point: str, axis: str, op: str) -> tuple[Any, dict]:
    if point in self.directions:
      opts = {k: v for k, v in self._options(axis, op).items() if k != "min_bytes"}
      return self.directions[point], {**opts, "min_bytes": 0}
    return self.compressor(axis, op), self._options(axis, op)

  def point_compressor(self, point: str, axis: str, op: str) -> Any:
    return self._point(point, axis, op)[0]

  def tensor_sum(
    self, x: jax.Array, direction: str, layer: int, n_local: int, key: Any = None
  ) -> jax.Array:
    """The 'tensor' all_reduce of ``direction`` ("forward" or "backward") in local layer
    ``layer`` (of ``n_local`` per pipe stage); ``key``: its stochastic-rounding key (drawn
    by the caller in the forward pass)."""
    point = f"tensor.{direction}"
    c, opts = self._point(point, "tensor", "all_reduce")
    self.points_log.append((point, tuple(x.shape), jnp.dtype(x.dtype)))
    if key is None:
      key = self.key(point, c)
    out = jcoccl.all_reduce(x, "tensor", compressor=c, key=key, **opts)
    if self.tap is not None:
      exact = jcoccl.all_reduce(x, "tensor")
      stage = jax.lax.axis_index("pipe") if self.pipe_stages > 1 else 0
      self.tap.measure(
        point,
        exact,
        lambda cc, k: jcoccl.all_reduce(x, "tensor", compressor=cc, key=k, min_bytes=0),
        stage * n_local + layer,
      )
    return out

  def ppermute(self, x: jax.Array, axis: str, perm: list[tuple[int, int]]) -> jax.Array:
    """Sends ``x`` along ``perm`` with the ``<axis>.forward`` codec; its VJP sends the
    cotangent back with ``<axis>.backward``'s (both keys drawn here)."""
    inverse = [(b, a) for a, b in perm]

    def send(v, p, direction, k):
      point = f"{axis}.{direction}"
      c, opts = self._point(point, axis, "ppermute")
      self.points_log.append((point, tuple(v.shape), jnp.dtype(v.dtype)))
      out = jcoccl.ppermute(v, axis, p, compressor=c, key=k, **opts)
      if self.tap is not None:
        exact = jcoccl.ppermute(v, axis, p)
        self.tap.measure(
          point, exact, lambda cc, k: jcoccl.ppermute(v, axis, p, compressor=cc, key=k, min_bytes=0)
        )
      return out

    @jax.custom_vjp
    def move(v, kf, kb):
      return send(v, perm, "forward", kf)

    move.defvjp(
      lambda v, kf, kb: (send(v, perm, "forward", kf), kb),
      lambda kb, g: (send(g, inverse, "backward", kb), None, None),
    )
    kf = self.draw(f"{axis}.forward", axis, "ppermute")
    return move(x, kf, self.draw(f"{axis}.backward", axis, "ppermute"))

  def all_reduce(self, x: Any, axis: str, *, exact: bool = False, key: Any = None) -> Any:
    """As Collectives.all_reduce (an array or pytree); with a tap, each leaf of the data
    level's gradient sums also reports its noise across data shards and its candidate
    codecs' errors."""
    out = super().all_reduce(x, axis, exact=exact, key=key)
    if exact or self._policy_axis(axis) != DATA_AXIS:
      return out
    for leaf in jax.tree.leaves(x):
      self.points_log.append(("data", tuple(leaf.shape), jnp.dtype(leaf.dtype)))
      if self.tap is not None:
        _measure_data(self.tap, leaf, axis)
    return out


def _measure_data(tap: Any, x: jax.Array, axis: str) -> None:
  """Reports one gradient leaf's noise across the data shards and its candidate codecs'
  errors, each codec sending the leaf alone."""
  g = x.astype(jnp.float32)
  s = jcoccl.all_reduce(g, axis)
  n = jax.lax.psum(1, axis)
  sq = jcoccl.all_reduce(jnp.sum(g * g), axis)
  norm2 = jnp.sum(s * s)
  tap.add_noise(n / jnp.maximum(n - 1, 1) * (sq - norm2 / n), norm2)
  tap.measure(
    "data", s, lambda cc, k: jcoccl.all_reduce(g, axis, compressor=cc, key=k, min_bytes=0)
  )


class DirectedTensorComm:
  """Megatron's f/g operators that tell their collective its direction and layer."""

  def __init__(self, coll: DirectedCollectives, n_local: int):
    self.coll, self.n_local = coll, n_local
    self.n_enter = self.n_exit = 0

  def enter(self, x: jax.Array) -> jax.Array:
    # Two enters and two exits per block, blocks in order on every pipeline tick.
    layer = (self.n_enter // 2) % self.n_local
    self.n_enter += 1
    coll, n = self.coll, self.n_local

    @jax.custom_vjp
    def f(v, k):
      return v

    f.defvjp(lambda v, k: (v, k), lambda k, g: (coll.tensor_sum(g, "backward", layer, n, k), None))
    return f(x, coll.draw("tensor.backward", "tensor", "all_reduce"))

  def exit(self, x: jax.Array) -> jax.Array:
    layer = (self.n_exit // 2) % self.n_local
    self.n_exit += 1
    coll, n = self.coll, self.n_local

    @jax.custom_vjp
    def f(v, k):
      return coll.tensor_sum(v, "forward", layer, n, k)

    f.defvjp(
      lambda v, k: (coll.tensor_sum(v, "forward", layer, n, k), None), lambda _, g: (g, None)
    )
    return f(x, coll.draw("tensor.forward", "tensor", "all_reduce"))


class DirectedParallel(Parallel3D):
  """:class:`models.parallel.Parallel3D` whose collectives are :class:`DirectedCollectives`.

  Args:
    model, mesh, recipe, n_micro, dtype: as Parallel3D.
    directions: ``{point: codec spec or compressor}`` (:data:`POINTS`; "none" = exact).
    tap: a :class:`models.error_probe.Tap` to measure candidate codecs (None: no measurement).

  Example:
    >>> par = DirectedParallel(model, mesh, recipe, directions={"tensor.backward": "hadamard(int3)"})
  """

  def __init__(self, model, mesh, recipe=None, *, directions=None, tap=None, **kw):
    stages = mesh.shape["pipe"]
    directed = lambda policy: DirectedCollectives(policy, directions, tap, pipe_stages=stages)
    super().__init__(model, mesh, recipe, collectives=directed, **kw)
    self.n_local = family_of(model).layers(model.cfg) // self.sizes["pipe"]

  def _comm(self) -> Comm:
    if self.sizes["tensor"] == 1:
      return LOCAL
    assert isinstance(self.coll, DirectedCollectives)
    return DirectedTensorComm(self.coll, self.n_local)

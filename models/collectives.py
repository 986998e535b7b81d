"""The one place where models/ calls collectives: each goes to jcoccl with the policy's
compressor for its mesh axis and op.

``Collectives`` routes all_reduce, reduce_scatter, all_gather, ppermute and the
error-feedback sums; ``TensorComm`` builds Megatron's f/g operators on 'tensor' from it.
The sums and gathers take a pytree in one call: jcoccl packs the leaves that share a codec,
algorithm and dtype into one encode -> collective -> decode chain (bitwise each leaf's
result alone), so a model's gradients travel as a few messages, not one per leaf.

Stochastic rounding (a codec spec with ``:stochastic``, e.g. ``int4:stochastic`` or
``hadamard(int4:stochastic)``) needs a PRNG key per call. Inside a traced step,
``models.parallel.Parallel3D`` opens a :class:`Keys` stream (:meth:`Collectives.keyed`) from
the run's seed, the step number and the device's mesh coordinates; each call that rounds
stochastically draws the next key of its point (``tensor.forward``, ``pipe.backward``,
``data.all_reduce``, ...): the n-th call of a point in the step's trace, which in the unrolled
pipeline is one (tick, layer, slot), so one micro-batch in one layer, with the device's
coordinates on the axes where the point's values differ (:func:`fold_axes`: values
replicated over an axis round alike on its ranks and stay replicated). The keys of a step are
a function of (seed, step, point, call, device) only: a rerun or a resumed run draws the same
bits. A backward call's key is drawn when its
forward runs and travels to the VJP as a residual.

Example:
  >>> coll = Collectives(Policy.from_dict({"data": {"all_reduce": "int8"}}))
  >>> coll.all_reduce(g, "data")  # inside shard_map: int8 all_reduce over 'data'
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import zlib
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np

import jcoccl
from jcoccl.policy import Policy
from models.sharding import DATA_AXIS, NODE


def is_stochastic(codec: Any) -> bool:
  """True when ``codec`` (a compressor, or None for the exact op) rounds stochastically
  (a wrapper such as ``hadamard(int4:stochastic)`` reports its inner codec's rounding)."""
  return bool(getattr(codec, "stochastic", False))


def tag(name: str) -> int:
  """A stable 31-bit id of a point's name, folded into its keys (the same in every process
  and Python run, unlike ``hash``)."""
  return zlib.crc32(name.encode()) & 0x7FFFFFFF


def step_key(seed: int, purpose: str, step: Any = None) -> jax.Array:
  """The base key of one traced program: ``seed``, then ``purpose`` ("train", "eval",
  "sample"), then ``step`` (an int or a traced int32 scalar; None: left out).

  Example:
    >>> k = step_key(0, "train", 7)   # what step 7 of a seed-0 run draws from
  """
  key = jax.random.fold_in(jax.random.key(np.uint32(seed)), tag(purpose))
  return key if step is None else jax.random.fold_in(key, step)


def fold_axes(point: str, coords: Mapping[str, Any]) -> tuple[str, ...]:
  """The mesh axes whose coordinate goes into ``point``'s keys: those over which its
  inputs always differ, never one they may be replicated over. Ranks that hold the same
  value must round it the same way, or replicas drift apart: a tensor-replicated activation
  sent over 'pipe', or a tensor-replicated gradient summed over 'data', must draw the same
  key on every 'tensor' rank. Activations differ over the data axes (their batch rows) and,
  at the tensor points, over 'pipe' (their layers); the data point, the 'pipe' gradient sum
  and the ZeRO collectives fold in none (jcoccl folds in the rank on the collective's own
  axes, so the ranks of one call still round independently)."""
  data = tuple(a for a in coords if a not in ("tensor", "pipe"))
  if point in ("tensor.forward", "tensor.backward"):
    return (*data, "pipe")
  if point in ("pipe.forward", "pipe.backward"):
    return data
  return ()


class Keys:
  """The PRNG keys of one traced program's collective calls: :meth:`next` gives the
  ``n``-th key of a point, ``fold_in(fold_in(base, tag(point)), n)`` with the device's
  coordinates on the point's :func:`fold_axes` folded in.

  Args:
    base: the program's key (:func:`step_key`).
    coords: ``{mesh axis: this device's index}`` (``lax.axis_index``; an axis left out is
      never folded in).
  """

  def __init__(self, base: jax.Array, coords: Mapping[str, Any] | None = None):
    self.base, self.coords = base, dict(coords or {})
    self.counts: collections.Counter[str] = collections.Counter()

  def next(self, point: str) -> jax.Array:
    n = self.counts[point]
    self.counts[point] += 1
    key = jax.random.fold_in(jax.random.fold_in(self.base, tag(point)), n)
    for axis in fold_axes(point, self.coords):
      key = jax.random.fold_in(key, self.coords[axis])
    return key


@dataclasses.dataclass
class Collectives:
  """Routes every collective of the models to jcoccl with the policy's compressor.

  Which collectives a traced program issues, and what each named, is read from the program
  itself (``jcoccl.explain(traced)``); bytes on the wire are measured on the compiled
  program (``jcoccl.wire_bytes(step, ..., mesh=mesh)``: what XLA sends, by mesh axis).
  """

  policy: Policy
  # The key stream of the program being traced (:meth:`keyed`); None outside one.
  keys: Keys | None = None

  @contextlib.contextmanager
  def keyed(
    self, base: jax.Array | None, coords: Mapping[str, Any] | None = None
  ) -> Iterator[None]:
    """Calls made inside draw their stochastic-rounding keys from ``base`` and the device's
    ``coords`` (:class:`Keys`; None: none drawn, a stochastic codec is then an error)."""
    outer, self.keys = self.keys, None if base is None else Keys(base, coords)
    try:
      yield
    finally:
      self.keys = outer

  def point_compressor(self, point: str, axis: str, op: str) -> Any:
    """The compressor of a named point (``tensor.forward``, ...): here the policy's for
    (axis, op); ``models.directed.DirectedCollectives`` gives points their own."""
    return self.compressor(axis, op)

  def key(self, point: str, codec: Any) -> jax.Array | None:
    """The next key of ``point`` when ``codec`` rounds stochastically, else None.

    Raises:
      ValueError: a stochastic codec with no key stream open (a call outside
        Parallel3D's programs, or a train step called without its step number).
    """
    if not is_stochastic(codec):
      return None
    if self.keys is None:
      raise ValueError(
        f"{point} = {codec} rounds stochastically and needs a PRNG key per call: call it "
        "inside models.parallel.Parallel3D's programs, and pass the step number to its "
        "train step (step(params, opt_state, ef, tokens, targets, step))"
      )
    return self.keys.next(point)

  def draw(self, point: str, axis: str, op: str) -> jax.Array | None:
    """The next key of ``point`` if its compressor (:meth:`point_compressor`) rounds
    stochastically, else None (nothing drawn)."""
    return self.key(point, self.point_compressor(point, axis, op))

  def _policy_axis(self, axis: str) -> str:
    # The node level takes the data axis' compressors unless the policy has a [node] table.
    return DATA_AXIS if axis == NODE and NODE not in self.policy.axes else axis

  def compressor(self, axis: str, op: str) -> Any:
    """The policy's compressor of ``op`` on mesh axis ``axis``."""
    return self.policy.compressor(self._policy_axis(axis), op)

  def _options(self, axis: str, op: str) -> dict:
    # The policy's algorithm names an all_reduce algorithm; the other ops take none.
    opts = self.policy.options(self._policy_axis(axis), op)
    return opts if op == "all_reduce" else {k: v for k, v in opts.items() if k != "algorithm"}

  def all_reduce(self, x: Any, axis: str, *, exact: bool = False, key: Any = None) -> Any:
    """Sum over ``axis`` of an array or pytree (one call); ``exact`` forces the
    uncompressed path (metrics, norms). ``key``: a key drawn by the caller (a tensor
    point's); by default a stochastic codec draws the next ``<axis>.all_reduce`` key."""
    c = None if exact else self.compressor(axis, "all_reduce")
    opts = self._options(axis, "all_reduce")
    if key is None:
      key = self.key(f"{axis}.all_reduce", c)
    return _per_leaf(lambda v, k: jcoccl.all_reduce(v, axis, compressor=c, key=k, **opts), x, key)

  def reduce_scatter(self, x: Any, axis: str) -> Any:
    """Sum over ``axis`` of a flat ``x`` (or a pytree of them, in one call), this rank's
    1/size slice (tiled on dimension 0)."""
    c = self.compressor(axis, "reduce_scatter")
    opts = self._options(axis, "reduce_scatter")
    return _per_leaf(
      lambda v, k: jcoccl.reduce_scatter(v, axis, tiled=True, compressor=c, key=k, **opts),
      x,
      self.key(f"{axis}.reduce_scatter", c),
    )

  def all_gather(self, x: Any, axis: str) -> Any:
    """Concatenation over ``axis`` of every rank's flat ``x`` (or a pytree of them, in one
    call), tiled on dimension 0."""
    c = self.compressor(axis, "all_gather")
    opts = self._options(axis, "all_gather")
    return _per_leaf(
      lambda v, k: jcoccl.all_gather(v, axis, tiled=True, compressor=c, key=k, **opts),
      x,
      self.key(f"{axis}.all_gather", c),
    )

  def ef_reduce(self, grads: Any, state: Any, axis: str, op: str = "all_reduce") -> tuple[Any, Any]:
    """Sums a gradient pytree over ``axis`` with error feedback (jcoccl.error_feedback);
    ``op`` is "all_reduce" or "reduce_scatter" (flat leaves, tiled)."""
    c = self.compressor(axis, op)
    ef, opts = jcoccl.error_feedback(c), self._options(axis, op)
    key = self.key(f"{axis}.{op}", c)
    if key is not None:
      # One call per leaf, each with its own key (see _per_leaf).
      leaves, treedef = jax.tree.flatten(grads)
      rs = jax.tree.leaves(state)
      pairs = [
        self._ef_one(ef, g, r, axis, op, jax.random.fold_in(key, i), opts)
        for i, (g, r) in enumerate(zip(leaves, rs))
      ]
      return (
        jax.tree.unflatten(treedef, [p[0] for p in pairs]),
        jax.tree.unflatten(jax.tree.structure(state), [p[1] for p in pairs]),
      )
    return self._ef_one(ef, grads, state, axis, op, None, opts)

  @staticmethod
  def _ef_one(ef: Any, g: Any, r: Any, axis: str, op: str, key: Any, opts: dict) -> Any:
    if op == "reduce_scatter":
      return ef.reduce_scatter(g, r, axis, tiled=True, key=key, **opts)
    return ef.all_reduce(g, r, axis, key=key, **opts)

  def ppermute(self, x: jax.Array, axis: str, perm: list[tuple[int, int]]) -> jax.Array:
    """Sends ``x`` along ``perm``; its VJP sends the cotangent along the inverse permutation
    (keys of ``<axis>.forward`` and ``<axis>.backward``, both drawn here)."""
    c = self.compressor(axis, "ppermute")
    opts = self._options(axis, "ppermute")
    inverse = [(b, a) for a, b in perm]

    def send(v, p, k):
      return jcoccl.ppermute(v, axis, p, compressor=c, key=k, **opts)

    @jax.custom_vjp
    def move(v, kf, kb):
      return send(v, perm, kf)

    move.defvjp(
      lambda v, kf, kb: (send(v, perm, kf), kb),
      lambda kb, g: (send(g, inverse, kb), None, None),
    )
    kf, kb = self.key(f"{axis}.forward", c), self.key(f"{axis}.backward", c)
    return move(x, kf, kb)


def _per_leaf(fn: Any, x: Any, key: Any) -> Any:
  """``fn(x, key)``, or with a key, ``fn(leaf_i, fold_in(key, i))`` per leaf: jcoccl gives
  every leaf of a keyed call the same stream (a leaf's noise is drawn by its position in its
  own rows), and leaves of one gradient sum must round independently."""
  if key is None:
    return fn(x, None)
  leaves, treedef = jax.tree.flatten(x)
  return jax.tree.unflatten(
    treedef, [fn(v, jax.random.fold_in(key, i)) for i, v in enumerate(leaves)]
  )


class TensorComm:
  """Megatron's f/g operators over the 'tensor' axis, as custom VJPs (see ``models.layers``).

  ``enter`` draws its backward's key (``tensor.backward``) and ``exit`` its forward's
  (``tensor.forward``) when they are called, in the forward pass."""

  def __init__(self, coll: Collectives, axis: str = "tensor"):
    def reduce(x, k):
      # No key argument unless one was drawn: subclasses that override all_reduce without
      # one keep working for round-to-nearest codecs.
      return coll.all_reduce(x, axis) if k is None else coll.all_reduce(x, axis, key=k)

    @jax.custom_vjp
    def enter(x, k):
      return x

    enter.defvjp(lambda x, k: (x, k), lambda k, g: (reduce(g, k), None))

    @jax.custom_vjp
    def exit_(x, k):
      return reduce(x, k)

    exit_.defvjp(lambda x, k: (reduce(x, k), None), lambda _, g: (g, None))
    self.enter = lambda x: enter(x, coll.draw(f"{axis}.backward", axis, "all_reduce"))
    self.exit = lambda x: exit_(x, coll.draw(f"{axis}.forward", axis, "all_reduce"))

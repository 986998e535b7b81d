"""The body of :func:`jcoccl.value_and_grad`'s data-manual region: gather, local gradient,
data-axis sums.

Every list here is one entry per leaf of the differentiated arguments (flattened in
``jax.tree_util`` order): its data placement (``None``: replicated over the data axes;
``(dim, axes)``: sharded on ``dim`` over all data axes (FSDP) or a subset of them (HSDP)),
its spec over the other mesh axes, and its error-feedback state.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jcoccl._src.base import config as _config
from jcoccl._src.base.axes import match_vma, vma_of
from jcoccl._src.integrations.gspmd_trace import Region
from jcoccl._src.ops import residuals
from jcoccl._src.ops.all_gather import all_gather
from jcoccl._src.ops.all_reduce import all_reduce
from jcoccl._src.ops.error_feedback import error_feedback as _error_feedback
from jcoccl._src.ops.reduce_scatter import reduce_scatter
from jcoccl.policy import Policy

Place = tuple[int, tuple[str, ...]] | None

_OPS = ("all_reduce", "reduce_scatter", "all_gather")


@dataclasses.dataclass(frozen=True)
class OpPlan:
  """What one data-axis op runs with: its compressor and keyword options."""

  compressor: Any
  options: tuple[tuple[str, Any], ...]

  def kw(self) -> dict[str, Any]:
    return dict(self.options)


def make_plans(
  axes: tuple[str, ...],
  compressor: Any,
  gather_compressor: Any,
  policy: Policy | None,
  options: dict[str, Any],
) -> tuple[tuple[str, OpPlan], ...]:
  """Each op's compressor and options: from ``policy`` (per axis and op) or the arguments."""
  if policy is None:
    given = {k: v for k, v in options.items() if v is not None}
    # ``algorithm`` names all_reduce's (two_shot...); the other ops keep their own default.
    gather = {k: v for k, v in given.items() if k != "algorithm"}
    return (
      ("all_reduce", OpPlan(compressor, tuple(sorted(given.items())))),
      ("reduce_scatter", OpPlan(compressor, tuple(sorted(gather.items())))),
      ("all_gather", OpPlan(gather_compressor, tuple(sorted(gather.items())))),
    )
  if not isinstance(policy, Policy):
    raise TypeError(f"policy must be a jcoccl.Policy, got {type(policy).__name__}")
  if compressor is not None or gather_compressor is not None:
    raise ValueError("policy: give either policy= or compressor=/gather_compressor=, not both")
  plans = []
  for op in _OPS:
    seen = {(repr(policy.compressor(a, op)), repr(policy.options(a, op))) for a in axes}
    if len(seen) > 1:
      raise ValueError(
        f"policy: the data axes {axes} name different settings for {op}; give them one entry"
      )
    kw = dict(policy.options(axes[0], op), **{k: v for k, v in options.items() if v is not None})
    if op == "all_gather":
      kw.pop("algorithm", None)
    plans.append((op, OpPlan(policy.compressor(axes[0], op), tuple(sorted(kw.items())))))
  return tuple(plans)


@dataclasses.dataclass
class Layout:
  """Per leaf of the differentiated arguments: data placement and spec over other axes."""

  places: list[Place]
  rest: list[Any] | None  # None: the ops see whole leaves (specs unknown)
  others: frozenset


class Local:
  """The region's body (see the module docstring)."""

  def __init__(self, g: Any, n: int, layout: Layout, program: Any):
    self.g, self.n, self.layout = g, n, layout
    self.closed, self.out_tree, self.args_tree, self.diff_pos, self.batch_pos = program
    self.region = Region(g.axes)

  def __call__(self, flat: list, state: list, consts: list) -> tuple:
    g = self.g
    params = [flat[i] for i in self.diff_pos]
    full = self._gather(params)
    inputs = list(flat)
    for i, x in zip(self.diff_pos, full):
      inputs[i] = x
    (loss, aux), grads = self._accumulated(inputs, consts)
    loss = lax.pmean(loss, g.axes)
    aux = jax.tree_util.tree_map(self._reduce_aux, aux)
    grads = [match_vma(x, frozenset(g.axes)) for x in jax.tree_util.tree_leaves(grads)]
    grads, state = self._sync(grads, state)
    return (loss, aux), grads, state

  # -- parameters ------------------------------------------------------------------------

  def _blockwise(self, fn: Callable[..., Any], idx: Sequence[int], *lists: list) -> Any:
    """``fn(*lists)`` manual over the other mesh axes too, leaf k blocked as rest[idx[k]]."""
    lay = self.layout
    if lay.rest is None or not lay.others:
      return fn(*lists)
    specs = [lay.rest[i] for i in idx]
    return jax.shard_map(
      fn,
      in_specs=(specs,) * len(lists),
      out_specs=(specs,) * len(lists) if len(lists) > 1 else specs,
      axis_names=set(lay.others),
    )(*lists)

  def _gather(self, params: list) -> list:
    """The parameters whole on every data shard (FSDP / HSDP leaves all-gathered)."""
    out = [
      match_vma(p, frozenset(self.g.axes)) if place is None else None
      for p, place in zip(params, self.layout.places)
    ]
    # Replicated leaves are marked varying: the program's values are then per shard.
    sharded = [i for i, place in enumerate(self.layout.places) if place is not None]
    where = [place for place in self.layout.places if place is not None]
    if sharded:
      plan = self.g._plan("all_gather")

      def gather(xs: list) -> list:
        return [
          all_gather(
            x, place[1], axis=place[0], tiled=True, compressor=plan.compressor, **plan.kw()
          )
          for x, place in zip(xs, where)
        ]

      for i, x in zip(sharded, self._blockwise(gather, sharded, [params[i] for i in sharded])):
        out[i] = match_vma(x, frozenset(self.g.axes))
    return out

  # -- the local program -----------------------------------------------------------------

  def _run(self, inputs: list, consts: list) -> tuple:
    outs = self.region.run(self.closed, consts, inputs)
    return jax.tree_util.tree_unflatten(self.out_tree, outs)

  def _accumulated(self, inputs: list, consts: list) -> tuple:
    """Loss and gradient of the local batch, summed over micro-batches with one sync."""
    g, k = self.g, self.g.accumulate
    if k == 1:
      return self._run(inputs, consts)
    batch = set(self.batch_pos)
    micro = [
      x.reshape(k, -1, *x.shape[1:]) if i in batch and x.ndim else x for i, x in enumerate(inputs)
    ]

    def one(j: jax.Array) -> tuple:
      return self._run([x[j] if i in batch and x.ndim else x for i, x in enumerate(micro)], consts)

    (loss0, aux0), grads0 = jax.eval_shape(one, 0)
    f32 = lambda t: jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, jnp.float32), t)
    init = (jnp.zeros((), jnp.float32), f32(aux0), f32(grads0))
    init = jax.tree_util.tree_map(lambda z: match_vma(z, frozenset(g.axes)), init)

    def body(carry: tuple, j: jax.Array) -> tuple:
      (loss, aux), grads = one(j)
      add = lambda acc, x: match_vma(acc + x.astype(jnp.float32), frozenset(g.axes))
      return jax.tree_util.tree_map(add, carry, (loss, aux, grads)), None

    (loss, aux, grads), _ = lax.scan(body, init, jnp.arange(k))

    def cast(t: Any, like: Any) -> Any:
      # Means over the micro-batches; integer aux leaves (counts) stay sums.
      return jax.tree_util.tree_map(
        lambda x, s: (x if jnp.issubdtype(s.dtype, jnp.integer) else x / k).astype(s.dtype),
        t,
        like,
      )

    return (cast(loss, loss0), cast(aux, aux0)), cast(grads, grads0)

  def _reduce_aux(self, x: Any) -> Any:
    if jnp.issubdtype(jnp.result_type(x), jnp.inexact):
      return lax.pmean(x, self.g.axes)
    return lax.psum(x, self.g.axes)

  # -- the data-axis sums ----------------------------------------------------------------

  def _sync(self, grads: list, states: list) -> tuple[list, list]:
    """Sum over the data axes (all_reduce, reduce_scatter, or both for HSDP), / n."""
    g = self.g
    # A state leaf is (1, *s) here (its data shard); a pair of them for HSDP leaves.
    local = residuals.local(states) if g.error_feedback else [None] * len(grads)
    out, kept = [None] * len(grads), [None] * len(grads)
    groups: dict[Place, list[int]] = {}
    for i, place in enumerate(self.layout.places):
      groups.setdefault(place, []).append(i)
    for place, idx in groups.items():
      summed, left = self._blockwise(
        lambda xs, es, place=place: self._level(place, xs, es),
        idx,
        [grads[i] for i in idx],
        [local[i] for i in idx],
      )
      for i, s, e in zip(idx, summed, left):
        out[i], kept[i] = (s / self.n).astype(grads[i].dtype), residuals.stacked(e)
    return out, kept if g.error_feedback else []

  def _level(self, place: Place, xs: list, states: list) -> tuple[list, list]:
    """One group's sums: all_reduce (replicated), reduce_scatter (FSDP) or both (HSDP)."""
    axes = self.g.axes
    if place is None:
      return self._all_reduce(axes, xs, states)
    dim, over = place
    if over == axes:
      return self._op("reduce_scatter", over, dim, xs, states)
    rest = tuple(a for a in axes if a not in over)
    # HSDP: reduce-scatter over the sharding axes, then all-reduce the shard over the rest;
    # each level keeps its own residual (a pair per leaf in the state).
    first = [None if e is None else e[0] for e in states]
    second = [None if e is None else e[1] for e in states]
    nbytes = [_nbytes(x) for x in xs]
    shards, kept1 = self._op("reduce_scatter", over, dim, xs, first)
    summed, kept2 = self._all_reduce(rest, shards, second, nbytes)
    if states[0] is None:
      return summed, [None] * len(xs)
    return summed, list(zip(kept1, kept2))

  def _all_reduce(
    self, axes: tuple, xs: list, states: list, nbytes: list | None = None
  ) -> tuple[list, list]:
    """all_reduce of whole leaves; a leaf the other manual axes replicate is cut 1/m."""
    nbytes = nbytes or [_nbytes(x) for x in xs]
    cut = [self._split(x, e) for x, e in zip(xs, states)]
    summed, kept = self._op(
      "all_reduce", axes, None, [c[0] for c in cut], [c[1] for c in cut], nbytes
    )
    out = [self._join(s, x, c[2]) for s, x, c in zip(summed, xs, cut)]
    left = [None if e is None else self._join(e, x, c[2]) for e, x, c in zip(kept, xs, cut)]
    return out, left

  def _split(self, x: jax.Array, state: Any) -> tuple:
    """This device's 1/m of a leaf that the other manual axes replicate.

    As the partitioner does for such gradients, each of their devices reduces 1/m of it
    over the data axes and the slices are all-gathered back exactly, instead of m devices
    sending the same whole leaf.
    """
    lay = self.layout
    over = tuple(sorted(lay.others - vma_of(x))) if lay.rest is not None else ()
    m = math.prod(lax.axis_size(a) for a in over)
    if m == 1:
      return x, state, None
    size = -(-x.size // m)
    i = lax.axis_index(over)

    def take(v: jax.Array) -> jax.Array:
      flat = jnp.pad(v.reshape(-1), (0, size * m - v.size))
      return lax.dynamic_slice(flat, (i * size,), (size,))

    return take(x), None if state is None else take(state), over

  def _join(self, part: jax.Array, like: jax.Array, over: Any) -> jax.Array:
    if over is None:
      return part
    whole = lax.all_gather(part, over, tiled=True, to="invarying")
    return whole[: like.size].reshape(like.shape)

  def _op(
    self, op: str, axes: tuple, dim: Any, xs: list, states: list, nbytes: list | None = None
  ) -> tuple[list, list]:
    """One jcoccl op over ``xs``; ``min_bytes`` applies to each whole leaf (``nbytes``,
    before any cut), and the leaves of one call are packed by the op itself
    (:func:`jcoccl._src.ops.primitives.lower_leaves`)."""
    plan = self.g._plan(op)
    kw = plan.kw()
    if op == "reduce_scatter":
      kw.update(scatter_dimension=dim, tiled=True)
    given = kw.pop("min_bytes", None)
    floor = _config.current().min_bytes if given is None else given
    nbytes = nbytes or [_nbytes(x) for x in xs]
    out, kept = [None] * len(xs), [None] * len(xs)
    small = [i for i in range(len(xs)) if nbytes[i] < floor]
    big = [i for i in range(len(xs)) if nbytes[i] >= floor]
    for idx, mb in ((big, 0), (small, given)):
      if idx:
        ys, es = self._call(
          op,
          axes,
          plan.compressor,
          [xs[i] for i in idx],
          [states[i] for i in idx],
          dict(kw, min_bytes=mb),
        )
        for i, y, e in zip(idx, ys, es):
          out[i], kept[i] = y, e
    return out, kept

  def _call(
    self, op: str, axes: tuple, comp: Any, xs: list, states: list, kw: dict
  ) -> tuple[list, list]:
    if not self.g.error_feedback:
      fn = all_reduce if op == "all_reduce" else reduce_scatter
      return list(fn(xs, axes, compressor=comp, **kw)), [None] * len(xs)
    ef = _error_feedback(comp)
    fn = ef.all_reduce if op == "all_reduce" else ef.reduce_scatter
    summed, kept = fn(xs, list(states), axes, **kw)
    return list(summed), list(kept)


def _nbytes(x: jax.Array) -> int:
  return x.size * jnp.dtype(x.dtype).itemsize

"""Compressed data-parallel gradients inside jit programs sharded by the compiler (GSPMD).

:func:`value_and_grad` is ``jax.value_and_grad`` for a program whose batch is sharded over
data axes of the mesh while its other axes (tensor, FSDP over ``model``, ...) stay with the
partitioner. Underneath, a ``jax.shard_map`` manual only over the data axes runs ``fun`` on
each data shard's slice of the batch; the local gradients are then summed with jcoccl's
all_reduce (or reduce_scatter for parameters sharded over data too) and divided by the
number of shards, so the result is the gradient of the mean loss, as the original program's.

Inside the manual region, parameters that the data axes replicate arrive whole (spec ``P()``
over those axes) and are marked varying before differentiation: their gradient is then the
shard's own, not one the transpose of an implicit broadcast would already have summed
exactly. Parameters sharded over a data axis (``param_specs``) are all-gathered first
(optionally compressed: ZeRO++'s qwZ), the gradient of the gathered copy is
reduce-scattered back to the shard, and the master weights stay the exact shards.

Example:
  >>> grad_fn = jcoccl.value_and_grad(loss_fn, "data", compressor="int8",  # doctest: +SKIP
  ...                                 error_feedback=True, min_bytes=0)
  >>> ef = grad_fn.init(params)                      # in the train state, checkpointed
  >>> (loss, grads), ef = grad_fn(params, batch, state=ef)   # inside jax.jit
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jcoccl._src import _compat
from jcoccl._src.all_gather import all_gather
from jcoccl._src.all_reduce import all_reduce
from jcoccl._src.axes import match_vma, vma_of
from jcoccl._src.error_feedback import error_feedback as _error_feedback
from jcoccl._src.reduce_scatter import reduce_scatter
from jcoccl.policy import Policy

_OPS = ("all_reduce", "reduce_scatter", "all_gather")


def _spec_entry(axes: tuple[str, ...]) -> Any:
  """How a PartitionSpec names ``axes`` on one dimension: the name, or the tuple."""
  return axes[0] if len(axes) == 1 else axes


def _up_to(treedef: Any, tree: Any) -> list:
  """The subtrees of ``tree`` at the leaves of ``treedef`` (a prefix of it)."""
  return treedef.flatten_up_to(tree)


@dataclasses.dataclass(frozen=True)
class _OpPlan:
  """What one data-axis op runs with: its compressor and keyword options."""

  compressor: Any
  options: tuple[tuple[str, Any], ...]

  def kw(self) -> dict[str, Any]:
    return dict(self.options)


def _data_axes(axes: Any) -> tuple[str, ...]:
  names = tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)
  if not names or not all(isinstance(a, str) for a in names) or len(set(names)) != len(names):
    raise ValueError(f"axes must be a mesh axis name or a tuple of distinct names, got {axes!r}")
  return names


def _argnums(argnums: Any) -> tuple[int, ...]:
  nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
  if not nums or not all(isinstance(i, int) and i >= 0 for i in nums):
    raise ValueError(f"argnums must be a non-negative int or a tuple of them, got {argnums!r}")
  return nums


def _strip(spec: Any, axes: tuple[str, ...], keep: bool) -> P:
  """``spec`` with, per dimension, only the names in ``axes`` (keep) or only the others."""
  out = []
  for entry in tuple(spec):
    names = entry if isinstance(entry, tuple) else (() if entry is None else (entry,))
    names = tuple(a for a in names if (a in axes) == keep)
    out.append(None if not names else names[0] if len(names) == 1 else names)
  while out and out[-1] is None:
    out.pop()
  return P(*out)


def _scatter_dim(spec: P, axes: tuple[str, ...], where: str) -> int | None:
  """The dimension a data-only spec shards over ``axes`` (None: replicated over them)."""
  dims = [d for d, e in enumerate(spec) if e is not None]
  if not dims:
    return None
  entry = spec[dims[0]]
  names = entry if isinstance(entry, tuple) else (entry,)
  if len(dims) > 1 or tuple(names) != axes:
    raise ValueError(
      f"param_specs{where}: a parameter is sharded over the data axes {axes} on one "
      f"dimension, all of them in that order, or not at all; got {spec}"
    )
  return dims[0]


def _known_spec(x: Any) -> P | None:
  """The PartitionSpec of ``x`` where it is known before partitioning (else None)."""
  sharding = getattr(x, "sharding", None)
  if isinstance(x, jax.Array) and not _compat.is_traced(x):
    return sharding.spec if isinstance(sharding, NamedSharding) else None
  try:
    aval_sharding = jax.typeof(x).sharding
  except (TypeError, AttributeError):
    return None
  mesh = getattr(aval_sharding, "mesh", None)
  if mesh is None or mesh.empty or not mesh.are_all_axes_explicit:
    return None
  return aval_sharding.spec


@dataclasses.dataclass(frozen=True, eq=False)  # jit keys a callable by identity
class DataParallelGrad:
  """A ``jax.value_and_grad`` whose data-parallel gradient sum goes through jcoccl.

  Built by :func:`value_and_grad`. Call it like the function ``jax.value_and_grad``
  returns; with ``error_feedback`` pass the state from :meth:`init` as ``state=`` and get
  ``((value, grads), new_state)`` back.
  """

  fun: Callable[..., Any]
  axes: tuple[str, ...]
  argnums: tuple[int, ...]
  has_aux: bool
  plans: tuple[tuple[str, _OpPlan], ...]
  error_feedback: bool
  accumulate: int
  param_specs: Any
  batch_argnums: tuple[int, ...] | None
  mesh: Any

  def _plan(self, op: str) -> _OpPlan:
    return dict(self.plans)[op]

  def _mesh(self) -> Any:
    mesh = self.mesh if self.mesh is not None else jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
      raise ValueError(
        "mesh: no mesh is set; pass mesh= to jcoccl.value_and_grad or call inside "
        "jax.set_mesh(mesh)"
      )
    missing = [a for a in self.axes if a not in mesh.axis_names]
    if missing:
      raise ValueError(
        f"axes: the mesh has axes {tuple(mesh.axis_names)}, not {tuple(missing)}; name the "
        "mesh axes the batch is sharded over (e.g. axes='data')"
      )
    return mesh

  def _size(self, mesh: Any) -> int:
    return math.prod(mesh.shape[a] for a in self.axes)

  def _diff(self, args: Sequence[Any]) -> tuple:
    if max(self.argnums) >= len(args):
      raise ValueError(f"argnums {self.argnums} points past the {len(args)} arguments given")
    return tuple(args[i] for i in self.argnums)

  def _grad_tree(self, diff: tuple) -> Any:
    return diff[0] if len(self.argnums) == 1 else diff

  def _data_specs(self, grads_like: Any) -> Any:
    """Per leaf of the gradients: its spec over the data axes only (P() if replicated)."""
    if self.param_specs is None:
      return jax.tree_util.tree_map(lambda _: P(), grads_like)
    try:
      specs = jax.tree_util.tree_map(
        lambda s, _: s, self.param_specs, grads_like, is_leaf=lambda s: isinstance(s, P)
      )
    except ValueError as e:
      raise ValueError(
        f"param_specs must have the structure of the differentiated arguments: {e}"
      ) from None
    return jax.tree_util.tree_map(
      lambda s: _strip(s, self.axes, keep=True), specs, is_leaf=lambda s: isinstance(s, P)
    )

  def _rest_specs(self, grads_like: Any) -> Any:
    """Per leaf: its spec over the other mesh axes (None without ``param_specs``).

    The data-axis ops run manual over those axes too, each device on its own block: a
    codec's flat layout would otherwise make the partitioner gather the block over them.
    A scatter dimension keeps only the data axes (its blocks must be the data shards).
    """
    if self.param_specs is None:
      return None
    data = self._data_specs(grads_like)
    specs = jax.tree_util.tree_map(
      lambda s, _: s, self.param_specs, grads_like, is_leaf=lambda s: isinstance(s, P)
    )

    def rest(spec: P, dspec: P) -> P:
      dim = _scatter_dim(dspec, self.axes, "")
      entries = list(_strip(spec, self.axes, keep=False))
      if dim is not None and dim < len(entries):
        entries[dim] = None
      return P(*entries)

    return jax.tree_util.tree_map(rest, specs, data, is_leaf=lambda s: isinstance(s, P))

  def init(self, params: Any) -> Any:
    """Error-feedback state for gradients shaped like ``params`` (optax-style ``init``).

    Each data shard keeps its own float32 residual of the gradient it sends (the whole
    gradient, for all_reduce and reduce_scatter alike), so a leaf of shape ``s`` gets a
    state of shape ``(n, *s)`` sharded over the data axes on its first dimension and like
    the parameter (its spec without the data axes) on the others. Save it with the
    checkpoint: a restored run then continues bit-exactly.

    Args:
      params: the differentiated arguments (one pytree, or a tuple of them when
        ``argnums`` is a tuple), arrays or ShapeDtypeStructs.

    Returns:
      A pytree of float32 zeros, or None without ``error_feedback``.

    Example:
      >>> state = grad_fn.init(params)                              # doctest: +SKIP
    """
    if not self.error_feedback:
      return None
    mesh = self.mesh
    if mesh is None:
      leaf = next(
        (
          x
          for x in jax.tree_util.tree_leaves(params)
          if isinstance(getattr(x, "sharding", None), NamedSharding)
        ),
        None,
      )
      mesh = leaf.sharding.mesh if leaf is not None else jax.sharding.get_mesh()
    if mesh is None or mesh.empty:
      raise ValueError("init: no mesh; pass mesh= to jcoccl.value_and_grad")
    mesh = self._mesh() if self.mesh is not None else mesh
    n = self._size(mesh)

    def rest(x: Any, given: Any) -> P:
      spec = given if given is not None else _known_spec(x)
      return P() if spec is None else _strip(spec, self.axes, keep=False)

    specs = self.param_specs
    if specs is None:
      specs = jax.tree_util.tree_map(lambda _: None, params)
    shardings = jax.tree_util.tree_map(
      lambda s, x: NamedSharding(mesh, P(self.axes, *rest(x, s))),
      specs,
      params,
      is_leaf=lambda s: s is None or isinstance(s, P),
    )
    shapes = jax.tree_util.tree_map(lambda x: (n, *jnp.shape(x)), params)
    return jax.jit(
      lambda: jax.tree_util.tree_map(
        lambda s: jnp.zeros(s, jnp.float32), shapes, is_leaf=lambda s: isinstance(s, tuple)
      ),
      out_shardings=shardings,
    )()

  def __call__(self, *args: Any, state: Any = None) -> Any:
    """``(value, grads)``, or ``((value, grads), new_state)`` with error feedback.

    ``value`` is ``loss`` or ``(loss, aux)`` as in ``jax.value_and_grad``: the mean over the
    data shards of ``fun``'s loss on each shard's slice of the batch (aux leaves: floats
    averaged, integers summed).
    """
    if self.error_feedback and state is None:
      raise ValueError("state: error_feedback=True needs state=grad_fn.init(params)")
    if not self.error_feedback and state is not None:
      raise ValueError("state: given, but error_feedback is off (pass error_feedback=True)")
    mesh = self._mesh()
    n = self._size(mesh)
    self._say_replicated(mesh)
    diff = self._diff(args)
    data_specs = self._data_specs(self._grad_tree(diff))
    batch = self._batch_argnums(len(args))
    self._check_batch(args, batch, n)
    in_specs = tuple(
      (
        (data_specs if len(self.argnums) == 1 else data_specs[self.argnums.index(i)])
        if i in self.argnums
        else jax.tree_util.tree_map(lambda x: P(self.axes) if jnp.ndim(x) else P(), a)
        if i in batch
        else P()
      )
      for i, a in enumerate(args)
    )
    local = _Local(self, len(args), n, data_specs, self._rest_specs(self._grad_tree(diff)), mesh)
    out_specs = ((P(), P()) if self.has_aux else P(), data_specs, P(self.axes))
    mapped = jax.shard_map(
      local,
      mesh=self.mesh,
      in_specs=(in_specs, P(self.axes)),
      out_specs=out_specs,
      axis_names=set(self.axes),
    )
    value, grads, new_state = mapped(args, state if self.error_feedback else ())
    return ((value, grads), new_state) if self.error_feedback else (value, grads)

  def _say_replicated(self, mesh: Any) -> None:
    """Says what happens to parameters sharded over other axes when no specs are given."""
    others = tuple(a for a in mesh.axis_names if a not in self.axes and mesh.shape[a] > 1)
    if self.param_specs is None and others:
      warnings.warn(
        f"jcoccl.value_and_grad: no param_specs, so every parameter is taken as replicated "
        f"over {self.axes} and the data-axis sums see whole gradients: the compiler gathers "
        f"parameters sharded over {others} for them. Pass param_specs= (the PartitionSpecs "
        f"the parameters are sharded with, e.g. nnx.get_partition_spec(state)) to keep "
        f"each device on its own block.",
        stacklevel=3,
      )

  def _batch_argnums(self, nargs: int) -> tuple[int, ...]:
    if self.batch_argnums is None:
      return tuple(i for i in range(nargs) if i not in self.argnums)
    bad = [i for i in self.batch_argnums if i >= nargs or i in self.argnums]
    if bad:
      raise ValueError(
        f"batch_argnums {self.batch_argnums}: {bad} is past the {nargs} arguments or "
        f"differentiated (argnums={self.argnums})"
      )
    return self.batch_argnums

  def _check_batch(self, args: Sequence[Any], batch: tuple[int, ...], n: int) -> None:
    """Each batched leaf's first dimension splits over the data shards and micro-batches."""
    per = n * self.accumulate
    for i in batch:
      for path, x in jax.tree_util.tree_leaves_with_path(args[i]):
        where = f"argument {i}{jax.tree_util.keystr(path)}"
        if not jnp.ndim(x):
          continue
        if jnp.shape(x)[0] % per:
          raise ValueError(
            f"batch {where}: its first dimension ({jnp.shape(x)[0]}) must split over the "
            f"{n} shards of {self.axes}"
            + (f" and {self.accumulate} micro-batches" if self.accumulate > 1 else "")
            + "; pass non-batch arguments through batch_argnums=(...) to keep them whole"
          )
        spec = _known_spec(x)
        first = spec[0] if spec is not None and len(spec) else None
        first = first if isinstance(first, tuple) else (first,)
        if spec is not None and tuple(a for a in first if a in self.axes) != self.axes:
          raise ValueError(
            f"batch {where} is sharded as {spec}, not over {self.axes} on its first "
            f"dimension: put it with NamedSharding(mesh, P({_spec_entry(self.axes)!r}))"
          )


class _Local:
  """The body of the manual region: local loss and gradient, then the data-axis sums."""

  def __init__(
    self, g: DataParallelGrad, nargs: int, n: int, data_specs: Any, rest_specs: Any, mesh: Any
  ):
    self.g, self.nargs, self.n = g, nargs, n
    self.dims = jax.tree_util.tree_map(
      lambda s: _scatter_dim(s, g.axes, ""), data_specs, is_leaf=lambda s: isinstance(s, P)
    )
    self.rest = rest_specs
    if len(g.argnums) == 1:
      self.dims, self.rest = (self.dims,), (rest_specs,)
    self.others = frozenset(a for a in mesh.axis_names if a not in g.axes)

  def _blockwise(self, fn: Callable[..., Any], specs: Any, *trees: Any) -> Any:
    """``fn(*trees)`` manual over the other mesh axes too, leaves blocked as ``specs``."""
    if specs is None or not self.others:
      return fn(*trees)
    return jax.shard_map(
      fn,
      in_specs=(specs,) * len(trees),
      out_specs=(specs,) * len(trees) if len(trees) > 1 else specs,
      axis_names=set(self.others),
    )(*trees)

  def __call__(self, args: tuple, state: Any) -> tuple:
    g = self.g
    full = tuple(self._gather_tree(args[i], k) for k, i in enumerate(g.argnums))
    (loss, aux), grads = self._accumulated(args, full)
    loss = lax.pmean(loss, g.axes)
    aux = jax.tree_util.tree_map(self._reduce_aux, aux)
    grads, state = self._sync(grads, state)
    value = (loss, aux) if g.has_aux else loss
    return value, grads[0] if len(g.argnums) == 1 else grads, state

  def _gather_tree(self, params: Any, k: int) -> Any:
    """Argument ``argnums[k]`` whole on every data shard (FSDP leaves all-gathered)."""
    dims = self.dims[k]
    leaves, treedef = jax.tree_util.tree_flatten(params)
    dim_leaves = _up_to(treedef, dims)
    rest = None if self.rest[0] is None else _up_to(treedef, self.rest[k])
    sharded = [i for i, d in enumerate(dim_leaves) if d is not None]
    out = [self._gather(x, None) if d is None else x for x, d in zip(leaves, dim_leaves)]
    if sharded:
      gathered = self._blockwise(
        lambda xs: [self._gather(x, dim_leaves[i]) for x, i in zip(xs, sharded)],
        None if rest is None else [rest[i] for i in sharded],
        [leaves[i] for i in sharded],
      )
      for i, x in zip(sharded, gathered):
        out[i] = x
    return jax.tree_util.tree_unflatten(treedef, out)

  def _gather(self, p: jax.Array, dim: int | None) -> jax.Array:
    if dim is None:
      # Marked varying so that the gradient is this shard's own: differentiating an
      # invariant value would let the transpose of its implicit broadcast psum it.
      return match_vma(p, frozenset(self.g.axes))
    plan = self.g._plan("all_gather")
    return all_gather(p, self.g.axes, axis=dim, tiled=True, compressor=plan.compressor, **plan.kw())

  def _fun(self, args: tuple) -> Callable[..., Any]:
    g = self.g

    def f(*params: Any) -> tuple:
      call = list(args)
      for i, p in zip(g.argnums, params):
        call[i] = p
      out = g.fun(*call)
      if g.has_aux and not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise TypeError("has_aux=True: fun must return a pair (loss, aux)")
      loss, aux = out if g.has_aux else (out, None)
      if jnp.shape(loss) != ():
        raise TypeError(
          f"fun must return a scalar loss (shape ()), got shape {jnp.shape(loss)}"
          + ("" if g.has_aux else "; with auxiliary outputs pass has_aux=True")
        )
      return loss, aux

    return f

  def _accumulated(self, args: tuple, full: tuple) -> tuple:
    """Loss and gradient of the local batch, summed over micro-batches with one sync."""
    g = self.g
    batch = g._batch_argnums(self.nargs)
    vg = jax.value_and_grad(
      lambda a, *ps: self._fun(a)(*ps), argnums=tuple(range(1, len(full) + 1)), has_aux=True
    )
    if g.accumulate == 1:
      return vg(args, *full)
    k = g.accumulate
    micro = tuple(
      jax.tree_util.tree_map(lambda x: x.reshape(k, -1, *x.shape[1:]) if x.ndim else x, a)
      if i in batch
      else a
      for i, a in enumerate(args)
    )

    def one(i: jax.Array) -> tuple:
      a = tuple(
        jax.tree_util.tree_map(lambda x: x[i] if x.ndim else x, m) if j in batch else m
        for j, m in enumerate(micro)
      )
      return vg(a, *full)

    (loss0, aux0), grads0 = jax.eval_shape(one, 0)
    f32 = lambda t: jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, jnp.float32), t)
    zero = match_vma(jnp.zeros((), jnp.float32), frozenset(g.axes))
    init = (zero, f32(aux0), f32(grads0))
    init = jax.tree_util.tree_map(lambda z: match_vma(z, frozenset(g.axes)), init)

    def body(carry: tuple, i: jax.Array) -> tuple:
      (loss, aux), grads = one(i)
      add = lambda acc, x: acc + x.astype(jnp.float32)
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

  def _sync(self, grads: tuple, state: Any) -> tuple:
    """Sum over the data axes (all_reduce, or reduce_scatter per scatter dimension), / n."""
    g = self.g
    leaves, treedef = jax.tree_util.tree_flatten(grads)
    dims = _up_to(treedef, self.dims)
    if g.error_feedback:
      states = [e[0] for e in _up_to(treedef, (state,) if len(g.argnums) == 1 else state)]
    else:
      states = [None] * len(leaves)
    out, new_states = [None] * len(leaves), [None] * len(leaves)
    groups: dict[int | None, list[int]] = {}
    for i, d in enumerate(dims):
      groups.setdefault(d, []).append(i)
    rest = None if self.rest[0] is None else _up_to(treedef, self.rest)
    for d, idx in groups.items():
      op = "all_reduce" if d is None else "reduce_scatter"
      summed, kept = self._blockwise(
        lambda xs, es, op=op, d=d: self._sum(op, d, xs, es),
        None if rest is None else [rest[i] for i in idx],
        [leaves[i] for i in idx],
        [states[i] for i in idx],
      )
      for i, s, e in zip(idx, summed, kept):
        out[i] = (s / self.n).astype(leaves[i].dtype)
        new_states[i] = None if e is None else e[None]
    grads = jax.tree_util.tree_unflatten(treedef, out)
    if not g.error_feedback:
      return grads, ()
    new = jax.tree_util.tree_unflatten(treedef, new_states)
    return grads, new[0] if len(g.argnums) == 1 else new

  def _sum(self, op: str, dim: int | None, xs: list, states: list) -> tuple[list, list]:
    """One data-axis op over ``xs``; all_reduce leaves go in buckets (dtype, varying axes)."""
    if op != "all_reduce":
      return self._op(op, dim, xs, states)
    # One flat message per dtype, as DDP's buckets: each op pays a dispatch and each leaf
    # its codec's padding, which for many small leaves cost more than the bytes saved.
    # Leaves are bucketed with those that vary over the same manual axes (a bucket of
    # blocks of model-sharded and model-replicated leaves would vary over 'model' whole).
    groups: dict[Any, list[int]] = {}
    for i, x in enumerate(xs):
      groups.setdefault((jnp.dtype(x.dtype), vma_of(x)), []).append(i)
    idx = list(groups.values())
    flat = [jnp.concatenate([xs[i].reshape(-1) for i in group]) for group in idx]
    flat_states = [
      None if states[group[0]] is None else jnp.concatenate([states[i].reshape(-1) for i in group])
      for group in idx
    ]
    split = [self._split(f, e) for f, e in zip(flat, flat_states)]
    summed, kept = self._op(op, dim, [f for f, _, _ in split], [e for _, e, _ in split])
    summed = [self._join(x, f, how) for x, f, (_, _, how) in zip(summed, flat, split)]
    kept = [
      None if e is None else self._join(e, f, how) for e, f, (_, _, how) in zip(kept, flat, split)
    ]
    out, out_states = [None] * len(xs), [None] * len(xs)
    for group, s, e in zip(idx, summed, kept):
      offsets = np.cumsum([0] + [xs[i].size for i in group])
      for i, a, b in zip(group, offsets[:-1], offsets[1:]):
        out[i] = s[a:b].reshape(xs[i].shape)
        out_states[i] = None if e is None else e[a:b].reshape(xs[i].shape)
    return out, out_states

  def _split(self, flat: jax.Array, state: Any) -> tuple:
    """This device's slice of a bucket that the other manual axes replicate.

    As the partitioner does for such gradients, each of their devices reduces 1/m of it
    over the data axes and the slices are all-gathered back exactly, instead of m devices
    sending the same whole bucket.
    """
    over = tuple(sorted(self.others - vma_of(flat))) if self.rest[0] is not None else ()
    m = math.prod(lax.axis_size(a) for a in over)
    if m == 1:
      return flat, state, None
    size = -(-flat.size // m)
    i = lax.axis_index(over)
    cut = lambda v: lax.dynamic_slice(jnp.pad(v, (0, size * m - v.size)), (i * size,), (size,))
    return cut(flat), None if state is None else cut(state), over

  def _join(self, part: jax.Array, like: jax.Array, over: Any) -> jax.Array:
    if over is None:
      return part
    return lax.all_gather(part, over, tiled=True, to="invarying")[: like.size]

  def _op(self, op: str, dim: int | None, xs: list, states: list) -> tuple[list, list]:
    g = self.g
    plan = g._plan(op)
    kw = plan.kw()
    if op == "reduce_scatter":
      kw.update(scatter_dimension=dim, tiled=True)
    if not g.error_feedback:
      fn = all_reduce if op == "all_reduce" else reduce_scatter
      return list(fn(xs, g.axes, compressor=plan.compressor, **kw)), [None] * len(xs)
    ef = _error_feedback(plan.compressor)
    fn = ef.all_reduce if op == "all_reduce" else ef.reduce_scatter
    summed, kept = fn(xs, list(states), g.axes, **kw)
    return list(summed), list(kept)


def _plans(
  axes: tuple[str, ...],
  compressor: Any,
  gather_compressor: Any,
  policy: Policy | None,
  options: dict[str, Any],
) -> tuple[tuple[str, _OpPlan], ...]:
  """Each op's compressor and options: from ``policy`` (per axis and op) or the arguments."""
  if policy is None:
    given = {k: v for k, v in options.items() if v is not None}
    # ``algorithm`` names all_reduce's (two_shot...); the other ops keep their own default.
    gather = {k: v for k, v in given.items() if k != "algorithm"}
    return (
      ("all_reduce", _OpPlan(compressor, tuple(sorted(given.items())))),
      ("reduce_scatter", _OpPlan(compressor, tuple(sorted(gather.items())))),
      ("all_gather", _OpPlan(gather_compressor, tuple(sorted(gather.items())))),
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
    plans.append((op, _OpPlan(policy.compressor(axes[0], op), tuple(sorted(kw.items())))))
  return tuple(plans)


def value_and_grad(
  fun: Callable[..., Any],
  axes: str | Sequence[str] = "data",
  *,
  compressor: Any = None,
  gather_compressor: Any = None,
  policy: Policy | None = None,
  argnums: int | Sequence[int] = 0,
  has_aux: bool = False,
  error_feedback: bool = False,
  accumulate: int = 1,
  param_specs: Any = None,
  batch_argnums: Sequence[int] | None = None,
  mesh: Any = None,
  algorithm: str | None = None,
  min_bytes: int | None = None,
  chunks: int | None = None,
) -> DataParallelGrad:
  """``jax.value_and_grad`` with the data-parallel gradient sum compressed by jcoccl.

  For use inside ``jax.jit`` on a mesh whose data axes shard the batch; the program's other
  axes stay automatic (their sharding is the compiler's, as before). ``fun`` sees one data
  shard's slice of the batch; the value is the mean of the shards' losses and the gradient
  the mean of their gradients, i.e. those of the mean loss over the whole batch.

  Args:
    fun: ``fun(*args) -> loss`` (or ``(loss, aux)`` with ``has_aux``); loss a scalar.
    axes: the mesh axis (or tuple of axes) the batch is sharded over.
    compressor: codec of the gradient all_reduce / reduce_scatter over ``axes``: a
      Compressor, a spec string (``"int8"``, ``"auto:int8"``, ``"none"``) or None (exact);
      passed to :func:`jcoccl.all_reduce` / :func:`jcoccl.reduce_scatter` unchanged.
    gather_compressor: codec of the all_gather of parameters sharded over ``axes`` (qwZ);
      None gathers exactly. The parameters themselves (master weights) stay exact.
    policy: a :class:`jcoccl.Policy` instead of the two compressors: its entries for the
      data axes (``all_reduce``, ``reduce_scatter``, ``all_gather``, ``min_bytes``,
      ``algorithm``) apply.
    argnums: which positional arguments to differentiate (int or tuple), as in JAX.
    has_aux: ``fun`` returns ``(loss, aux)``; aux leaves are averaged over the shards
      (inexact dtypes) or summed (integer counts).
    error_feedback: keep each shard's compression residual in an explicit state
      (:meth:`DataParallelGrad.init`) passed as ``state=`` and returned updated.
    accumulate: split each shard's batch into this many micro-batches, add their
      gradients (in float32) and sync once.
    param_specs: PartitionSpecs of the differentiated arguments (a matching pytree, as
      given to NamedSharding). A leaf whose spec shards one dimension over ``axes`` is
      FSDP: all-gathered for ``fun`` and its gradient reduce-scattered back. None: every
      parameter replicated over ``axes``.
    batch_argnums: the positional arguments whose leaves are split over ``axes`` on their
      first dimension; default: all that are not differentiated. Others pass whole.
    mesh: the mesh; default: the one set by ``jax.set_mesh``.
    algorithm: the all_reduce algorithm (default: its own, "auto"); reduce_scatter and
      all_gather keep theirs.
    min_bytes: leaves smaller than this go exactly (default: the ops' own, 4 MiB).
    chunks: as in :func:`jcoccl.all_reduce`.

  Returns:
    A :class:`DataParallelGrad`: ``grad_fn(*args)`` gives ``(value, grads)``; with
    ``error_feedback``, ``grad_fn(*args, state=s)`` gives ``((value, grads), new_state)``.

  Raises:
    ValueError: ``axes`` not in the mesh, a batch whose first dimension does not split over
      them or that is sharded otherwise, bad ``param_specs`` / ``accumulate`` / ``state``.
    TypeError: ``fun``'s loss is not a scalar.

  Example:
    >>> grad_fn = jcoccl.value_and_grad(loss_fn, "data", compressor="int8",  # doctest: +SKIP
    ...                                 algorithm="two_shot", min_bytes=0)
    >>> loss, grads = jax.jit(grad_fn)(params, batch)
  """
  if not callable(fun):
    raise TypeError(f"fun must be callable, got {type(fun).__name__}")
  if not isinstance(accumulate, int) or accumulate < 1:
    raise ValueError(f"accumulate must be a positive int, got {accumulate!r}")
  data_axes = _data_axes(axes)
  options = {"algorithm": algorithm, "min_bytes": min_bytes, "chunks": chunks}
  plans = _plans(data_axes, compressor, gather_compressor, policy, options)
  if error_feedback:
    for op, plan in plans:
      if op != "all_gather":
        _error_feedback(plan.compressor)  # a stochastic codec fails here, not at trace time
  return DataParallelGrad(
    fun=fun,
    axes=data_axes,
    argnums=_argnums(argnums),
    has_aux=has_aux,
    plans=plans,
    error_feedback=bool(error_feedback),
    accumulate=accumulate,
    param_specs=param_specs,
    batch_argnums=None if batch_argnums is None else tuple(batch_argnums),
    mesh=mesh,
  )

"""Compressed data-parallel gradients inside jit programs sharded by the compiler (GSPMD).

:func:`value_and_grad` is ``jax.value_and_grad`` for a program whose batch is sharded over
data axes of the mesh while its other axes stay with the partitioner. ``fun``'s gradient is
traced on one data shard's slice of the batch, as the program's own code
(:mod:`jcoccl._src.integrations.gspmd_trace`), and run inside a ``jax.shard_map`` manual only over the
data axes (:mod:`jcoccl._src.integrations.gspmd_local`); the local gradients are then summed with
jcoccl's all_reduce (reduce_scatter for FSDP parameters, both for HSDP) and divided by the
number of shards: the gradient of the mean loss, as the original program's. Parameter
specs are read and checked by :mod:`jcoccl._src.integrations.gspmd_specs`.

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
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jcoccl._src import _compat
from jcoccl._src.compressors.compressor_args import stochastic_codec
from jcoccl._src.integrations import gspmd_specs as S
from jcoccl._src.integrations.gspmd_local import Layout, Local, OpPlan, make_plans
from jcoccl._src.integrations.gspmd_trace import (
  aval_of,
  check_batch_given,
  check_closure,
  local_aval,
  loss_of,
  positions,
  trace,
)
from jcoccl._src.ops import residuals
from jcoccl._src.ops.error_feedback import error_feedback as _error_feedback
from jcoccl.policy import Policy


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
  plans: tuple[tuple[str, OpPlan], ...]
  error_feedback: bool
  accumulate: int
  param_specs: Any
  batch_argnums: tuple[int, ...] | None
  mesh: Any
  replicated_closure: bool = False

  def _plan(self, op: str) -> OpPlan:
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

  def _layout(self, diff: Any, mesh: Any) -> tuple[list[P], Layout]:
    """Per leaf of the differentiated arguments: its spec, data placement and other axes.

    Specs come from ``param_specs`` (checked) or, omitted, from the arrays; a leaf whose
    spec is unknown (under ``jax.jit`` on Auto axes) is taken as replicated, and then the
    ops see whole gradients (the warning of :meth:`_say_replicated`).
    """
    tree = self._grad_tree(diff)
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    specs = S.resolve(self.param_specs, tree, mesh)
    known = self.param_specs is not None or all(S.known_spec(x) is not None for _, x in leaves)
    places = [
      S.data_dim(s, self.axes, f"param_specs{jax.tree_util.keystr(p)}")
      for s, (p, _) in zip(specs, leaves)
    ]
    others = frozenset(a for a in mesh.axis_names if a not in self.axes)
    rest = None
    if known:
      rest = []
      for s, place in zip(specs, places):
        entries = list(S.strip(s, self.axes, keep=False))
        if place is not None and place[0] < len(entries):
          entries[place[0]] = None  # a scatter dimension's blocks are the data shards
        rest.append(P(*entries))
    self._say_replicated(mesh, known)
    return specs, Layout(places, rest, others)

  def init(self, params: Any) -> Any:
    """Error-feedback state for gradients shaped like ``params`` (optax-style ``init``).

    Each data shard keeps its own float32 residual of the gradient it sends (the whole
    gradient, for all_reduce and reduce_scatter alike), so a leaf of shape ``s`` gets a
    state of shape ``(n, *s)`` sharded over the data axes on its first dimension and like
    the parameter (its spec without the data axes) on the others. An HSDP leaf (sharded
    over a subset of the data axes) gets a pair: that, and ``(n, *shard)`` for the
    all-reduce of its shard over the other data axes. Save it with the checkpoint: a
    restored run then continues bit-exactly. Works eagerly and inside ``jax.jit`` (the
    state then carries the sharding the step expects).

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
    mesh = self._init_mesh(params)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    specs = S.resolve(self.param_specs, params, mesh)
    # Level one sends whole gradients: the data axes do not split its residuals. HSDP's
    # second level all-reduces the shard over the other data axes: its residual is the shard.
    hsdp = [
      i for i, s in enumerate(specs) if self._is_hsdp(S.data_dim(s, self.axes, "param_specs"))
    ]
    whole = [S.strip(s, self.axes, keep=False) for s in specs]
    zeros = residuals.init(
      leaves + [leaves[i] for i in hsdp], mesh, self.axes, whole + [specs[i] for i in hsdp]
    )
    out = zeros[: len(leaves)]
    for i, shard in zip(hsdp, zeros[len(leaves) :]):
      out[i] = (out[i], shard)
    return jax.tree_util.tree_unflatten(treedef, out)

  def _is_hsdp(self, place: Any) -> bool:
    """A leaf sharded over some of the data axes, not all (a pair of residuals)."""
    return place is not None and place[1] != self.axes

  def _init_mesh(self, params: Any) -> Any:
    """The mesh for :meth:`init`: given, the arrays', or the context's (also inside jit)."""
    if self.mesh is not None:
      return self._mesh()
    for x in jax.tree_util.tree_leaves(params):
      sharding = getattr(x, "sharding", None)
      if not _compat.is_traced(x) and isinstance(sharding, NamedSharding):
        return sharding.mesh
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
      raise ValueError(
        "init: no mesh; pass mesh= to jcoccl.value_and_grad, call init inside "
        "jax.set_mesh(mesh), or pass arrays that carry their NamedSharding"
      )
    return mesh

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
    diff = self._diff(args)
    specs, layout = self._layout(diff, mesh)
    batch = self._batch_argnums(len(args))
    self._check_batch(args, batch, n)
    flat, args_tree = jax.tree_util.tree_flatten(list(args))
    pos = positions(args, args_tree)
    diff_pos = [i for a in self.argnums for i in pos[a]]
    batch_pos = [i for a in batch for i in pos[a]]
    closed, out_tree = self._trace(args, flat, args_tree, diff_pos, batch_pos, n, mesh)
    rows = next((jnp.shape(flat[i])[0] for i in batch_pos if jnp.ndim(flat[i])), None)
    if not self.replicated_closure:
      check_closure(self.fun, closed.consts, self.axes, rows)
    check_batch_given(self.fun, closed.consts, rows is not None)
    in_specs = [P() for _ in flat]
    for i, s in zip(diff_pos, specs):
      in_specs[i] = S.strip(s, self.axes, keep=True)
    for i in batch_pos:
      in_specs[i] = P(self.axes) if jnp.ndim(flat[i]) else P()
    program = (closed, out_tree, args_tree, diff_pos, batch_pos)
    local = Local(self, n, layout, program)
    grad_tree = jax.tree_util.tree_structure(self._grad_tree(diff))
    states = [] if not self.error_feedback else self._states(grad_tree, state, layout)
    state_specs = [jax.tree_util.tree_map(lambda _: P(self.axes), e) for e in states]
    consts = list(closed.consts)
    mapped = jax.shard_map(
      local,
      mesh=self.mesh,
      in_specs=(in_specs, state_specs, [P()] * len(consts)),
      out_specs=(
        (P(), P()),
        [S.strip(s, self.axes, keep=True) for s in specs],
        state_specs,
      ),
      axis_names=set(self.axes),
    )
    (loss, aux), grads, new_states = mapped(flat, states, consts)
    grads = jax.tree_util.tree_unflatten(grad_tree, grads)
    value = (loss, aux) if self.has_aux else loss
    if not self.error_feedback:
      return value, grads
    return (value, grads), jax.tree_util.tree_unflatten(grad_tree, new_states)

  def _states(self, grad_tree: Any, state: Any, layout: Layout) -> list:
    """The error-feedback state per leaf, checked against the leaves' placement."""
    try:
      states = grad_tree.flatten_up_to(state)
    except (ValueError, TypeError) as err:
      raise ValueError(f"state: not the structure grad_fn.init(params) gives: {err}") from None
    for e, place in zip(states, layout.places):
      if isinstance(e, tuple) != self._is_hsdp(place):
        raise ValueError(
          "state: made for other parameter placements than this call's (an HSDP leaf has a "
          "pair of residuals): build it with grad_fn.init(params) from the same "
          "param_specs (under jax.jit on Auto axes, pass param_specs= to both)"
        )
    return states

  def _trace(
    self,
    args: tuple,
    flat: list,
    args_tree: Any,
    diff_pos: list,
    batch_pos: list,
    n: int,
    mesh: Any,
  ) -> tuple[Any, Any]:
    """``value_and_grad(fun)`` traced on one data shard's (micro-)batch, outside the region."""
    per = n * self.accumulate
    avals = [aval_of(x) for x in flat]
    for i in batch_pos:
      avals[i] = local_aval(avals[i], per, self.axes)
    argnums = self.argnums

    def vg(*leaves: Any) -> Any:
      call = jax.tree_util.tree_unflatten(args_tree, list(leaves))

      def f(*params: Any) -> tuple:
        full = list(call)
        for i, p in zip(argnums, params):
          full[i] = p
        return loss_of(self.fun(*full), self.has_aux)

      vgf = jax.value_and_grad(f, argnums=tuple(range(len(argnums))), has_aux=True)
      (loss, aux), grads = vgf(*[call[i] for i in argnums])
      return (loss, aux), list(grads)

    context = jax.sharding.get_abstract_mesh()
    if context is None or context.empty:
      with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        return trace(vg, avals)
    return trace(vg, avals)

  def _say_replicated(self, mesh: Any, known: bool) -> None:
    """Says what happens to parameters sharded over other axes when no specs are known."""
    others = tuple(a for a in mesh.axis_names if a not in self.axes and mesh.shape[a] > 1)
    if not known and others:
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
        spec = S.known_spec(x)
        first = spec[0] if spec is not None and len(spec) else None
        first = first if isinstance(first, tuple) else (first,)
        if spec is not None and tuple(a for a in first if a in self.axes) != self.axes:
          raise ValueError(
            f"batch {where} is sharded as {spec}, not over {self.axes} on its first "
            f"dimension: put it with NamedSharding(mesh, P({S.spec_entry(self.axes)!r}))"
          )


def _refuse_stochastic(plans: Sequence[tuple[str, OpPlan]], by_policy: bool) -> None:
  """ValueError for a stochastic-rounding codec: it draws from a PRNG key per call, and
  the gradient function takes none (its arguments are the user's function's)."""
  for op, plan in plans:
    c = stochastic_codec(plan.compressor)
    if c is not None:
      arg = "policy" if by_policy else "gather_compressor" if op == "all_gather" else "compressor"
      raise ValueError(
        f"{arg}: {c} rounds stochastically, which needs a PRNG key per call, and "
        "jcoccl.value_and_grad takes none. Use a round-to-nearest codec (with "
        "error_feedback=True its rounding error is carried into the next step), or call "
        f"jcoccl.{op}(..., key=) inside a jax.shard_map"
      )


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
  replicated_closure: bool = False,
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
      Round-to-nearest codecs only: a stochastic one needs a PRNG key per call, which this
      function does not take (ValueError).
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
    param_specs: PartitionSpecs of the differentiated arguments, in their pytree form or
      another with the same leaf paths (an nnx Module's or its State's
      ``nnx.get_partition_spec``). A leaf sharded over all data axes on one dimension is
      FSDP (all-gathered for ``fun``, its gradient reduce-scattered back); over a subset of
      them, HSDP (reduce-scattered over the subset, all-reduced over the rest). Checked
      against each array's rank, the mesh's axes and, where known, its sharding. None:
      read from the arrays (concrete arrays, or Explicit-mesh types; under ``jax.jit`` on
      Auto axes they are unknown and taken as replicated, with a warning).
    batch_argnums: the positional arguments whose leaves are split over ``axes`` on their
      first dimension; default: all that are not differentiated. Others pass whole.
    mesh: the mesh; default: the one set by ``jax.set_mesh``.
    algorithm: the all_reduce algorithm (default: its own, "auto"); reduce_scatter and
      all_gather keep theirs.
    min_bytes: leaves smaller than this (each whole leaf's bytes) go exactly (default:
      the ops' own, 4 MiB).
    chunks: as in :func:`jcoccl.all_reduce`.
    replicated_closure: allow ``fun`` to close over arrays sharded over the data axes or
      with the batch's leading size (by default an error: such an array is usually the
      batch, which every shard would then compute on whole).

  Returns:
    A :class:`DataParallelGrad`: ``grad_fn(*args)`` gives ``(value, grads)``; with
    ``error_feedback``, ``grad_fn(*args, state=s)`` gives ``((value, grads), new_state)``.

  Raises:
    ValueError: ``axes`` not in the mesh, a batch whose first dimension does not split over
      them or that is sharded otherwise, bad ``param_specs`` (naming the leaf) /
      ``accumulate`` / ``state``, a closed-over batch-like array.
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
  data_axes = S.data_axes(axes)
  options = {"algorithm": algorithm, "min_bytes": min_bytes, "chunks": chunks}
  plans = make_plans(data_axes, compressor, gather_compressor, policy, options)
  _refuse_stochastic(plans, policy is not None)
  if error_feedback:
    for op, plan in plans:
      if op != "all_gather":
        _error_feedback(plan.compressor)  # a codec error feedback cannot wrap fails here
  return DataParallelGrad(
    fun=fun,
    axes=data_axes,
    argnums=S.argnums_of(argnums),
    has_aux=has_aux,
    plans=plans,
    error_feedback=bool(error_feedback),
    accumulate=accumulate,
    param_specs=param_specs,
    batch_argnums=None if batch_argnums is None else tuple(batch_argnums),
    mesh=mesh,
    replicated_closure=bool(replicated_closure),
  )

"""How :func:`jcoccl.value_and_grad` runs the model's own code inside its data-manual region.

``fun``'s gradient is traced *outside* the region, on one data shard's slice of the batch,
with the mesh's axis types as the program has them: sharding constraints and
``out_sharding=`` specs that name the data axes trace as they do in the original program,
and on an Explicit mesh the types the code sees are the original's. The traced program
(forward and backward, so no derivative rule runs inside the region) is then evaluated
inside the region by a small interpreter that binds each equation as it is, except that

* every sharding in an equation's parameters (``with_sharding_constraint``, ``reshard``,
  ``out_sharding=`` of dot_general, broadcast, reshape, ...) is rebuilt on the region's
  mesh with the data axes removed from its spec (inside, they are manual: each device
  already holds its shard);
* the bodies of jit, custom_jvp/custom_vjp (their primal: the derivative was taken
  outside), scan, while, cond and remat are evaluated the same way (scan and while
  carries start varying over the data axes, so that a carry that becomes per-shard keeps
  its type).

The constants the trace closed over (arrays ``fun`` reads from outside its arguments) are
checked: one sharded over the data axes, or with the batch's leading size, is almost
always the batch itself, which inside the region each shard would see whole (correct
loss, n times the work, no warning). :func:`check_closure` makes that an error.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AbstractMesh, NamedSharding

from jcoccl._src import _compat
from jcoccl._src.base.axes import match_vma
from jcoccl._src.integrations import gspmd_specs as S
from jcoccl._src.integrations.gspmd_specs import known_spec, strip_names
from jcoccl._src.integrations.interpret import eval_jaxpr

_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr"}
_CUSTOM = ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr")
_REMAT = ("remat2", "checkpoint", "remat")


def trace(fn: Callable[..., Any], avals: Sequence[Any]) -> tuple[Any, Any]:
  """``fn`` (flat arrays -> pytree) traced at ``avals``: (closed jaxpr, output treedef)."""
  tree: list = []

  def flat(*xs: Any) -> list:
    outs, t = jax.tree_util.tree_flatten(fn(*xs))
    tree.append(t)
    return outs

  closed = _compat.trace_closed_jaxpr(flat, list(avals), name="jcoccl_value_and_grad")
  return closed, tree[0]


class Region:
  """Evaluates a traced program inside the data-manual region (see the module docstring)."""

  def __init__(self, axes: tuple[str, ...]):
    self.axes = axes
    self.vary = frozenset(axes)

  def run(self, closed: Any, consts: Sequence[Any], args: Sequence[Any]) -> list:
    """The outputs of ``closed`` on ``args``, its constants given as ``consts``."""
    self.mesh = jax.sharding.get_abstract_mesh()
    return self._eval(closed.jaxpr, consts, args)

  def _eval(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list:
    # The equation's context (name stack, metadata) holds the mesh it was traced under;
    # the region's replaces it.
    return eval_jaxpr(jaxpr, consts, args, self._eqn, mesh=self.mesh)

  def _closed(self, c: Any, args: Sequence[Any]) -> list:
    return self._eval(c.jaxpr, c.consts, args)

  def _eqn(self, eqn: Any, invals: list) -> list:
    prim, name, p = eqn.primitive, eqn.primitive.name, eqn.params
    if name in _CALLS:
      return self._closed(p[_CALLS[name]], invals)
    if name in _CUSTOM:
      # The primal only: the derivative was taken when the program was traced.
      return self._closed(p.get("call_jaxpr", p.get("fun_jaxpr")), invals)
    if name == "scan":
      return self._scan(p, invals)
    if name == "while":
      return self._while(p, invals)
    if name == "cond":
      return self._cond(p, invals)
    if name in _REMAT:
      f = jax.checkpoint(
        lambda *a: self._eval(p["jaxpr"], (), a), prevent_cse=p["prevent_cse"], policy=p["policy"]
      )
      return list(f(*invals))
    if name == "shard_map":
      raise NotImplementedError(
        "jcoccl.value_and_grad: fun contains a jax.shard_map; its mesh axes would nest "
        "inside the data-manual region. Call fun's shard_map outside value_and_grad"
      )
    out = prim.bind(*_joined(invals), **prim.get_bind_params(self._params(p)))
    return list(out) if prim.multiple_results else [out]

  def _params(self, params: dict) -> dict:
    """``params`` with every sharding rebuilt on the region's mesh, data axes removed."""
    mesh = self.mesh

    def fix(v: Any) -> Any:
      if isinstance(v, NamedSharding):
        return NamedSharding(mesh, strip_names(v.spec, self.axes), memory_kind=v.memory_kind)
      if isinstance(v, AbstractMesh) and not v.empty:
        return mesh
      if isinstance(v, tuple) and any(isinstance(e, (NamedSharding, AbstractMesh)) for e in v):
        return tuple(fix(e) for e in v)
      return v

    out = {k: fix(v) for k, v in params.items()}
    if "concrete_mesh" in out:  # reshard's: the region's own is abstract
      out["concrete_mesh"] = None
    return out

  def _vary(self, xs: Sequence[Any]) -> list:
    return [match_vma(x, self.vary) for x in xs]

  def _scan(self, p: dict, invals: list) -> list:
    if "ft_in" in p:  # JAX 0.11: the operands' (consts, carry, xs) as one flat tree
      consts, init, xs = (list(t) for t in p["ft_in"].update(invals).unpack())
    else:
      nc, nk = p["num_consts"], p["num_carry"]
      consts, init, xs = invals[:nc], invals[nc : nc + nk], invals[nc + nk :]
    nk = len(init)

    def body(carry: list, x: list) -> tuple:
      outs = self._closed(p["jaxpr"], [*consts, *carry, *x])
      return self._vary(outs[:nk]), outs[nk:]

    carry, ys = lax.scan(  # type: ignore[var-annotated]
      body, self._vary(init), xs, length=p["length"], reverse=p["reverse"], unroll=p["unroll"]
    )
    return [*carry, *ys]

  def _while(self, p: dict, invals: list) -> list:
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, init = invals[:cn], invals[cn : cn + bn], invals[cn + bn :]
    cond = lambda c: self._closed(p["cond_jaxpr"], [*cconsts, *c])[0]
    body = lambda c: self._vary(self._closed(p["body_jaxpr"], [*bconsts, *c]))
    return list(lax.while_loop(cond, body, self._vary(init)))

  def _cond(self, p: dict, invals: list) -> list:
    index, ops = invals[0], invals[1:]
    branches = [(lambda *o, b=b: self._vary(self._closed(b, o))) for b in p["branches"]]
    return list(lax.switch(index, branches, *ops))


def _joined(xs: list) -> list:
  """``xs`` all varying over the union of their manual axes (the lax functions insert that
  pvary when they bind; binding the primitive itself must do it here)."""
  vmas = [_compat.varying_axes(x) if isinstance(x, jax.Array) else frozenset() for x in xs]
  union = frozenset().union(*vmas)
  if not union or all(v == union for v in vmas):
    return xs
  return [x if v == union else match_vma(jnp.asarray(x), union) for x, v in zip(xs, vmas)]


def _names(fun: Callable[..., Any]) -> dict[int, str]:
  """id -> name of the arrays ``fun`` reads from its closure and globals (best effort)."""
  out: dict[int, str] = {}
  target = getattr(fun, "func", fun)  # functools.partial
  with contextlib.suppress(TypeError, ValueError):
    found = inspect.getclosurevars(target)
    for scope in (found.nonlocals, found.globals):
      for name, value in scope.items():
        for path, leaf in jax.tree_util.tree_leaves_with_path(value):
          out.setdefault(id(leaf), name + jax.tree_util.keystr(path))
  return out


def check_closure(
  fun: Callable[..., Any],
  consts: Sequence[Any],
  axes: tuple[str, ...],
  batch_size: int | None,
) -> None:
  """Refuses a constant of ``fun`` that is sharded over ``axes`` or has ``batch_size`` rows.

  Raises:
    ValueError: naming the array (its variable where it can be found) and the two fixes.
  """
  names = _names(fun)
  for c in consts:
    if not isinstance(c, jax.Array):  # numpy tables, literals: the program's own constants
      continue
    spec = known_spec(c)
    over = sorted({a for e in (spec or ()) for a in _entry_names(e) if a in axes})
    rows = np.ndim(c) and batch_size is not None and np.shape(c)[0] == batch_size
    if not over and not rows:
      continue
    what = (
      f"is sharded over {tuple(over)}" if over else f"has the batch's leading size ({batch_size})"
    )
    name = names.get(id(c))
    label = f"{name!r} " if name else ""
    raise ValueError(
      f"fun closes over an array {label}of shape {tuple(np.shape(c))} {c.dtype} that {what}: "
      f"inside the data-parallel region every shard would compute on all of it (the right "
      f"loss at {_size_word(axes)} the work). Pass it as an argument of the call (then it is "
      "split over the data axes as a batch), or, for a constant that really is replicated, "
      "pass replicated_closure=True"
    )


def check_batch_given(fun: Callable[..., Any], consts: Sequence[Any], given: bool) -> None:
  """Refuses a call with no batch argument to split (every shard would compute the same).

  Raises:
    ValueError: naming the arrays ``fun`` closes over (where found), the likely batch.
  """
  if given:
    return
  names = _names(fun)
  seen = [
    f"{names.get(id(c), 'an array')} {tuple(np.shape(c))}"
    for c in consts
    if isinstance(c, jax.Array) and np.ndim(c)
  ]
  closes = f"; fun closes over {', '.join(seen)}" if seen else ""
  raise ValueError(
    "batch: value_and_grad splits the non-differentiated arguments over the data axes, and "
    f"this call has none with a leading dimension{closes}. Pass the batch as arguments "
    "(grad_fn(params, x, y) with fun(params, x, y)) rather than closing over it"
  )


def _entry_names(entry: Any) -> tuple:
  return entry if isinstance(entry, tuple) else (() if entry is None else (entry,))


def _size_word(axes: tuple[str, ...]) -> str:
  return f"n = |{' x '.join(axes)}| times"


def positions(args: tuple, args_tree: Any) -> list[list[int]]:
  """Per positional argument, the indices of its leaves in the flattened argument list."""
  out, at = [], 0
  for a in args:
    k = len(jax.tree_util.tree_leaves(a))
    out.append(list(range(at, at + k)))
    at += k
  assert at == args_tree.num_leaves
  return out


def aval_of(x: Any) -> Any:
  return jax.typeof(x)


def local_aval(aval: Any, per: int, axes: tuple[str, ...]) -> Any:
  """One shard's (micro-)batch type: the leading size / ``per``; on an Explicit mesh its
  spec stays the original's (the types the model's code expects) where the local size
  still splits over the data axes, else without them."""
  if not aval.shape:
    return aval
  shape = (aval.shape[0] // per, *aval.shape[1:])
  sharding: Any = getattr(aval, "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if sharding is None or mesh is None or mesh.empty:
    return aval.update(shape=shape)
  first = S.names_of(sharding.spec[0]) if len(sharding.spec) else ()
  size = 1
  for a in first:
    size *= mesh.shape[a]
  if shape[0] % size:
    spec = S.strip_names(sharding.spec, axes)
    return aval.update(shape=shape, sharding=sharding.update(spec=spec))
  return aval.update(shape=shape)


def loss_of(out: Any, has_aux: bool) -> tuple:
  """``fun``'s output as (loss, aux), checked."""
  if has_aux and not (isinstance(out, (tuple, list)) and len(out) == 2):
    raise TypeError("has_aux=True: fun must return a pair (loss, aux)")
  loss, aux = out if has_aux else (out, ())
  if jnp.shape(loss) != ():
    raise TypeError(
      f"fun must return a scalar loss (shape ()), got shape {jnp.shape(loss)}"
      + ("" if has_aux else "; with auxiliary outputs pass has_aux=True")
    )
  return loss, aux

"""One jaxpr interpreter loop, for the passes that re-run a traced program equation by
equation with some equations replaced (jcoccl.compress, jcoccl.value_and_grad's region).

Each equation runs inside its own context (name stack, metadata, and the mesh it was traced
under), optionally with another abstract mesh in force, so that what it binds is traced as
the original program traced it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend import core as jex


def eval_jaxpr(
  jaxpr: Any,
  consts: Sequence[Any],
  args: Sequence[Any],
  eqn_fn: Callable[[Any, list], Sequence[Any]],
  mesh: Any = None,
) -> list:
  """The outputs of ``jaxpr`` on ``args``, each equation evaluated by ``eqn_fn``.

  Args:
    jaxpr: an open jaxpr (``closed.jaxpr``).
    consts: values of its constvars.
    args: values of its invars.
    eqn_fn: ``(eqn, input values) -> output values`` for one equation.
    mesh: an abstract mesh to trace every equation under (the equation's own context
      would otherwise restore the mesh it was traced with); None keeps that one.

  Returns:
    The values of ``jaxpr``'s outvars.

  Example:
    >>> closed = jax.make_jaxpr(lambda x: x * 2)(1.0)
    >>> bind = lambda eqn, vals: [eqn.primitive.bind(*vals, **eqn.params)]
    >>> eval_jaxpr(closed.jaxpr, closed.consts, [3.0], bind)
    [Array(6., dtype=float32, weak_type=True)]
  """
  env: dict = {}
  read = lambda v: v.val if isinstance(v, jex.Literal) else env[v]
  for v, x in zip(jaxpr.constvars, consts, strict=True):
    env[v] = x
  for v, x in zip(jaxpr.invars, args, strict=True):
    env[v] = x
  for eqn in jaxpr.eqns:
    ctx = getattr(getattr(eqn, "ctx", None), "manager", None)
    with contextlib.ExitStack() as stack:
      if ctx is not None:
        stack.enter_context(ctx)
      if mesh is not None:
        stack.enter_context(jax.sharding.use_abstract_mesh(mesh))
      outs = eqn_fn(eqn, [read(v) for v in eqn.invars])
    for v, x in zip(eqn.outvars, outs, strict=True):
      env[v] = x
  return [read(v) for v in jaxpr.outvars]

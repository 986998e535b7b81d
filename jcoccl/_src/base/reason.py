"""Why a leaf of a jcoccl call runs as it does, carried by the program itself.

A leaf bound to a ``jcoccl_<op>`` equation carries a :class:`Reason` in that equation's
``reason`` parameter (per leaf, as every parameter). A leaf that takes the exact lax op
instead has no jcoccl equation: its result goes through ``jcoccl.exact``, an identity
primitive whose parameters say which op it replaces and why (it lowers to nothing, so the
compiled program is the lax op's), and the lax op runs under the name scope
:data:`EXACT_SCOPE`. :func:`jcoccl.explain` reads both back from the jaxpr; nothing is
recorded on the side, so a program traced once is explained the same way every time.

Example:
  >>> str(Reason("int8", "two_shot", "compressed"))
  'compressed'
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from jcoccl._src import _compat

EXACT_SCOPE = "jcoccl_exact"  # name scope of jcoccl's exact fallbacks: not lax ops written directly


@dataclasses.dataclass(frozen=True)
class Reason:
  """What a leaf's call decided, and why (hashable: it is a primitive parameter).

  Attributes:
    named: the compressor the caller named, as a spec ("none"; "auto:<spec>" where the
      caller let auto choose the exact op).
    algorithm: all_reduce's algorithm ("exact" for the lax op), else "".
    why: one sentence.
    predicted_s: (candidate, modelled seconds) auto compared (all_reduce auto only).
    cost_model: the cost model's source, with whether it is calibrated.
  """

  named: str
  algorithm: str
  why: str
  predicted_s: tuple = ()
  cost_model: str = ""

  def __str__(self) -> str:  # as a jaxpr prints the parameter
    return self.why


def spec_text(c: Any) -> str:
  """A compressor, its spec string, None or a per-level pair, as explain prints it.

  Example:
    >>> spec_text(("int8", None))
    '(int8, none)'
  """
  if c is None:
    return "none"
  if isinstance(c, tuple):
    return "(" + ", ".join(spec_text(v) for v in c) + ")"
  return str(c)


def reason(
  named: Any, algorithm: str, why: str, requested: str | None = None, decision: Any = None
) -> Reason:
  """The :class:`Reason` of one leaf.

  Args:
    named: the compressor the caller named (None: none).
    algorithm: the algorithm that runs ("" for ops without one).
    why: why it runs so, where no auto decision says more.
    requested: all_reduce's requested algorithm ("auto_exact": the codec was named
      ``"auto:<spec>"``).
    decision: all_reduce's :class:`jcoccl._src.ops.all_reduce_auto.Decision` for the leaf, if any:
      its sentence replaces ``why`` where auto decided, and its predicted times and cost
      model come along.

  Example:
    >>> reason("int8", "exact", "dtype int32 is not float").named
    'int8'
  """
  text = ("auto:" if requested == "auto_exact" and named is not None else "") + spec_text(named)
  if decision is None:
    return Reason(text, algorithm, why)
  d = decision
  why = d.why if d.auto else why
  state = "calibrated" if d.calibrated else "not calibrated"
  return Reason(
    text, algorithm, f"requested {d.requested}: {why}", d.predicted_s, f"{d.source} ({state})"
  )


exact_p = _compat.new_primitive("jcoccl.exact")
_compat.define_note(exact_p)


def exact(op: str, axes: tuple, xs: Any, ys: Any, why: Reason) -> Any:
  """``ys`` (the exact lax op's results for the leaves ``xs``, pytrees alike), each leaf
  marked with what it replaces and why (``jcoccl.exact``: an identity)."""

  def one(x: Any, y: Any) -> Any:
    shape, dtype = tuple(jnp.shape(x)), jnp.dtype(jnp.result_type(x)).name
    return exact_p.bind(y, op=op, axes=tuple(axes), shape=shape, dtype=dtype, reason=why)

  return jax.tree_util.tree_map(one, xs, ys)


def exact_scope() -> Any:
  """The name scope that marks jcoccl's own exact lax calls (:data:`EXACT_SCOPE`)."""
  return jax.named_scope(EXACT_SCOPE)


def nbytes(shape: tuple, dtype: str) -> int:
  """Bytes of an array of ``shape`` and ``dtype`` (a name)."""
  return math.prod(shape) * jnp.dtype(dtype).itemsize

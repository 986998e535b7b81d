"""The five collectives as JAX primitives: what an op module registers, and the names it
uses. The parts live one module per job:

  :mod:`jcoccl._src.ops.op_spec`: :class:`Op` (one record per collective), the registry and
    :data:`DUALS`.
  :mod:`jcoccl._src.ops.driver`: :func:`plan` and :func:`apply` (the pipeline every op shares,
    one bind per call).
  :mod:`jcoccl._src.ops.rules`: the primitive rules, one top-level function each.
  :mod:`jcoccl._src.ops.lowering`: the leaves of one equation bucketed and packed.

Each op module (all_reduce.py, all_gather.py, ...) describes its collective with an
:class:`Op` and registers it here (:func:`register`). :func:`apply` plans every leaf of a
call (:func:`plan`) and binds one ``jcoccl_<op>`` equation for the leaves that need it:
the primitive takes one operand per leaf (and returns one result per leaf), as
``lax.psum`` binds a pytree once.

Parameters are hashable and print as what goes on the wire, e.g.
``jcoccl_all_reduce[algorithm=two_shot axes=('d',) backend=xla ... compressor=int8 ...]``,
with each leaf's ``reason`` (:mod:`jcoccl._src.base.reason`).

Example:
  >>> DUALS["all_gather"]
  'reduce_scatter'
"""

from __future__ import annotations

from jcoccl._src.ops import op_spec, rules
from jcoccl._src.ops.driver import Bound as Bound
from jcoccl._src.ops.driver import Exact as Exact
from jcoccl._src.ops.driver import apply as apply
from jcoccl._src.ops.driver import apply_residual as apply_residual
from jcoccl._src.ops.driver import apply_tree as apply_tree
from jcoccl._src.ops.driver import bind as bind
from jcoccl._src.ops.driver import plan as plan
from jcoccl._src.ops.lowering import PACK_MAX_BYTES as PACK_MAX_BYTES
from jcoccl._src.ops.lowering import blockwise as blockwise
from jcoccl._src.ops.lowering import bucket_key as bucket_key
from jcoccl._src.ops.lowering import lower_leaves as lower_leaves
from jcoccl._src.ops.lowering import packable as packable
from jcoccl._src.ops.op_spec import DUALS as DUALS
from jcoccl._src.ops.op_spec import Op as Op
from jcoccl._src.ops.op_spec import op as op
from jcoccl._src.ops.op_spec import primitive as primitive
from jcoccl._src.ops.params import PerLeaf as PerLeaf
from jcoccl._src.ops.params import grad_args as grad_args
from jcoccl._src.ops.params import load as load
from jcoccl._src.ops.params import spec_of as spec_of


def register(o: Op) -> None:
  """Registers ``o`` and defines its primitive (:func:`jcoccl._src.ops.rules.define`)."""
  op_spec.add(o, rules.define(o))

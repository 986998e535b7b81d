"""``jcoccl.explain(fn, *args, mesh=...)``: every collective of a program, and why it runs
as it does.

Three kinds of rows:

  jcoccl: each leaf of each jcoccl call (op, axes, shape, dtype, bytes), the compressor
    named and the one used, the algorithm and why: the size threshold (default or given),
    a dtype that is not float, a ``jax.vmap`` axis (off the mesh), ``axis_index_groups``,
    or auto's decision with the predicted seconds of each candidate and the cost model's
    source. Read from the program: a ``jcoccl_<op>`` equation's ``reason`` parameter, or
    the ``jcoccl.exact`` mark of a leaf that took the lax op (:mod:`jcoccl._src.base.reason`).
  lax: a lax collective written directly (``lax.psum``, ...): not a jcoccl op, and
    :func:`jcoccl.compress` can convert it.
  compiler: with ``mesh``, bytes per mesh axis that the compiled program sends beyond the
    collectives the program writes (GSPMD's resharding), read from the HLO with
    :func:`jcoccl.wire_bytes`' parser; jcoccl cannot reach those from inside ``fn``.

Nothing is recorded while ``fn`` is traced: a program traced before is explained from
jit's cache, and explaining it changes nothing in it.

Example:
  >>> print(jcoccl.explain(step, params, batch, mesh=mesh))  # doctest: +SKIP
  kind    op          axes  leaf              bytes  named  used  algorithm  why
  jcoccl  all_reduce  data  float32[512,512]  1 MiB  int8   none exact      under min_bytes ...
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from jcoccl._src.base import reason as _reason
from jcoccl._src.ops.params import leaf_params

# lax's communicating collectives, as jaxpr primitive names (pvary/pcast send nothing).
LAX_COLLECTIVES = {
  "psum": "psum",
  "psum_invariant": "psum",
  "psum2": "psum",
  "pmax": "pmax",
  "pmin": "pmin",
  "all_gather": "all_gather",
  "all_gather_invariant": "all_gather",
  "reduce_scatter": "psum_scatter",
  "psum_scatter": "psum_scatter",
  "all_to_all": "all_to_all",
  "ppermute": "ppermute",
}


@dataclasses.dataclass(frozen=True)
class Record:
  """One row of :class:`Explanation`.

  Attributes:
    kind: "jcoccl", "lax" or "compiler".
    op: the collective (all_reduce, all_gather, ..., or lax's name).
    axes: mesh axis names (a comma-joined string for compiler rows).
    shape, dtype: the leaf's local shape and dtype ("" for compiler rows).
    nbytes: the leaf's local bytes (compiler rows: bytes sent per device per run).
    named: the compressor the caller named ("none" if none).
    used: the compressor that runs ("none": the exact lax op).
    algorithm: all_reduce's algorithm ("exact" for the lax op), else "".
    why: why it runs so.
    predicted_s: (candidate, modelled seconds) auto compared (all_reduce auto only).
    cost_model: the cost model's source, with whether it is calibrated.
  """

  kind: str
  op: str
  axes: Any
  shape: tuple = ()
  dtype: str = ""
  nbytes: int = 0
  named: str = "none"
  used: str = "none"
  algorithm: str = ""
  why: str = ""
  predicted_s: tuple = ()
  cost_model: str = ""


class Explanation(list):
  """The records of :func:`explain` (a list of :class:`Record`), printed as a table."""

  def __str__(self) -> str:
    head = ("kind", "op", "axes", "leaf", "bytes", "named", "used", "algorithm", "why")
    rows = [head]
    for r in self:
      leaf = f"{r.dtype}{list(r.shape)}" if r.dtype else ""
      axes = r.axes if isinstance(r.axes, str) else ",".join(map(str, r.axes))
      why = r.why
      if r.predicted_s:
        times = ", ".join(f"{n} {t * 1e3:.3g} ms" for n, t in r.predicted_s)
        why += f" [predicted: {times}; cost model: {r.cost_model}]"
      rows.append((r.kind, r.op, axes, leaf, _size(r.nbytes), r.named, r.used, r.algorithm, why))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1] for row in rows]
    return "\n".join(line.rstrip() for line in lines)


def _size(n: int) -> str:
  for unit, k in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
    if n >= 1 << k:
      return f"{n / (1 << k):.3g} {unit}"
  return f"{n} B"


def explain(fn: Callable[..., Any], *args: Any, mesh: Any = None, **kwargs: Any) -> Explanation:
  """Every collective in ``fn(*args, **kwargs)`` and why it runs as it does.

  Args:
    fn: a function (jitted or not) that calls jcoccl or lax collectives inside
      ``jax.shard_map``, or any jittable function of a mesh's arrays; or a program already
      traced (``jax.jit(f).trace(*args)``, a ``jax.stages.Traced``: then no arguments).
    *args, **kwargs: its arguments (arrays or ``jax.ShapeDtypeStruct``; nothing runs).
    mesh: the ``jax.sharding.Mesh``; given, the program is also compiled and the bytes
      the compiler adds per mesh axis (GSPMD) are listed.

  Returns:
    An :class:`Explanation`: a list of :class:`Record` in program order (jcoccl rows, then
    lax rows, then compiler rows), whose ``str`` is a table.

  Example:
    >>> rows = jcoccl.explain(f, x, mesh=mesh)            # doctest: +SKIP
    >>> [(r.op, r.used, r.algorithm) for r in rows]      # doctest: +SKIP
    [('all_reduce', 'int8', 'two_shot')]
  """
  if mesh is not None and not isinstance(mesh, jax.sharding.Mesh):
    raise TypeError(f"explain: mesh must be a jax.sharding.Mesh or None, got {type(mesh).__name__}")
  if isinstance(fn, jax.stages.Traced):
    if args or kwargs:
      raise TypeError("explain: a traced program takes no arguments (it was traced with them)")
    traced = fn
  elif not callable(fn):
    raise TypeError(f"explain: fn must be callable or a jax.stages.Traced, got {type(fn).__name__}")
  else:
    jitted = fn if hasattr(fn, "trace") else jax.jit(fn)
    traced = jitted.trace(*args, **kwargs)
  ours: list[Record] = []
  lax: list[Record] = []
  _rows(traced.jaxpr.jaxpr, ours, lax)
  out = Explanation(ours + lax)
  if mesh is not None:
    out.extend(_compiler_rows(traced, mesh))
  return out


def _rows(jaxpr: Any, ours: list[Record], lax: list[Record]) -> None:
  """The rows of ``jaxpr`` and of the programs inside it, in program order: jcoccl's
  leaves into ``ours``, lax collectives written directly into ``lax``."""
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name.startswith("jcoccl_") and "reason" in eqn.params:
      ours.extend(_bound_rows(name[len("jcoccl_") :], eqn))
    elif eqn.primitive is _reason.exact_p:
      ours.append(_exact_row(eqn.params))
    elif name in LAX_COLLECTIVES and _reason.EXACT_SCOPE not in str(eqn.source_info.name_stack):
      lax.extend(_lax_rows(name, eqn))
    for v in eqn.params.values():
      for sub in v if isinstance(v, (tuple, list)) else (v,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          _rows(inner, ours, lax)


def _record(op: str, axes: Any, shape: tuple, dtype: str, used: Any, r: Any) -> Record:
  return Record(
    "jcoccl",
    op,
    tuple(axes),
    tuple(shape),
    dtype,
    _reason.nbytes(shape, dtype),
    r.named,
    _reason.spec_text(used),
    r.algorithm,
    r.why,
    r.predicted_s,
    r.cost_model,
  )


def _bound_rows(op: str, eqn: Any) -> list[Record]:
  """One row per leaf of a ``jcoccl_<op>`` equation (its PRNG key operand excluded)."""
  n = len(eqn.invars) - (eqn.params.get("key_type") is not None)
  rows = []
  for i, v in enumerate(eqn.invars[:n]):
    lp = leaf_params(eqn.params, i)
    shape = tuple(v.aval.shape[lp["batch"] :])
    rows.append(_record(op, lp["axes"], shape, v.aval.dtype.name, lp["compressor"], lp["reason"]))
  return rows


def _exact_row(p: dict) -> Record:
  return _record(p["op"], p["axes"], p["shape"], p["dtype"], None, p["reason"])


def _lax_rows(name: str, eqn: Any) -> list[Record]:
  axes = eqn.params.get("axes", eqn.params.get("axis_name", ()))
  axes = tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)
  found = []
  for v in eqn.invars:
    aval = getattr(v, "aval", None)
    shape, dtype = tuple(getattr(aval, "shape", ())), getattr(aval, "dtype", None)
    size = int(getattr(aval, "size", 0)) * (dtype.itemsize if dtype is not None else 0)
    why = "not a jcoccl op: jcoccl.compress(f, policy) can convert it"
    if eqn.params.get("axis_index_groups") is not None:
      why += " (axis_index_groups: it would stay exact)"
    found.append(Record("lax", LAX_COLLECTIVES[name], axes, shape, str(dtype or ""), size, why=why))
  return found


def _compiler_rows(traced: Any, mesh: Any) -> list[Record]:
  """Bytes per mesh axis the compiled program sends beyond the lowered program's own
  collectives (those GSPMD inserted to reshard)."""
  from jcoccl._src.observability import wire_bytes as wb

  compiled = wb.wire_bytes(traced, mesh=mesh)["by_axis"]
  written = wb.wire_bytes(traced, mesh=mesh, program="lowered")["by_axis"]
  rows = []
  for axis, sent in compiled.items():
    extra = sent - written.get(axis, 0.0)
    if extra > 0:
      rows.append(
        Record(
          "compiler",
          "(GSPMD)",
          axis,
          nbytes=int(extra),
          why="inserted by the compiler; jcoccl cannot reach them from here (bytes sent "
          "per device per run beyond the program's own collectives)",
        )
      )
  return rows


# ----------------------------------------------------------------------------------------
# Command line: python -m jcoccl explain module:function


def add_parser(sub: Any) -> None:
  """The ``explain`` subcommand of ``python -m jcoccl``."""
  e = sub.add_parser(
    "explain",
    help="list every collective of a program and why it runs as it does",
    description="TARGET is module:function, a function of no arguments returning "
    "(fn, args) or (fn, args, mesh); jcoccl.explain(fn, *args, mesh=mesh) is printed.",
  )
  e.add_argument("target", help="module:function (the module on sys.path or the working directory)")
  e.add_argument(
    "--devices",
    type=int,
    default=None,
    help="host CPU devices to create (XLA_FLAGS --xla_force_host_platform_device_count)",
  )
  e.add_argument("--json", action="store_true", help="print the records as JSON")


def run(args: Any, parser: Any) -> int:
  """Runs ``python -m jcoccl explain`` (see :func:`add_parser`)."""
  import importlib
  import json
  import os
  import sys

  module, sep, name = args.target.partition(":")
  if not sep or not module or not name:
    parser.error(f"explain: TARGET must be module:function, got {args.target!r}")
  if args.devices is not None:
    if args.devices < 1:
      parser.error(f"explain: --devices must be a positive int, got {args.devices}")
    flag = f"--xla_force_host_platform_device_count={args.devices}"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
  sys.path.insert(0, os.getcwd())
  try:
    target = getattr(importlib.import_module(module), name)
  except (ImportError, AttributeError) as e:
    parser.error(f"explain: cannot load {args.target!r}: {e}")
  got = target()
  if not isinstance(got, tuple) or len(got) not in (2, 3):
    parser.error(f"explain: {args.target} must return (fn, args) or (fn, args, mesh), got {got!r}")
  fn, fargs, mesh = (*got, None) if len(got) == 2 else got
  rows = explain(fn, *fargs, mesh=mesh)
  if args.json:
    print(json.dumps([dataclasses.asdict(r) for r in rows], indent=1, default=str))
  else:
    print(rows)
  return 0

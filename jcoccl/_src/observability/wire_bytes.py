"""Bytes on the wire, read from the compiled HLO of a program.

``wire_bytes(fn, *args)`` compiles ``fn`` (a ``jax.jit`` of a ``jax.shard_map`` program, or
anything jittable), finds every collective in the optimised HLO and reports the bytes
each device sends for it, with the per-op formulas nccl-tests uses for bus bandwidth
(S = bytes of the collective's result on one device, n = replica group size):

  all-reduce          2 (n-1)/n * S
  all-gather          (n-1)/n * S          (S = the gathered buffer)
  reduce-scatter      (n-1) * S            (the input is n * S; (n-1)/n of it leaves)
  all-to-all          (n-1)/n * S          (S = all chunks together)
  collective-permute  S * p / D            (p = source->target pairs with source != target,
                                            D = devices in the program: a per-device mean)

Async pairs (``*-start``/``*-done``) are counted once, from the ``-done`` result (with the
``-start``'s replica groups). A collective inside a ``while`` loop counts once per
iteration when XLA knows the trip count (``known_trip_count``); otherwise once, flagged.
With a mesh, each collective's replica groups (logical ids, mapped to device ids through
the executable's device assignment) are matched to the mesh axes they span.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jcoccl._src import _compat

_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {
  "pred": 1,
  "s8": 1,
  "u8": 1,
  "f8e4m3fn": 1,
  "f8e5m2": 1,
  "f8e4m3": 1,
  "s16": 2,
  "u16": 2,
  "f16": 2,
  "bf16": 2,
  "s32": 4,
  "u32": 4,
  "f32": 4,
  "s64": 8,
  "u64": 8,
  "f64": 8,
  "c64": 8,
  "c128": 16,
}
_INSTR = re.compile(
  r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<type>.+?)\s+"
  r"(?P<op>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
  r"(?P<suffix>-start|-done)?\((?P<rest>.*)$"
)
_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s*->\s*.*\{\s*$")
_SHAPE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
_GROUPS_LIST = re.compile(r"replica_groups=\{((?:\s*\{[0-9,\s]*\}\s*,?)*)\}")
_UNKNOWN_AXES = "?"


def _nbytes(type_text: str) -> tuple[int, str]:
  total, dtypes = 0, []
  for dt, dims in _SHAPE.findall(type_text):
    if dt not in _DTYPE_BYTES:
      continue
    count = 1
    for d in filter(None, dims.split(",")):
      count *= int(d)
    total += count * _DTYPE_BYTES[dt]
    dtypes.append(dt)
  return total, ",".join(sorted(set(dtypes)))


def _groups(rest: str, num_devices: int) -> list[tuple[int, ...]]:
  """The replica groups of a collective, as tuples of logical device ids."""
  m = _GROUPS_MESH.search(rest)
  if m:
    sizes = re.findall(r"'([^']+)'\s*=\s*(\d+)", m.group(1))
    names = re.findall(r"'([^']+)'", m.group(2))
    if not sizes or len(sizes) != m.group(1).count("=") or any(n not in dict(sizes) for n in names):
      raise ValueError(f"wire_bytes: cannot parse replica groups in {rest[:200]!r}")
    order = [a for a, _ in sizes]
    ids = np.arange(int(np.prod([int(s) for _, s in sizes]))).reshape([int(s) for _, s in sizes])
    return _partition(ids, [order.index(n) for n in names])
  m = _GROUPS_IOTA.search(rest)
  if m:
    dims = [int(d) for d in m.group(3).split(",")]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if m.group(4):
      ids = ids.transpose([int(p) for p in m.group(4).split(",")])
    return [tuple(int(v) for v in row) for row in ids.reshape(int(m.group(1)), int(m.group(2)))]
  m = _GROUPS_LIST.search(rest)
  if m:
    groups = [
      tuple(int(v) for v in g.split(",") if v.strip())
      for g in re.findall(r"\{([0-9,\s]*)\}", m.group(1))
    ]
    groups = [g for g in groups if g]
    return groups or [tuple(range(num_devices))]
  if "replica_groups=" in rest:
    raise ValueError(f"wire_bytes: cannot parse replica groups in {rest[:200]!r}")
  return [tuple(range(num_devices))]


def _partition(ids: np.ndarray, axes: list[int]) -> list[tuple[int, ...]]:
  """Groups of ``ids`` (an array over mesh positions) varying only along ``axes``."""
  rest = [a for a in range(ids.ndim) if a not in axes]
  size = int(np.prod([ids.shape[a] for a in axes])) if axes else 1
  flat = ids.transpose(rest + list(axes)).reshape(-1, size)
  return [tuple(int(v) for v in row) for row in flat]


def _pairs(rest: str) -> list[tuple[int, int]]:
  text = rest.split("source_target_pairs=", 1)
  if len(text) < 2:
    return []
  body = text[1].split("}}", 1)[0]
  return [(int(a), int(b)) for a, b in re.findall(r"\{\s*(\d+)\s*,\s*(\d+)\s*\}?", body)]


def _sent(op: str, s: int, n: int, pairs: list[tuple[int, int]], num_devices: int) -> float:
  if op == "all-reduce":
    return 2 * (n - 1) / n * s
  if op in ("all-gather", "all-to-all"):
    return (n - 1) / n * s
  if op == "reduce-scatter":
    return (n - 1) * s
  moving = sum(1 for a, b in pairs if a != b)
  return s * moving / max(num_devices, 1)


class _AxisMatcher:
  """Maps replica groups / permute pairs of logical ids to mesh axis tuples."""

  def __init__(self, mesh: jax.sharding.Mesh, device_ids: list[int]):
    self.names = tuple(mesh.axis_names)
    logical = {d: i for i, d in enumerate(device_ids)}
    mesh_ids = np.vectorize(lambda d: d.id, otypes=[int])(mesh.devices)
    self.ok = all(int(d) in logical for d in mesh_ids.flat)
    self.coords: dict[int, tuple[int, ...]] = {}
    self.partitions: list[tuple[tuple[str, ...], frozenset]] = []
    if not self.ok:
      return
    ids = np.vectorize(lambda d: logical[int(d)], otypes=[int])(mesh_ids)
    for idx in np.ndindex(ids.shape):
      self.coords[int(ids[idx])] = idx
    for k in range(1, ids.ndim + 1):
      for subset in itertools.combinations(range(ids.ndim), k):
        groups = frozenset(frozenset(g) for g in _partition(ids, list(subset)))
        self.partitions.append((tuple(self.names[a] for a in subset), groups))

  def groups(self, groups: list[tuple[int, ...]]) -> tuple[str, ...] | None:
    key = frozenset(frozenset(g) for g in groups)
    for axes, part in self.partitions:
      if part == key:
        return axes
    return None

  def pairs(self, pairs: list[tuple[int, int]]) -> tuple[str, ...] | None:
    if not self.ok or any(a not in self.coords or b not in self.coords for a, b in pairs):
      return None
    moved = set()
    for a, b in pairs:
      moved |= {i for i, (x, y) in enumerate(zip(self.coords[a], self.coords[b])) if x != y}
    return tuple(self.names[i] for i in sorted(moved))


def _computations(text: str) -> tuple[dict[str, list[str]], str | None]:
  comps: dict[str, list[str]] = {}
  entry, cur = None, None
  for line in text.splitlines():
    m = _COMPUTATION.match(line)
    if m:
      cur = m.group(1)
      comps[cur] = []
      if line.startswith("ENTRY"):
        entry = cur
    elif cur is not None:
      if line.strip() == "}":
        cur = None
      else:
        comps[cur].append(line)
  return comps, entry


def _executions(comps: dict[str, list[str]], entry: str | None) -> dict[str, tuple[int, bool]]:
  """How often each computation runs per program run, and whether that count is exact."""
  out: dict[str, tuple[int, bool]] = {}
  if entry is None:
    return out

  def visit(name: str, times: int, exact: bool, depth: int) -> None:
    if name not in comps or depth > 64:
      return
    prev_t, prev_e = out.get(name, (0, True))
    out[name] = (prev_t + times, prev_e and exact)
    for line in comps[name]:
      if " while(" in line:
        trip = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
        n, known = (int(trip.group(1)), True) if trip else (1, False)
        for key, extra in (("body", 0), ("condition", 1)):
          callee = re.search(rf"\b{key}=%?([\w.\-]+)", line)
          if callee:
            visit(callee.group(1), times * (n + extra), exact and known, depth + 1)
        continue
      if re.search(r"\basync-(?:update|done)\(", line):
        continue  # the same computation as its async-start: count it once
      for callee in re.findall(
        r"\b(?:calls|true_computation|false_computation)=%?([\w.\-]+)", line
      ):
        visit(callee, times, exact, depth + 1)
      branches = re.search(r"branch_computations=\{([^}]*)\}", line)
      if branches:
        for callee in re.findall(r"%?([\w.\-]+)", branches.group(1)):
          visit(callee, times, exact, depth + 1)

  visit(entry, 1, True, 0)
  return out


def parse_hlo(
  text: str,
  num_devices: int,
  *,
  mesh: jax.sharding.Mesh | None = None,
  device_ids: list[int] | None = None,
) -> list[dict[str, Any]]:
  """The collectives of an HLO module's text with their per-device bytes sent.

  Args:
    text: the optimised HLO module (``compiled.as_text()``).
    num_devices: devices in the program (``num_partitions`` in the text wins when > 1).
    mesh: optional mesh whose axes each collective is matched to (adds "axes").
    device_ids: device id of each logical id (the executable's device assignment); default:
      ``mesh.devices`` in row-major order, which is what ``jit`` assigns for a mesh program.

  Returns:
    One dict per collective: op, bytes (S), dtype, group_size, executions (per program run),
    executions_exact (False where a loop's trip count is unknown and 1 was assumed),
    sent_bytes (per device per program run) and, with a mesh, axes (a tuple of mesh axis
    names, or "?" when the groups match no set of mesh axes).
  """
  m = re.search(r"num_partitions=(\d+)", text)
  if m and int(m.group(1)) > 1:
    num_devices = int(m.group(1))
  matcher = None
  if mesh is not None:
    ids = (
      device_ids
      if device_ids and len(device_ids) == num_devices
      else [d.id for d in mesh.devices.flat]
    )
    matcher = _AxisMatcher(mesh, ids)
  comps, entry = _computations(text)
  runs = _executions(comps, entry)
  lines = {mm.group(1): line for line in text.splitlines() if (mm := _NAME.match(line))}
  out = []
  for comp, body in comps.items() if comps else [(None, text.splitlines())]:
    for line in body:
      c = _collective(line, lines, num_devices, matcher)
      if c is not None:
        times, exact = runs.get(comp or "", (1, entry is None))
        c.update(executions=times, executions_exact=exact)
        c["sent_bytes"] *= times
        out.append(c)
  return out


def _collective(
  line: str, lines: dict[str, str], num_devices: int, matcher: _AxisMatcher | None
) -> dict[str, Any] | None:
  mm = _INSTR.match(line)
  if not mm or mm.group("suffix") == "-start":
    return None
  op, rest = mm.group("op"), mm.group("rest")
  if mm.group("suffix") == "-done":
    start = lines.get(rest.split(")", 1)[0].strip().lstrip("%"), "")
    rest = start or rest
  s, dtypes = _nbytes(mm.group("type"))
  if op == "collective-permute":
    pairs, groups, n = _pairs(rest), None, 2
  else:
    pairs, groups = [], _groups(rest, num_devices)
    n = len(groups[0])
  c = {
    "op": op,
    "bytes": s,
    "dtype": dtypes,
    "group_size": n,
    "sent_bytes": _sent(op, s, n, pairs, num_devices),
  }
  if matcher is not None:
    axes = matcher.pairs(pairs) if groups is None else matcher.groups(groups)
    c["axes"] = _UNKNOWN_AXES if axes is None else axes
  return c


PROGRAMS = ("compiled", "lowered")


def _traced(fn: Any, args: tuple, what: str) -> Any:
  """``fn`` traced on ``args``, or ``fn`` itself when it was traced already."""
  if isinstance(fn, jax.stages.Traced):
    if args:
      raise TypeError(
        f"wire_bytes: {what} is a jax.stages.Traced, which holds its arguments; pass none "
        f"(got {len(args)})"
      )
    return fn
  return (fn if hasattr(fn, "trace") else jax.jit(fn)).trace(*args)


def _compiled(traced: Any, program: str = "compiled") -> tuple[str, int, list[int] | None]:
  # jax caches the executable by the traced program: the compile below is the one that a
  # Traced's owner already ran (models.train runs this executable), not a second one.
  lowered = traced.lower()
  if program == "lowered" and jax.process_count() == 1:
    # The lowered text needs no compile; only the device assignment did, and the lowering
    # holds it. Across processes the compiled executable's local devices are what is read.
    ids = _compat.lowered_device_ids(lowered)
    if ids is not None:
      return lowered.as_text(dialect="hlo"), jax.device_count(), ids
  compiled = lowered.compile()
  text = compiled.as_text() if program == "compiled" else lowered.as_text(dialect="hlo")
  return text, jax.device_count(), _compat.executable_device_ids(compiled)


def wire_bytes(
  fn: Callable[..., Any],
  *args: Any,
  reference: Callable[..., Any] | None = None,
  mesh: jax.sharding.Mesh | None = None,
  program: str = "compiled",
) -> dict[str, Any]:
  """Bytes each device sends per collective in ``fn``'s compiled program.

  Args:
    fn: a jitted (or jittable) function, typically ``jax.jit(jax.shard_map(...))``; or
      such a function already traced (``jax.jit(f).trace(*args)``, then no ``args``): a
      program that also runs reuses its executable instead of compiling it again.
    *args: example arguments (arrays or ShapeDtypeStructs).
    reference: optional second program (e.g. the same computation with lax collectives)
      whose totals are reported alongside, with the ratio ``total / reference_total``;
      traced too when ``fn`` is.
    mesh: optional ``jax.sharding.Mesh`` the program runs on. Each collective's replica
      groups are matched to the tuple of mesh axes (in mesh order) whose groups they equal
      as sets of device ids; a collective-permute gets the axes along which its
      source -> target pairs move. Groups that match no axes are reported under "?".
    program: "compiled" (what this backend runs) or "lowered" (the program as jax wrote
      it, before XLA's passes). They differ where a backend widens a type: XLA:CPU runs
      bfloat16 all-reduces and collective-permutes in float32, where NCCL sends bfloat16.

  Returns:
    dict with "collectives" (list of {op, bytes, dtype, group_size, executions,
    executions_exact, sent_bytes} plus "axes" with ``mesh``), "by_op" ({op: sent bytes}),
    "total" (sent bytes per device per run), and, with ``reference``, "reference_total",
    "reference_by_op" and "ratio". With ``mesh`` also "by_axis" ({"data": bytes,
    "data,tensor": bytes, "?": bytes, ...}: axis names joined by commas, only non-zero
    entries plus "?" whenever something went unmatched) and, with ``reference`` too,
    "reference_by_axis".

  Example:
    >>> wb = jcoccl.wire_bytes(f_int8, x, reference=f_lax, mesh=mesh)   # doctest: +SKIP
    >>> wb["ratio"] < 0.27
    True
    >>> wb["by_axis"]                                                     # doctest: +SKIP
    {'data': 2437120.0, 'tensor': 65536.0}
  """
  if mesh is not None and not isinstance(mesh, jax.sharding.Mesh):
    raise TypeError(
      f"wire_bytes: mesh must be a jax.sharding.Mesh or None, got {type(mesh).__name__}"
    )
  if program not in PROGRAMS:
    raise ValueError(f"wire_bytes: program must be one of {PROGRAMS}, got {program!r}")
  if isinstance(fn, jax.stages.Traced) and not (
    reference is None or isinstance(reference, jax.stages.Traced)
  ):
    raise TypeError("wire_bytes: reference must be a jax.stages.Traced when fn is one")
  traced = _traced(fn, args, "fn")
  text, ndev, ids = _compiled(traced, program)
  colls = parse_hlo(text, ndev, mesh=mesh, device_ids=ids)
  result: dict[str, Any] = {
    "collectives": colls,
    "by_op": _by_op(colls),
    "total": float(sum(c["sent_bytes"] for c in colls)),
    "choices": _choices(traced.jaxpr),
  }
  if mesh is not None:
    result["by_axis"] = by_axis(colls)
  if reference is not None:
    rtext, _, rids = _compiled(_traced(reference, args, "reference"), program)
    rcolls = parse_hlo(rtext, ndev, mesh=mesh, device_ids=rids)
    result["reference_by_op"] = _by_op(rcolls)
    result["reference_total"] = float(sum(c["sent_bytes"] for c in rcolls))
    result["ratio"] = (
      result["total"] / result["reference_total"] if result["reference_total"] else float("nan")
    )
    if mesh is not None:
      result["reference_by_axis"] = by_axis(rcolls)
  return result


def axis_key(axes: tuple[str, ...] | str) -> str:
  """The ``by_axis`` key of an axes tuple: names joined by commas ("?" stays "?")."""
  return axes if isinstance(axes, str) else ",".join(axes)


def by_axis(colls: list[dict[str, Any]]) -> dict[str, float]:
  """Sums ``sent_bytes`` of :func:`parse_hlo`'s collectives (parsed with a mesh) by axes."""
  out: dict[str, float] = {}
  for c in colls:
    key = axis_key(c["axes"])
    if c["sent_bytes"] or key == _UNKNOWN_AXES:
      out[key] = out.get(key, 0.0) + c["sent_bytes"]
  return out


def _by_op(colls: list[dict[str, Any]]) -> dict[str, float]:
  out = {op: 0.0 for op in _OPS}
  for c in colls:
    out[c["op"]] += c["sent_bytes"]
  return {k: v for k, v in out.items() if v}


_CHOICE_PARAMS = ("axes", "algorithm", "requested", "compressor", "chunks", "backend")


def choices(fn: Callable[..., Any], *args: Any) -> list[dict[str, Any]]:
  """What each jcoccl collective in ``fn`` chose when traced: one dict per call site, in
  program order, with ``op`` and the primitive's ``axes``, ``algorithm`` ("exact" when
  ``algorithm="auto_exact"`` chose the lax op), ``requested`` (all_reduce: the algorithm
  asked for, e.g. "auto" or "auto_exact"), ``compressor``, ``chunks`` and ``backend``.

  Example:
    >>> choices(f, x)                                                     # doctest: +SKIP
    [{'op': 'all_reduce', 'axes': ('data',), 'algorithm': 'exact', ...}]
  """
  return _choices(jax.make_jaxpr(fn)(*args))


def _choices(closed: Any) -> list[dict[str, Any]]:
  found: list[dict[str, Any]] = []
  _walk(closed.jaxpr, found)
  return found


def _walk(jaxpr: Any, found: list[dict[str, Any]]) -> None:
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name.startswith("jcoccl_"):
      d = {"op": name[len("jcoccl_") :]}
      d.update({k: eqn.params[k] for k in _CHOICE_PARAMS if k in eqn.params})
      found.append(d)
    for v in eqn.params.values():
      for sub in v if isinstance(v, (tuple, list)) else (v,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          _walk(inner, found)

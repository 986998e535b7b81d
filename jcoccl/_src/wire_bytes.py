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

Async pairs (``*-start``/``*-done``) are counted once, from the ``-done`` result.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import jax

_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}
_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<type>.+?)\s+"
    r"(?P<op>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
    r"(?P<suffix>-start|-done)?\((?P<rest>.*)$")
_SHAPE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")


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


def _group_size(rest: str, num_devices: int) -> int:
  m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", rest)
  if m:
    sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group(1)))
    names = re.findall(r"'([^']+)'", m.group(2))
    n = 1
    for name in names:
      n *= int(sizes[name])
    return n
  m = re.search(r"replica_groups=\{\{([0-9,]*)\}", rest)
  if m:
    return len(m.group(1).split(","))
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", rest)
  if m:
    return int(m.group(2))
  return num_devices


def _sent(op: str, s: int, n: int, rest: str, num_devices: int) -> float:
  if op == "all-reduce":
    return 2 * (n - 1) / n * s
  if op in ("all-gather", "all-to-all"):
    return (n - 1) / n * s
  if op == "reduce-scatter":
    return (n - 1) * s
  pairs = re.findall(r"\{(\d+),(\d+)\}", rest.split("source_target_pairs=", 1)[-1])
  moving = sum(1 for a, b in pairs if a != b)
  return s * moving / max(num_devices, 1)


def parse_hlo(text: str, num_devices: int) -> list[dict[str, Any]]:
  """The collectives of an HLO module's text with their per-device bytes sent."""
  m = re.search(r"num_partitions=(\d+)", text)
  if m and int(m.group(1)) > 1:
    num_devices = int(m.group(1))
  out = []
  for line in text.splitlines():
    mm = _INSTR.match(line)
    if not mm or mm.group("suffix") == "-start":
      continue
    op, rest = mm.group("op"), mm.group("rest")
    s, dtypes = _nbytes(mm.group("type"))
    n = _group_size(rest, num_devices)
    if mm.group("suffix") == "-done":
      n = _group_size(_start_line(text, rest), num_devices)
    out.append({"op": op, "bytes": s, "dtype": dtypes, "group_size": n,
                "sent_bytes": _sent(op, s, n, rest, num_devices)})
  return out


def _start_line(text: str, done_rest: str) -> str:
  name = done_rest.split(")", 1)[0].strip().lstrip("%")
  for line in text.splitlines():
    if re.match(rf"^\s*(?:ROOT\s+)?%?{re.escape(name)}\s*=", line):
      return line
  return ""


def _compiled_text(fn: Callable[..., Any], args: tuple) -> tuple[str, int]:
  jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
  compiled = jitted.lower(*args).compile()
  return compiled.as_text(), jax.device_count()


def wire_bytes(fn: Callable[..., Any], *args: Any, reference: Callable[..., Any] | None = None
               ) -> dict[str, Any]:
  """Bytes each device sends per collective in ``fn``'s compiled program.

  Args:
    fn: a jitted (or jittable) function, typically ``jax.jit(jax.shard_map(...))``.
    *args: example arguments (arrays or ShapeDtypeStructs).
    reference: optional second program (e.g. the same computation with lax collectives)
      whose totals are reported alongside, with the ratio ``total / reference_total``.

  Returns:
    dict with "collectives" (list of {op, bytes, dtype, group_size, sent_bytes}),
    "by_op" ({op: sent bytes}), "total" (sent bytes per device), and, with ``reference``,
    "reference_total", "reference_by_op" and "ratio".

  Example:
    >>> wb = jcoccl.wire_bytes(f_int8, x, reference=f_lax)   # doctest: +SKIP
    >>> wb["ratio"] < 0.27
    True
  """
  text, ndev = _compiled_text(fn, args)
  colls = parse_hlo(text, ndev)
  result: dict[str, Any] = {"collectives": colls, "by_op": _by_op(colls),
                            "total": float(sum(c["sent_bytes"] for c in colls))}
  if reference is not None:
    rtext, _ = _compiled_text(reference, args)
    rcolls = parse_hlo(rtext, ndev)
    result["reference_by_op"] = _by_op(rcolls)
    result["reference_total"] = float(sum(c["sent_bytes"] for c in rcolls))
    result["ratio"] = (result["total"] / result["reference_total"]
                       if result["reference_total"] else float("nan"))
  return result


def _by_op(colls: list[dict[str, Any]]) -> dict[str, float]:
  out = {op: 0.0 for op in _OPS}
  for c in colls:
    out[c["op"]] += c["sent_bytes"]
  return {k: v for k, v in out.items() if v}

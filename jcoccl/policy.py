"""Per-axis, per-op compression policy: which compressor each collective uses on each mesh axis.

A policy maps mesh axis names (``"data"``, ``"tensor"``, ``"pipe"``, or ``"*"`` for every axis
not named) to a table of op -> compressor spec, plus per-axis options:

  ``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``, ``ppermute``:
      a spec string for ``jcoccl.compressors.parse`` (``"int8"``, ``"int4:block=128,asym"``,
      ``"fp8"``), ``"hadamard(<inner spec>)"``, a Compressor, or ``"none"``/None (exact).
  ``error_feedback``: bool, keep the compression residual of gradient sums and add it back.
  ``zero``: bool (the data axis), ZeRO-style data parallelism in ``models.parallel``: gradients
      reduce-scattered over the axis (with ``reduce_scatter``'s compressor), the optimizer
      state sharded over it, updated parameters all-gathered (with ``all_gather``'s).
  ``min_bytes``: int, messages under it go uncompressed (jcoccl's default otherwise).
  ``algorithm``: str, the all_reduce algorithm (``"auto"``, ``"one_shot"``, ...).

Example:
  >>> policy = Policy.from_dict({
  ...     "data": {"all_reduce": "hadamard(int4)", "reduce_scatter": "int4",
  ...              "error_feedback": True},
  ...     "tensor": {"all_reduce": "fp8"},
  ...     "pipe": {"ppermute": "int8"}})
  >>> policy.compressor("pipe", "ppermute")    # a Compressor
  >>> policy.compressor("pipe", "all_reduce")  # None: exact
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from typing import Any, Mapping

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "ppermute")
OPTIONS = ("error_feedback", "zero", "min_bytes", "algorithm")
WILDCARD = "*"
_WRAPPED = re.compile(r"^\s*hadamard\s*\((.*)\)\s*$")


def _parse(spec: Any, where: str) -> Any:
  """A Compressor or None from a spec string, a Compressor, or None."""
  from jcoccl import compressors  # late: compressors import jax and the native codecs

  if spec is None or (isinstance(spec, str) and spec.strip().lower() in ("", "none", "off")):
    return None
  if not isinstance(spec, str):
    if isinstance(spec, compressors.Compressor):
      return spec
    raise TypeError(f"{where} must be a compressor spec string, a Compressor or None, "
                    f"got {type(spec).__name__}")
  m = _WRAPPED.match(spec)
  try:
    if m:
      return compressors.hadamard(_parse(m.group(1), where))
    return compressors.parse(spec)
  except (ValueError, TypeError) as e:
    raise ValueError(f"{where}: cannot parse compressor spec {spec!r}: {e}") from e


@dataclasses.dataclass(frozen=True)
class AxisPolicy:
  """What one mesh axis uses: a compressor (or None) per op, and options."""

  compressors: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  error_feedback: bool = False
  zero: bool = False
  min_bytes: int | None = None
  algorithm: str = "auto"


@dataclasses.dataclass(frozen=True)
class Policy:
  """Per-axis, per-op compressor table (see the module docstring).

  Build with :meth:`from_dict`, :meth:`from_toml` or :meth:`from_specs`; ``Policy()`` is exact
  everywhere.
  """

  axes: Mapping[str, AxisPolicy] = dataclasses.field(default_factory=dict)
  source: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)

  @classmethod
  def from_dict(cls, table: Mapping[str, Mapping[str, Any]]) -> "Policy":
    """Builds a policy from ``{axis: {op or option: value}}``.

    Args:
      table: axis name (or ``"*"``) -> mapping of ops (``all_reduce``, ``all_gather``,
        ``reduce_scatter``, ``all_to_all``, ``ppermute``) to compressor specs and options
        (``error_feedback``, ``zero``, ``min_bytes``, ``algorithm``).

    Returns:
      A Policy.

    Example:
      >>> Policy.from_dict({"tensor": {"all_reduce": "fp8"}}).compressor("tensor", "all_reduce")
    """
    if not isinstance(table, Mapping):
      raise TypeError(f"policy table must be a mapping axis -> {{op: spec}}, got "
                      f"{type(table).__name__}")
    axes = {}
    for axis, entry in table.items():
      if not isinstance(axis, str) or not isinstance(entry, Mapping):
        raise TypeError(f"policy entry {axis!r} must map an axis name to a table of ops, "
                        f"got {type(entry).__name__}")
      axes[axis] = _axis_policy(axis, entry)
    return cls(axes=axes, source={a: dict(e) for a, e in table.items()})

  @classmethod
  def from_toml(cls, path: str) -> "Policy":
    """Reads a TOML file with one table per axis, e.g. ``[data]\\nall_reduce = "int8"``."""
    with open(path, "rb") as f:
      return cls.from_dict(tomllib.load(f))

  @classmethod
  def from_specs(cls, specs: list[str]) -> "Policy":
    """Builds a policy from ``"axis.op=spec"`` strings (command-line form).

    Example:
      >>> Policy.from_specs(["data.all_reduce=int8", "pipe.ppermute=fp8",
      ...                    "data.error_feedback=true", "data.zero=true"])
    """
    table: dict[str, dict[str, Any]] = {}
    for s in specs:
      key, sep, value = s.partition("=")
      axis, dot, op = key.strip().partition(".")
      if not sep or not dot or not axis or not op:
        raise ValueError(f"policy spec must look like 'axis.op=spec' (e.g. "
                         f"'data.all_reduce=int8'), got {s!r}")
      table.setdefault(axis, {})[op.strip()] = _option_value(op.strip(), value.strip())
    return cls.from_dict(table)

  def _axis(self, axis: str) -> AxisPolicy:
    return self.axes.get(axis) or self.axes.get(WILDCARD) or AxisPolicy()

  def compressor(self, axis: str, op: str) -> Any:
    """The Compressor that ``op`` uses on mesh axis ``axis``, or None for the exact path."""
    if op not in OPS:
      raise ValueError(f"op must be one of {OPS}, got {op!r}")
    return self._axis(axis).compressors.get(op)

  def error_feedback(self, axis: str) -> bool:
    """Whether gradient sums over ``axis`` keep and re-add their compression residual."""
    return self._axis(axis).error_feedback

  def zero(self, axis: str) -> bool:
    """Whether ``axis`` (the data axis) runs ZeRO-style: reduce_scatter, sharded optimizer
    state, all_gather."""
    return self._axis(axis).zero

  def options(self, axis: str) -> dict[str, Any]:
    """Keyword arguments (``min_bytes``, ``algorithm``) for jcoccl collectives on ``axis``."""
    a = self._axis(axis)
    out: dict[str, Any] = {"algorithm": a.algorithm}
    if a.min_bytes is not None:
      out["min_bytes"] = a.min_bytes
    return out

  def describe(self) -> str:
    """One line per axis, e.g. ``data: all_reduce=int8 error_feedback``."""
    lines = []
    for axis, a in sorted(self.axes.items()):
      ops = [f"{op}={c}" for op, c in a.compressors.items()]
      if a.error_feedback:
        ops.append("error_feedback")
      if a.zero:
        ops.append("zero")
      if a.min_bytes is not None:
        ops.append(f"min_bytes={a.min_bytes}")
      lines.append(f"{axis}: " + (" ".join(ops) or "exact"))
    return "\n".join(lines) or "exact everywhere"


def _option_value(op: str, value: str) -> Any:
  if op in ("error_feedback", "zero"):
    if value.lower() not in ("true", "false", "1", "0"):
      raise ValueError(f"{op} must be true or false, got {value!r}")
    return value.lower() in ("true", "1")
  if op == "min_bytes":
    try:
      return int(value)
    except ValueError:
      raise ValueError(f"min_bytes must be an integer, got {value!r}") from None
  return value


def _axis_policy(axis: str, entry: Mapping[str, Any]) -> AxisPolicy:
  comps, kw = {}, {}
  for key, value in entry.items():
    if key in OPS:
      c = _parse(value, f"policy[{axis!r}][{key!r}]")
      if c is not None:
        comps[key] = c
    elif key in ("error_feedback", "zero"):
      if not isinstance(value, bool):
        raise TypeError(f"policy[{axis!r}][{key!r}] must be a bool, got {value!r}")
      kw[key] = value
    elif key == "min_bytes":
      if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"policy[{axis!r}]['min_bytes'] must be a non-negative int, "
                         f"got {value!r}")
      kw[key] = value
    elif key == "algorithm":
      if not isinstance(value, str):
        raise TypeError(f"policy[{axis!r}]['algorithm'] must be a string, got {value!r}")
      kw[key] = value
    else:
      raise ValueError(f"policy[{axis!r}] has unknown key {key!r}; accepted: "
                       f"{', '.join(OPS + OPTIONS)}")
  return AxisPolicy(compressors=comps, **kw)

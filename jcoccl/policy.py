"""Per-axis, per-op compression policy: which compressor each collective uses on each mesh axis.

A policy maps mesh axis names (``"data"``, ``"tensor"``, ``"pipe"``, or ``"*"`` for every axis
not named) to a table of op -> compressor spec, plus per-axis options:

  ``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``, ``ppermute``:
      a spec string for ``jcoccl.compressors.parse`` (``"int8"``, ``"int4:block=128,asym"``,
      ``"fp8"``), ``"hadamard(<inner spec>)"``, a Compressor, or ``"none"``/None (exact).
  ``min_bytes``: int >= 0, messages under it go uncompressed (jcoccl's default otherwise).
  ``algorithm``: the all_reduce algorithm on one axis: ``"auto"``, ``"auto_exact"`` (as
      ``"auto:<spec>"``), ``"one_shot"`` or ``"two_shot"`` (``"hierarchical"`` needs two
      axes, which a per-axis entry cannot name).

A codec named for an op is used: with the default ``algorithm="auto"`` the cost model only
chooses how to send it (one_shot, two_shot, ...). ``all_reduce = "auto:<spec>"`` (e.g.
``"auto:int8"``) opts in to "compress only where it pays": the call's algorithm is
``"auto_exact"`` whatever the axis's ``algorithm`` pins, and with a calibration
(:func:`jcoccl.calibrate`) it may run the exact lax op where that is predicted faster;
without one it is one_shot or two_shot, never the exact op. :func:`jcoccl.explain` shows
what each call decided and why.

Codecs of your own: a top-level ``[codecs]`` table names what to bring in before the
specs are read, ``modules`` (imported: they call ``jcoccl.compressors.register``) and
``plugins`` (native plugin libraries for ``jcoccl.compressors.load_plugin``; relative paths
are taken from the TOML file's directory)::

  [codecs]
  modules = ["examples.custom_codecs.topk"]
  [data]
  all_reduce = "topk:k=8"

Training-recipe switches (``error_feedback``, ``zero``, ``nodes``) are not part of a jcoccl
policy: they belong to the training loop in ``models/`` (``models.recipe.Recipe`` reads them
from the same TOML files next to the compressor keys), and a Policy refuses them with an
error that says so.

Everything is checked when the policy is built: unknown axes (with ``axes=``, the mesh's axis
names), unknown ops or options, values of the wrong type or range, unknown algorithms and
malformed compressor specs raise an error that names the entry the way its source writes it:
``policy['data']['min_bytes']`` (dict), ``p.toml: [data] min_bytes`` (TOML file),
``data.min_bytes`` (specs).

Example:
  >>> policy = Policy.from_dict({
  ...     "data": {"all_reduce": "hadamard(int4)", "reduce_scatter": "int4",
  ...              "min_bytes": 0},
  ...     "tensor": {"all_reduce": "fp8"},
  ...     "pipe": {"ppermute": "int8"}})
  >>> policy.compressor("pipe", "ppermute")    # a Compressor
  >>> policy.compressor("pipe", "all_reduce")  # None: exact
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import tomllib
from collections.abc import Mapping, Sequence
from typing import Any

from jcoccl._src.base.op_names import OPS as OPS

OPTIONS = ("min_bytes", "algorithm")
ALGORITHMS = ("auto", "auto_exact", "one_shot", "two_shot")
WILDCARD = "*"
CODECS = "codecs"  # the top-level table that names codec modules and plugins
# Keys of the TOML files that models/ reads which are training-loop switches, not collective
# settings: refused here with a pointer to where they belong.
TRAINING_OPTIONS = ("error_feedback", "zero", "nodes")
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


@dataclasses.dataclass(frozen=True)
class Origin:
  """Where policy entries come from, to name them in errors as their source writes them
  (models/recipe.py names its training switches the same way).

  Example:
    >>> Origin("toml", "p.toml").at("data", "min_bytes"), Origin("spec").at("data", "zero")
    ('p.toml: [data] min_bytes', 'data.zero')
  """

  kind: str  # "dict", "toml" or "spec"
  name: str = "policy"

  def at(self, axis: Any, key: Any = None) -> str:
    """``policy['data']['min_bytes']``, ``p.toml: [data] min_bytes`` or ``data.min_bytes``."""
    if self.kind == "toml":
      head = axis if _BARE_KEY.fullmatch(str(axis)) else json.dumps(str(axis))
      return f"{self.name}: [{head}]" + ("" if key is None else f" {key}")
    if self.kind == "spec":
      return str(axis) + ("" if key is None else f".{key}")
    return f"{self.name}[{axis!r}]" + ("" if key is None else f"[{key!r}]")

  def type_error(self, msg: str) -> Exception:
    # A value of the wrong type is a TypeError in Python code; in a file or on a command line
    # it is a bad value like any other.
    return TypeError(msg) if self.kind == "dict" else ValueError(msg)


AUTO_PREFIX = "auto:"


def _parse(spec: Any, where: str, origin: Origin) -> Any:
  """A Compressor or None from a spec string, a Compressor, or None."""
  from jcoccl import compressors  # late: compressors import jax and the native codecs

  if spec is None:
    return None
  if not isinstance(spec, str):
    if isinstance(spec, compressors.Compressor):
      return spec
    raise origin.type_error(
      f"{where} must be a compressor spec string, a Compressor or None, "
      f"got {type(spec).__name__} {spec!r}"
    )
  if not spec.strip():
    raise ValueError(f'{where}: empty compressor spec; write "none" for the exact path')
  if spec.strip().lower() in ("none", "off"):
    return None
  try:
    return compressors.parse(spec)
  except (ValueError, TypeError) as e:
    raise ValueError(f"{where}: cannot parse compressor spec {spec!r}: {e}") from e


@dataclasses.dataclass(frozen=True)
class AxisPolicy:
  """What one mesh axis uses: a compressor (or None) per op, and options."""

  compressors: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  min_bytes: int | None = None
  algorithm: str = "auto"
  auto_ops: frozenset = frozenset()  # ops written "auto:<spec>": algorithm auto for them


@dataclasses.dataclass(frozen=True)
class Policy:
  """Per-axis, per-op compressor table (see the module docstring).

  Build with :meth:`from_dict`, :meth:`from_toml` or :meth:`from_specs`; ``Policy()`` is exact
  everywhere.
  """

  axes: Mapping[str, AxisPolicy] = dataclasses.field(default_factory=dict)
  source: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)

  @classmethod
  def from_dict(
    cls, table: Mapping[str, Mapping[str, Any]], *, axes: Sequence[str] | None = None
  ) -> Policy:
    """Builds a policy from ``{axis: {op or option: value}}``.

    Args:
      table: axis name (or ``"*"``) -> mapping of ops (``all_reduce``, ``all_gather``,
        ``reduce_scatter``, ``all_to_all``, ``ppermute``) to compressor specs and options
        (``min_bytes``, ``algorithm``).
      axes: the mesh's axis names, if known: other axis names (except ``"*"``) are errors.

    Returns:
      A Policy.

    Raises:
      ValueError: unknown axis, op or option (``error_feedback``, ``zero`` and ``nodes`` are
        training options of models.recipe); out-of-range value; bad spec or algorithm.
      TypeError: a value of the wrong type.

    Example:
      >>> Policy.from_dict({"tensor": {"all_reduce": "fp8"}}).compressor("tensor", "all_reduce")
    """
    return cls._build(table, Origin("dict"), axes)

  @classmethod
  def from_toml(
    cls, path: str, *, axes: Sequence[str] | None = None, table: Mapping[str, Any] | None = None
  ) -> Policy:
    """Reads a TOML file with one table per axis, e.g. ``[data]\\nall_reduce = "int8"``.

    Args:
      path: the file.
      axes: as in :meth:`from_dict`.
      table: the file's contents, already parsed (a reader that takes keys of its own out of
        the file first passes the rest here); errors still name ``path``.

    Returns:
      A Policy. Errors are ValueErrors that name the file, table and key
      (``p.toml: [tensor] algorithm: ...``).

    Example:
      >>> Policy.from_toml("models/configs/int8.toml", axes=("data", "tensor", "pipe"))
    """
    if table is None:
      table = load_toml(path)
    return cls._build(table, Origin("toml", str(path)), axes, os.path.dirname(str(path)))

  @classmethod
  def from_specs(cls, specs: Sequence[str], *, axes: Sequence[str] | None = None) -> Policy:
    """Builds a policy from ``"axis.op=spec"`` strings (command-line form).

    Args:
      specs: e.g. ``["data.all_reduce=int8", "data.min_bytes=0"]``.
      axes: as in :meth:`from_dict`.

    Returns:
      A Policy; errors name the entry as ``axis.key``.

    Example:
      >>> Policy.from_specs(["data.all_reduce=int8", "pipe.ppermute=fp8",
      ...                    "data.min_bytes=0"])
    """
    if isinstance(specs, str):
      raise TypeError(f"specs must be a list of 'axis.op=spec' strings, got the string {specs!r}")
    table: dict[str, dict[str, Any]] = {}
    for s in specs:
      key, sep, value = s.partition("=")
      axis, dot, op = key.strip().partition(".")
      axis, op = axis.strip(), op.strip()
      if not sep or not dot or not axis or not op:
        raise ValueError(
          f"policy spec must look like 'axis.op=spec' (e.g. 'data.all_reduce=int8'), got {s!r}"
        )
      table.setdefault(axis, {})[op] = _option_value(f"{axis}.{op}", op, value.strip())
    return cls._build(table, Origin("spec"), axes)

  @classmethod
  def _build(
    cls, table: Any, origin: Origin, axes: Sequence[str] | None, base_dir: str | None = None
  ) -> Policy:
    if not isinstance(table, Mapping):
      raise origin.type_error(
        f"{origin.name}: a policy must be a mapping axis -> {{op: spec}}, "
        f"got {type(table).__name__}"
      )
    table = dict(table)
    if CODECS in table:
      table[CODECS] = _codecs(table[CODECS], origin, base_dir)
    built = {}
    for axis, entry in table.items():
      if axis == CODECS:
        continue
      _check_axis(axis, entry, origin, axes)
      built[axis] = _axis_policy(axis, entry, origin)
    return cls(axes=built, source={a: dict(e) for a, e in table.items()})

  def _axis(self, axis: str) -> AxisPolicy:
    return self.axes.get(axis) or self.axes.get(WILDCARD) or AxisPolicy()

  def compressor(self, axis: str, op: str) -> Any:
    """The Compressor that ``op`` uses on mesh axis ``axis``, or None for the exact path."""
    if op not in OPS:
      raise ValueError(f"op must be one of {OPS}, got {op!r}")
    return self._axis(axis).compressors.get(op)

  def options(self, axis: str, op: str | None = None) -> dict[str, Any]:
    """Keyword arguments (``min_bytes``, ``algorithm``) for jcoccl collectives on ``axis``
    (for ``op``, when given: an ``"auto:<spec>"`` entry makes its algorithm
    "auto_exact", which may choose the exact op)."""
    a = self._axis(axis)
    out: dict[str, Any] = {"algorithm": "auto_exact" if op in a.auto_ops else a.algorithm}
    if a.min_bytes is not None:
      out["min_bytes"] = a.min_bytes
    return out

  def describe(self) -> str:
    """One line per axis, e.g. ``data: all_reduce=int8 min_bytes=0``."""
    lines = []
    for axis, a in sorted(self.axes.items()):
      ops = [
        f"{op}={AUTO_PREFIX if op in a.auto_ops else ''}{c}" for op, c in a.compressors.items()
      ]
      if a.min_bytes is not None:
        ops.append(f"min_bytes={a.min_bytes}")
      if a.algorithm != "auto":
        ops.append(f"algorithm={a.algorithm}")
      lines.append(f"{axis}: " + (" ".join(ops) or "exact"))
    return "\n".join(lines) or "exact everywhere"


def load_toml(path: str) -> dict[str, Any]:
  """The parsed TOML file ``path``; a syntax error is a ValueError naming the file."""
  with open(path, "rb") as f:
    try:
      return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
      raise ValueError(f"{path}: not valid TOML: {e}") from None


def _codecs(entry: Any, origin: Origin, base_dir: str | None) -> dict[str, list[str]]:
  """Imports the ``[codecs]`` table's modules and loads its plugins; returns the table with
  plugin paths made absolute (a policy rebuilt from ``source`` finds them anywhere)."""
  from jcoccl._src.compressors.sources import import_codecs

  where = origin.at(CODECS)
  if not isinstance(entry, Mapping):
    raise origin.type_error(f"{where} must be a table with modules = [...] and plugins = [...]")
  out = {}
  for key, value in entry.items():
    if key not in ("modules", "plugins"):
      raise ValueError(f"{where} has unknown key {key!r}; accepted: modules, plugins")
    if isinstance(value, str) or not isinstance(value, Sequence):
      raise origin.type_error(f"{origin.at(CODECS, key)} must be a list of strings, got {value!r}")
    try:
      out[key] = import_codecs(list(value), base_dir=base_dir)
    except ValueError as e:
      raise ValueError(f"{origin.at(CODECS, key)}: {e}") from None
  return out


def _option_value(where: str, op: str, value: str) -> Any:
  """The typed value of a command-line ``axis.op=value``."""
  if op == "min_bytes":
    if not re.fullmatch(r"[0-9]+", value):
      raise ValueError(f"{where}: {op} must be a non-negative integer, got {value!r}")
    return int(value)
  return value


def _check_axis(axis: Any, entry: Any, origin: Origin, axes: Sequence[str] | None) -> None:
  """An axis name the mesh has (or ``"*"``) mapped to a table."""
  if not isinstance(axis, str) or not axis.strip():
    raise origin.type_error(f"{origin.at(axis)}: an axis name must be a non-empty string")
  if not isinstance(entry, Mapping):
    raise origin.type_error(
      f"{origin.at(axis)} must be a table of ops and options (e.g. "
      f'all_reduce = "int8"), got {type(entry).__name__} {entry!r}'
    )
  if axes is not None and axis != WILDCARD and axis not in axes:
    raise ValueError(
      f"{origin.at(axis)}: unknown axis {axis!r}; the mesh's axes are "
      f"{', '.join(map(repr, axes))}, or '*' for every axis not named" + _did_you_mean(axis, axes)
    )


def _did_you_mean(word: str, choices: Sequence[str]) -> str:
  close = difflib.get_close_matches(word, choices, n=1)
  return f" (did you mean {close[0]!r}?)" if close else ""


def _axis_policy(axis: str, entry: Mapping[str, Any], origin: Origin) -> AxisPolicy:
  comps, kw, auto = {}, {}, set()
  for key, value in entry.items():
    where = origin.at(axis, key)
    if key in OPS and isinstance(value, str) and value.strip().startswith(AUTO_PREFIX):
      if key != "all_reduce":
        raise ValueError(
          f"{where}: {AUTO_PREFIX!r} chooses among all_reduce algorithms and the exact op; "
          f"{key} has no algorithm to choose: write the spec alone, e.g. {value.strip()[5:]!r}"
        )
      auto.add(key)
      value = value.strip()[len(AUTO_PREFIX) :]
    if key in OPS:
      c = _parse(value, where, origin)
      if c is not None:
        comps[key] = c
    elif key in OPTIONS:
      kw[key] = _option(key, value, where, origin)
    elif key in TRAINING_OPTIONS:
      raise ValueError(
        f"{where}: {key} is a training option of models/ (models.recipe.Recipe, "
        f"which python -m models.train --policy uses), not a jcoccl.Policy "
        f"setting; read the file with models.recipe.Recipe.from_toml (its "
        f".policy is this Policy) or leave {key} out"
      )
    else:
      raise ValueError(
        f"{origin.at(axis)} has unknown key {key!r}; accepted: "
        f"{', '.join(OPS + OPTIONS)}" + _did_you_mean(str(key), OPS + OPTIONS)
      )
  return AxisPolicy(compressors=comps, auto_ops=frozenset(auto & set(comps)), **kw)


def _option(key: str, value: Any, where: str, origin: Origin) -> Any:
  """The checked value of option ``key`` (one of OPTIONS)."""
  if key == "min_bytes":
    if isinstance(value, bool) or not isinstance(value, int):
      raise origin.type_error(f"{where} must be a non-negative int, got {value!r}")
    if value < 0:
      raise ValueError(f"{where} must be a non-negative int, got {value!r}")
    return value
  if not isinstance(value, str):
    raise origin.type_error(f"{where} must be a string, one of {ALGORITHMS}, got {value!r}")
  if value not in ALGORITHMS:
    why = (
      " ('hierarchical' needs a tuple of two or more axes; a policy entry names one)"
      if value == "hierarchical"
      else _did_you_mean(value, ALGORITHMS)
    )
    raise ValueError(f"{where} must be one of {ALGORITHMS}, got {value!r}{why}")
  return value

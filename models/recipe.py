"""The training recipe: a jcoccl.Policy plus the training loop's switches on the data axis.

The TOML files under models/configs (``python -m models.train --policy``) hold, per mesh axis,
jcoccl's compressor keys and options (``all_reduce``, ..., ``min_bytes``, ``algorithm``: see
:mod:`jcoccl.policy`) and, in the ``[data]`` table only, these switches of
:class:`models.parallel.Parallel3D`:

  ``error_feedback``: bool, keep the compression residual of the gradient sums over the data
      level and add it back next step.
  ``zero``: bool, ZeRO-style data parallelism: gradients reduce-scattered over 'data' (with
      ``reduce_scatter``'s compressor), the optimizer state sharded over it, updated parameters
      all-gathered (with ``all_gather``'s).
  ``nodes``: int >= 1 (with ``zero``), ZeRO++'s hierarchy: the data ranks form this many
      nodes, the mesh's data level becomes the two axes ("node", "data") (node outer; in a
      multi-process run node = process), and gradients and parameters move inside the node and
      across nodes in separate steps. A ``[node]`` table sets the across-node compressors
      (default: ``[data]``'s).

A top-level ``[directions]`` table gives one direction of an axis its own codec, as
``python -m models.train --direction`` does (the flag wins over the file)::

  [directions]
  "tensor.backward" = "hadamard(int3)"   # the activation gradients; the forward keeps [tensor]'s

Its keys are the points of :data:`models.directions.POINTS` (``tensor.forward``,
``tensor.backward``, ``pipe.forward``, ``pipe.backward``, ``data``), its values codec specs
or ``"exact"``; every message of a directed point is compressed (``min_bytes`` 0).

Any entry, of an axis or of ``[directions]``, may round stochastically (``int4:stochastic``,
``hadamard(int4:block=64,stochastic)``): the train step draws a key per call from the run's
seed, the step, the point and the call (:mod:`models.collectives`), so such a run repeats and
resumes bitwise.

A :class:`Recipe` splits these keys off and builds the jcoccl.Policy from the rest. Errors name
the entry as its source writes it (``policy['data']['zero']`` for a dict, ``p.toml: [data]
zero`` for a file, ``data.zero`` for a command-line spec) and say what is accepted.

Example:
  >>> r = Recipe.from_dict({"data": {"all_reduce": "int4", "error_feedback": True}})
  >>> r.error_feedback, r.policy.compressor("data", "all_reduce")
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Mapping, Sequence
from typing import Any

from jcoccl.policy import (
  AUTO_PREFIX,
  CODECS,
  OPS,
  OPTIONS,
  TRAINING_OPTIONS,
  Origin,
  Policy,
  load_toml,
)
from models.directions import POINTS, check_directions

DATA_AXIS = "data"
DIRECTIONS = "directions"  # the top-level table of per-direction codecs
KEYS = TRAINING_OPTIONS  # ("error_feedback", "zero", "nodes"), on the data axis only


@dataclasses.dataclass(frozen=True)
class Recipe:
  """A jcoccl.Policy (the collectives' compressors) and the training loop's data-axis switches.

  Build with :meth:`from_dict`, :meth:`from_toml` or :meth:`from_specs`; ``Recipe()`` is exact
  plain data parallelism. ``source`` is the table it was read from, recipe keys included.
  """

  policy: Policy = dataclasses.field(default_factory=Policy)
  error_feedback: bool = False
  zero: bool = False
  nodes: int = 1
  source: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
  directions: Mapping[str, str] = dataclasses.field(default_factory=dict)

  @classmethod
  def from_dict(
    cls, table: Mapping[str, Mapping[str, Any]], *, axes: Sequence[str] | None = None
  ) -> Recipe:
    """Builds a recipe from ``{axis: {op, option or switch: value}}``.

    Args:
      table: as :meth:`jcoccl.Policy.from_dict`, plus ``error_feedback``, ``zero`` and
        ``nodes`` in the ``"data"`` entry.
      axes: the mesh's axis names, if known (checked by the Policy).

    Returns:
      A Recipe.

    Raises:
      ValueError: unknown key, a switch off the data axis, an out-of-range value, or any
        error of :meth:`jcoccl.Policy.from_dict`.
      TypeError: a value of the wrong type.

    Example:
      >>> Recipe.from_dict({"data": {"zero": True, "reduce_scatter": "int4"}}).zero
      True
    """
    where = Origin("dict")
    rest, kw = _split(table, where)
    return cls(Policy.from_dict(rest, axes=axes), source=_copy(table), **kw)

  @classmethod
  def from_toml(cls, path: str, *, axes: Sequence[str] | None = None) -> Recipe:
    """Reads a TOML file of models/configs' format (one table per axis).

    Args:
      path: the file.
      axes: as in :meth:`from_dict`.

    Returns:
      A Recipe. Errors are ValueErrors naming the file, table and key
      (``p.toml: [tensor] zero: ...``).

    Example:
      >>> Recipe.from_toml("models/configs/zeropp.toml").nodes
      2
    """
    table = load_toml(str(path))
    rest, kw = _split(table, Origin("toml", str(path)))
    policy = Policy.from_toml(str(path), axes=axes, table=rest)
    source = _copy(table)
    if CODECS in policy.source:  # plugin paths made absolute: rebuilt anywhere, they load
      source[CODECS] = policy.source[CODECS]
    return cls(policy, source=source, **kw)

  @classmethod
  def from_specs(cls, specs: Sequence[str], *, axes: Sequence[str] | None = None) -> Recipe:
    """Builds a recipe from ``"axis.key=value"`` strings (command-line form).

    Args:
      specs: e.g. ``["data.all_reduce=int8", "data.zero=true", "data.nodes=2"]``.
      axes: as in :meth:`from_dict`.

    Returns:
      A Recipe; errors name the entry as ``axis.key``.

    Example:
      >>> Recipe.from_specs(["data.error_feedback=true", "data.all_reduce=int4"]).error_feedback
      True
    """
    if isinstance(specs, str):
      raise TypeError(f"specs must be a list of 'axis.key=value' strings, got the string {specs!r}")
    where, table, rest = Origin("spec"), {}, []
    for s in specs:
      key, sep, value = s.partition("=")
      axis, _, name = key.strip().partition(".")
      axis, name = axis.strip(), name.strip()
      if sep and axis and name in KEYS:
        table.setdefault(axis, {})[name] = _spec_value(where.at(axis, name), name, value.strip())
      else:
        rest.append(s)
    policy = Policy.from_specs(rest, axes=axes)
    _, kw = _split(table, where)
    for axis, entry in policy.source.items():
      table.setdefault(axis, {}).update(entry)
    return cls(policy, source=table, **kw)

  def describe(self) -> str:
    """One line per axis, e.g. ``data: all_reduce=int8 error_feedback zero min_bytes=0``."""
    switches = (
      (["error_feedback"] if self.error_feedback else [])
      + (["zero"] if self.zero else [])
      + ([f"nodes={self.nodes}"] if self.nodes != 1 else [])
    )
    axes = dict(self.policy.axes)
    if switches and DATA_AXIS not in axes:
      axes[DATA_AXIS] = None
    directed = [f"{p}={c}" for p, c in self.directions.items()]
    if not axes:
      return "exact everywhere" if not directed else "directions: " + " ".join(directed)
    lines = []
    for axis, a in sorted(axes.items()):
      # As the policy writes them: an "auto:<spec>" entry keeps its prefix (it may run the
      # exact op), a plain spec always compresses.
      words = [] if a is None else [_entry(a, op, c) for op, c in a.compressors.items()]
      words += switches if axis == DATA_AXIS else []
      if a is not None and a.min_bytes is not None:
        words.append(f"min_bytes={a.min_bytes}")
      if a is not None and a.algorithm != "auto":
        words.append(f"algorithm={a.algorithm}")
      lines.append(f"{axis}: " + (" ".join(words) or "exact"))
    if directed:
      lines.append("directions: " + " ".join(directed))
    return "\n".join(lines)


def _entry(axis_policy: Any, op: str, codec: Any) -> str:
  """``op=spec`` of one policy entry, ``op=auto:spec`` where the policy wrote it so."""
  auto = AUTO_PREFIX if op in axis_policy.auto_ops else ""
  return f"{op}={auto}{codec}"


def as_recipe(recipe: Recipe | Policy | Mapping | None) -> Recipe:
  """``recipe`` as a Recipe: a Policy alone is a recipe with every switch off.

  Example:
    >>> as_recipe(Policy()).zero
    False
  """
  if recipe is None:
    return Recipe()
  if isinstance(recipe, Recipe):
    return recipe
  if isinstance(recipe, Policy):
    return Recipe(recipe, source=_copy(recipe.source))
  if isinstance(recipe, Mapping):
    return Recipe.from_dict(recipe)
  raise TypeError(
    f"recipe must be a models.recipe.Recipe, a jcoccl.Policy, a mapping "
    f"{{axis: {{key: value}}}} or None, got {type(recipe).__name__} {recipe!r}"
  )


def _copy(table: Any) -> dict:
  return (
    {a: dict(e) if isinstance(e, Mapping) else e for a, e in table.items()}
    if isinstance(table, Mapping)
    else table
  )


def _split(table: Any, where: Origin) -> tuple[Any, dict[str, Any]]:
  """(the table without the recipe switches, the checked switches as Recipe keywords).

  Malformed tables (not a mapping, an axis entry not a table) pass through unchanged for the
  Policy to report.
  """
  if not isinstance(table, Mapping):
    return table, {}
  rest, kw = {}, {}
  for axis, entry in table.items():
    if not isinstance(entry, Mapping) or axis == CODECS:  # [codecs] is the Policy's to read
      rest[axis] = entry
      continue
    if axis == DIRECTIONS:
      kw["directions"] = _directions(entry, where)
      continue
    rest[axis] = {}
    for key, value in entry.items():
      if key in KEYS:
        kw[key] = _switch(axis, key, value, where)
      elif key in OPS or key in OPTIONS:
        rest[axis][key] = value
      else:
        accepted = OPS + OPTIONS + KEYS
        close = difflib.get_close_matches(str(key), accepted, n=1)
        raise ValueError(
          f"{where.at(axis)} has unknown key {key!r}; accepted: "
          f"{', '.join(accepted)} ({', '.join(KEYS)} on {DATA_AXIS!r} only)"
          + (f" (did you mean {close[0]!r}?)" if close else "")
        )
  return rest, kw


def _directions(entry: Mapping[str, Any], where: Origin) -> dict[str, str]:
  """The checked ``[directions]`` table: ``{point: codec spec}``."""
  for point, spec in entry.items():
    at = where.at(DIRECTIONS, point)
    if not isinstance(spec, str):
      raise where.type_error(f"{at} must be a codec spec string, got {spec!r}")
    try:
      check_directions({point: spec})
    except ValueError as e:
      raise ValueError(f"{at}: {e} (points: {', '.join(POINTS)})") from None
  return dict(entry)


def _switch(axis: Any, key: str, value: Any, where: Origin) -> Any:
  """The checked value of recipe switch ``key`` on ``axis``."""
  at = where.at(axis, key)
  if key == "nodes":
    if isinstance(value, bool) or not isinstance(value, int):
      raise where.type_error(f"{at} must be a positive int, got {value!r}")
    if value < 1:
      raise ValueError(f"{at} must be a positive int, got {value!r}")
  elif not isinstance(value, bool):
    raise where.type_error(f"{at} must be a bool (true or false), got {value!r}")
  if axis != DATA_AXIS:
    raise ValueError(
      f"{at}: {key} applies to the {DATA_AXIS!r} axis only; set it there ({where.at(DATA_AXIS, key)})"
    )
  return value


def _spec_value(at: str, key: str, value: str) -> Any:
  """The typed value of a command-line ``data.key=value`` switch."""
  if key == "nodes":
    if not re.fullmatch(r"[0-9]+", value):
      raise ValueError(f"{at}: {key} must be a positive integer, got {value!r}")
    return int(value)
  if value.lower() not in ("true", "false", "1", "0"):
    raise ValueError(f"{at}: {key} must be true or false, got {value!r}")
  return value.lower() in ("true", "1")

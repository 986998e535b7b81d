"""The table of compressor families: what the spec grammar and the native glue know of each.

Each family module (identity, intq, fp8, error_bounded, hadamard) registers its
:class:`Family` when it is imported; :mod:`.spec` parses and prints specs generically over this
table and :mod:`.native` builds kernel attributes from it. Adding a family is one module
that defines the class and registers it (plus its kernels, if it has native ones).

Example:
  >>> from jcoccl._src.compressors import registry
  >>> registry.family_of_name("int4").kind
  'int'
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

Converter = Callable[[str], Any]


@dataclasses.dataclass(frozen=True)
class Family:
  """One compressor family as seen by the spec grammar and the native glue.

  Attributes:
    kind: the ``kind`` class constant of the family's compressors.
    names: spec name (lower case) -> builder. A builder takes the parsed options as keywords
      (and, for a wrapping family, the inner compressor first) and returns a compressor.
    to_string: the canonical spec of one of the family's compressors.
    flags: bare option -> (keyword, value), e.g. ``"asym": ("symmetric", False)``.
    keyed: ``key=value`` option -> (keyword, converter of the value text; raises ValueError).
    required: keywords that must be given (``eb`` needs ``abs``).
    options: the accepted options as a person reads them, e.g. "block=INT, sym, asym".
    wraps: the spec takes an inner spec in parentheses, ``name(<spec>)``.
    native: the kernel fields of a compressor (``bits``, ``block``, ``symmetric``, ``fp8``
      format name, ``cast_dtype`` name, ``abs_error``; wrapping families: ``hadamard``), or
      None where this configuration has no native kernel. None: the family has none at all.
  """

  kind: str
  names: Mapping[str, Callable[..., Any]]
  to_string: Callable[[Any], str]
  flags: Mapping[str, tuple[str, Any]] = dataclasses.field(default_factory=dict)
  keyed: Mapping[str, tuple[str, Converter]] = dataclasses.field(default_factory=dict)
  required: tuple[str, ...] = ()
  options: str = "no options"
  wraps: bool = False
  native: Callable[[Any], dict[str, Any] | None] | None = None


def int_value(text: str) -> int:
  """An option's INT: decimal digits only (``int()`` would also take "+8", "1_024" or "٣")."""
  if not re.fullmatch(r"[0-9]+", text):
    raise ValueError(f"not a decimal integer: {text!r}")
  return int(text)


_FLOAT = re.compile(r"[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)(e[-+]?[0-9]+)?")


def float_value(text: str) -> float:
  """An option's FLOAT: a decimal number with an optional exponent."""
  if not _FLOAT.fullmatch(text):
    raise ValueError(f"not a decimal number: {text!r}")
  return float(text)


_FAMILIES: dict[str, Family] = {}  # kind -> family
_NAMES: dict[str, Family] = {}  # spec name -> family


def register(family: Family) -> Family:
  """Adds ``family`` to the table (again with the same kind: replaces it).

  Args:
    family: the family; its spec names must not belong to another kind.

  Returns:
    ``family``.

  Example:
    >>> register(Family("none", {"none": NoneCompressor}, lambda c: "none"))  # doctest: +SKIP
  """
  for name in family.names:
    other = _NAMES.get(name)
    if other is not None and other.kind != family.kind:
      raise ValueError(
        f"spec name {name!r} of kind {family.kind!r} already belongs to kind {other.kind!r}"
      )
  old = _FAMILIES.pop(family.kind, None)
  if old is not None:
    for name in old.names:
      _NAMES.pop(name, None)
  _FAMILIES[family.kind] = family
  _NAMES.update({name: family for name in family.names})
  return family


def family_of(c: Any) -> Family:
  """The family of compressor ``c`` (TypeError if ``c`` is not a registered compressor)."""
  fam = _FAMILIES.get(str(getattr(c, "kind", ""))) if hasattr(c, "encode_rows") else None
  if fam is None:
    raise TypeError(f"not a jcoccl Compressor: {type(c).__name__}")
  return fam


def family_of_name(name: str) -> Family | None:
  """The family whose spec names include ``name`` (lower case), or None."""
  return _NAMES.get(name)


def spec_names() -> tuple[str, ...]:
  """Every spec name, in registration order (wrapping families written ``name(...)``)."""
  return tuple(f"{n}(...)" if f.wraps else n for n, f in _NAMES.items())

"""The table of compressor families, and :func:`register`, the one way into it.

Every family, built-in or a user's, enters through :func:`register`: the spec grammar
(:mod:`.spec`), printing, primitive params, TOML policies, the command line, wire reports and
the native glue (:mod:`.native`) then treat it alike. A family is a Compressor subclass plus
its spec names and options.

Example:
  >>> from jcoccl._src.compressors import registry
  >>> registry.family_of_name("int4").kind
  'int'
"""

from __future__ import annotations

import dataclasses
import re
import typing
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

Converter = Callable[[str], Any]
_NAME = re.compile(r"[a-z][a-z0-9_]*")
HOOKS = ("granule", "row_nbytes", "encode_f32", "decode_f32")


@dataclasses.dataclass(frozen=True)
class Family:
  """One compressor family as the spec grammar and the native glue see it.

  Attributes:
    kind: the ``kind`` class constant of the family's compressors.
    cls: the family's Compressor class (``family_of`` maps instances by exact class).
    names: spec name (lower case) -> builder. A builder takes the parsed options as keywords
      (and, for a wrapping family, the inner compressor first) and returns a compressor.
    to_string: the canonical spec of one of the family's compressors.
    flags: bare option -> (keyword, value), e.g. ``"asym": ("symmetric", False)``.
    keyed: ``key=value`` option -> (keyword, converter of the value text; raises ValueError).
    required: keywords that must be given (``eb`` needs ``abs``).
    options: the accepted options as a person reads them, e.g. "block=INT, sym, asym".
    wraps: the spec takes an inner spec in parentheses, ``name(<spec>)``.
    native: the kernel fields of a compressor, or None where this configuration has no
      native kernel; None for the whole family: it has none at all.
  """

  kind: str
  cls: type
  names: Mapping[str, Callable[..., Any]]
  to_string: Callable[[Any], str]
  flags: Mapping[str, tuple[str, Any]] = dataclasses.field(default_factory=dict)
  keyed: Mapping[str, tuple[str, Converter]] = dataclasses.field(default_factory=dict)
  required: tuple[str, ...] = ()
  options: str = "no options"
  wraps: bool = False
  native: Callable[[Any], dict[str, Any] | None] | None = None


# ---- option value converters ---------------------------------------------------------------


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


def bool_value(text: str) -> bool:
  """An option's BOOL: ``true``/``false`` (or ``1``/``0``)."""
  if text in ("true", "1"):
    return True
  if text in ("false", "0"):
    return False
  raise ValueError(f"not true or false: {text!r}")


def text_value(text: str) -> str:
  """An option's TEXT: lower-case letters, digits and ``_ . + -`` (specs are lower-cased)."""
  if not re.fullmatch(r"[a-z0-9_.+-]+", text):
    raise ValueError(f"not a word of [a-z0-9_.+-]: {text!r}")
  return text


_CONVERTERS: dict[type, tuple[Converter, str]] = {
  bool: (bool_value, "BOOL"),
  int: (int_value, "INT"),
  float: (float_value, "FLOAT"),
  str: (text_value, "TEXT"),
}
_TYPE_NAMES = {conv: label for conv, label in _CONVERTERS.values()}


def _format(value: Any) -> str:
  """An option value as the spec grammar writes it (the inverse of the converters)."""
  if isinstance(value, bool):
    return "true" if value else "false"
  if isinstance(value, float):
    return repr(value)
  return str(value)


# ---- the table -------------------------------------------------------------------------------

_BASE: list[Any] = []  # the Compressor class (set by _base, which imports this module)
_FAMILIES: dict[str, Family] = {}  # kind -> family
_NAMES: dict[str, Family] = {}  # spec name -> family
_CLASSES: dict[type, Family] = {}  # class -> family
_GENERATION = [0]  # bumped on every change of the table
# Part of jit's cache key: a new value when a spec string changes meaning, so a program
# traced with the old codec (whose key holds only the string) traces again.
_JIT_KEY = jax.make_user_context(0)


def generation() -> int:
  """A number that changes whenever the table does (caches keyed by spec strings compare it).

  Example:
    >>> g = generation(); unregister("trunc16"); generation() > g  # doctest: +SKIP
    True
  """
  return _GENERATION[0]


def _changed(rebound: bool) -> None:
  """Records a change of the table. ``rebound``: a spec string that named one codec now
  names another or none, so programs traced with the old meaning must not be reused
  (their jit cache key holds only the string): every jit cache misses once."""
  _GENERATION[0] += 1
  if rebound:
    _JIT_KEY.set_global(_GENERATION[0])


def _add(family: Family) -> Family:
  """Puts ``family`` in the table, taking over its names (warning when they built another
  class) and its kind."""
  rebound = False
  for name in family.names:
    old = _NAMES.get(name)
    if old is not None and old.cls is not family.cls:
      warnings.warn(
        f"jcoccl.compressors.register: spec name {name!r} built {old.cls.__qualname__}; "
        f"it now builds {family.cls.__qualname__}",
        stacklevel=4,
      )
      _drop_name(old, name)
      rebound = True
  old = _FAMILIES.get(family.kind)
  if old is not None:
    rebound = rebound or old.cls is not family.cls
    for name in list(old.names):
      _drop_name(old, name)
  _FAMILIES[family.kind] = family
  _CLASSES[family.cls] = family
  _NAMES.update({name: family for name in family.names})
  _changed(rebound)
  return family


def _drop_name(fam: Family, name: str) -> None:
  _NAMES.pop(name, None)
  if not any(f is fam for f in _NAMES.values()):
    _FAMILIES.pop(fam.kind, None)
    if _CLASSES.get(fam.cls) is fam:
      del _CLASSES[fam.cls]


def _field_types(cls: type) -> dict[str, type | None]:
  """Init fields' types; None for a field with neither a resolvable annotation nor a default
  (``_keyed`` then rejects it as an option)."""
  try:
    hints = typing.get_type_hints(cls)
  except Exception:  # unresolvable annotations: fall back to the defaults' types
    hints = {}
  out: dict[str, type | None] = {}
  for f in dataclasses.fields(cls):
    if not f.init:
      continue
    t = hints.get(f.name)
    if t not in _CONVERTERS and f.default is not dataclasses.MISSING:
      t = type(f.default)
    out[f.name] = t
  return out


def _default_keys(cls: type) -> dict[str, str]:
  return {f.name: f.name for f in dataclasses.fields(cls) if f.init}


def _keyed(cls: type, keys: Mapping[str, Any]) -> dict[str, tuple[str, Converter]]:
  """``key -> field`` (converter from the field's type) or ``key -> (field, converter)``."""
  types = _field_types(cls)
  out = {}
  for key, spec in keys.items():
    if isinstance(spec, tuple):
      out[key] = spec
      continue
    t = types.get(spec)
    if t not in _CONVERTERS:
      raise TypeError(
        f"register: option {key!r} sets field {spec!r} of {cls.__qualname__}, whose type "
        f"{getattr(t, '__name__', t)!r} is not one of bool, int, float, str; pass "
        f"keys={{{key!r}: ({spec!r}, converter)}} with a converter of the option's text"
      )
    out[key] = (spec, _CONVERTERS[t][0])
  return out


def _required(cls: type) -> tuple[str, ...]:
  return tuple(
    f.name
    for f in dataclasses.fields(cls)
    if f.init and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
  )


def _defaults(cls: type) -> dict[str, Any]:
  out = {}
  for f in dataclasses.fields(cls):
    if f.init and f.default is not dataclasses.MISSING:
      out[f.name] = f.default
  return out


def _describe(
  keyed: Mapping[str, tuple[str, Converter]], flags: Mapping[str, Any], required: Sequence[str]
) -> str:
  items = [
    f"{k}={_TYPE_NAMES.get(conv, 'VALUE')}" + (" (required)" if field in required else "")
    for k, (field, conv) in keyed.items()
  ]
  items += list(flags)
  return ", ".join(items) or "no options"


def _printer(
  name: str, cls: type, keyed: Mapping[str, tuple[str, Converter]], flags: Mapping[str, Any]
) -> Callable[[Any], str]:
  """The default ``to_string``: the name, then every option whose field is not its default."""
  defaults = _defaults(cls)
  by_field = {field: key for key, (field, _) in keyed.items()}
  flag_of = {(field, value): flag for flag, (field, value) in flags.items()}

  def to_string(c: Any) -> str:
    opts = []
    for f in dataclasses.fields(cls):
      if not f.init:
        continue
      value = getattr(c, f.name)
      if f.name in defaults and value == defaults[f.name]:
        continue
      if (f.name, value) in flag_of:
        opts.append(flag_of[(f.name, value)])
      elif f.name in by_field:
        opts.append(f"{by_field[f.name]}={_format(value)}")
    return name + (":" + ",".join(opts) if opts else "")

  return to_string


def set_base(cls: type) -> None:
  """Records the Compressor base class (called once by :mod:`._base`; importing it here
  would be an import cycle)."""
  _BASE[:] = [cls]


def _check_class(cls: Any) -> Any:
  Compressor = _BASE[0]
  if not (isinstance(cls, type) and issubclass(cls, Compressor)):
    raise TypeError(
      f"register: {cls!r} is not a subclass of jcoccl.compressors.Compressor; a codec "
      "subclasses it and implements its hooks (granule, row_nbytes, encode_f32, "
      "decode_f32, bound_f32)"
    )
  hooks: Any = cls  # a Compressor subclass (the isinstance check narrows it to `type`)
  missing = [h for h in HOOKS if getattr(cls, h) is getattr(Compressor, h)]
  if not hooks.lossless and hooks.bound_f32 is Compressor.bound_f32:
    missing.append("bound_f32 (or lossless = True)")
  if missing:
    raise TypeError(
      f"register: {cls.__qualname__} does not implement {', '.join(missing)} "
      "(see jcoccl.compressors.Compressor)"
    )
  if "__dataclass_fields__" not in cls.__dict__:
    # A codec must be hashable and immutable (a jit static argument, a primitive param).
    cls = dataclasses.dataclass(frozen=True)(cls)
  return cls


def _names(names: Any, cls: type) -> dict[str, Callable[..., Any]]:
  if names is None:
    names = cls.__name__.lower()
  if isinstance(names, str):
    names = [names]
  table = dict(names) if isinstance(names, Mapping) else {n: cls for n in names}
  if not table:
    raise ValueError("register: give at least one spec name")
  for n in table:
    if not isinstance(n, str) or not _NAME.fullmatch(n):
      raise ValueError(
        f"register: spec name {n!r} must be lower case letters, digits and '_', "
        "starting with a letter (e.g. 'topk')"
      )
  return table


def register(
  names: Any = None,
  cls: Any = None,
  *,
  keys: Mapping[str, Any] | None = None,
  flags: Mapping[str, tuple[str, Any]] | None = None,
  required: Sequence[str] | None = None,
  printer: Callable[[Any], str] | None = None,
  native: Callable[[Any], dict[str, Any] | None] | None = None,
  wraps: bool = False,
) -> Any:
  """Registers a compressor family under one or more spec names.

  A class decorator (``@register("topk")``, or bare ``@register``: the class name in lower
  case), or a plain call (``register("topk", TopK)``). Afterwards ``parse("topk:k=8")``,
  ``str(c)``, the ops' ``compressor=`` argument, policies, TOML files, ``--compress
  AXIS.OP=SPEC``, wire reports and error messages treat the family as a built-in one.

  Args:
    names: a spec name; a list of names (the first is the canonical one, the rest aliases);
      or a mapping name -> builder (``{"int8": lambda **kw: IntCompressor(bits=8, **kw)}``).
    cls: the Compressor subclass (omitted when used as a decorator). A class that is not a
      dataclass yet is made a frozen one.
    keys: ``key=value`` options: key -> field name (the value's type comes from the field:
      bool, int, float or str) or key -> (field, converter of the option text). Default,
      when neither ``keys`` nor ``flags`` is given: every dataclass field, under its name.
    flags: bare options: flag -> (field, value), e.g. ``{"asym": ("symmetric", False)}``.
    required: fields that a spec must give; default: the fields without a default.
    printer: ``c -> spec string`` with ``parse(printer(c)) == c``; default: the canonical
      name, then the options whose fields differ from their defaults.
    native: ``c -> kernel fields`` or None (no native kernel for that configuration);
      set by :func:`jcoccl.compressors.load_plugin` for plugin codecs.
    wraps: the spec takes an inner spec, ``name(<inner spec>)`` (the builder's first
      argument).

  Returns:
    The class (so it works as a decorator).

  Raises:
    TypeError: ``cls`` is not a Compressor subclass or lacks a hook. ValueError: a bad name.
    A name that built another class is taken over with a warning.

  Example:
    >>> @register("trunc16")
    ... class Trunc16(Compressor):
    ...   granule = 1
    ...   def row_nbytes(self, n, dtype): return 2 * n
    ...   ...
  """
  if isinstance(names, type) and cls is None:
    return register(None, names, keys=keys, flags=flags, required=required, printer=printer,
                    native=native, wraps=wraps)  # fmt: skip
  if cls is None:
    return lambda c: register(
      names, c, keys=keys, flags=flags, required=required, printer=printer, native=native,
      wraps=wraps,
    )  # fmt: skip
  cls = _check_class(cls)
  table = _names(names, cls)
  canonical = next(iter(table))
  kind = cls.__dict__.get("kind")
  if not isinstance(kind, str):
    kind = canonical
    cls.kind = kind
  if keys is None and flags is None:
    keys = {k: v for k, v in _default_keys(cls).items() if not (wraps and k == "inner")}
  keyed = _keyed(cls, keys or {})
  flags = dict(flags or {})
  if required is None:
    required = tuple(r for r in _required(cls) if not (wraps and r == "inner"))
  _add(
    Family(
      kind=kind,
      cls=cls,
      names=table,
      to_string=printer or _printer(canonical, cls, keyed, flags),
      flags=flags,
      keyed=keyed,
      required=tuple(required),
      options=_describe(keyed, flags, required),
      wraps=wraps,
      native=native,
    )
  )
  return cls


def set_native(name: str, native: Callable[[Any], dict[str, Any] | None] | None) -> Family:
  """Gives the family of spec ``name`` a new ``native`` hook (load_plugin's way in).

  Returns:
    The updated family record.

  Example:
    >>> set_native("sign1", lambda c: None)  # doctest: +SKIP
  """
  fam = _NAMES.get(name)
  if fam is None:
    raise KeyError(f"no compressor is registered as {name!r}; registered: {registered()}")
  new = dataclasses.replace(fam, native=native)
  for n, f in list(_NAMES.items()):
    if f is fam:
      _NAMES[n] = new
  _FAMILIES[fam.kind] = new
  _CLASSES[fam.cls] = new
  # Programs traced with another plugin's kernels must not keep running them.
  _changed(rebound=fam.native is not None)
  return new


def unregister(name: str) -> None:
  """Removes spec ``name`` (its family goes when its last name does).

  Example:
    >>> unregister("trunc16")  # doctest: +SKIP
  """
  fam = _NAMES.get(name)
  if fam is None:
    raise KeyError(f"no compressor is registered as {name!r}; registered: {registered()}")
  _drop_name(fam, name)
  _changed(rebound=True)


def family_of(c: Any) -> Family:
  """The family of compressor ``c`` (by its exact class); TypeError if it has none."""
  fam = _CLASSES.get(type(c))
  if fam is None:
    if isinstance(c, _BASE[0]):
      raise TypeError(
        f"compressor class {type(c).__qualname__} is not registered: decorate it with "
        f"@jcoccl.compressors.register({type(c).__name__.lower()!r}) (or call "
        "register(name, cls)) so that specs, policies and the collectives can name it"
      )
    raise TypeError(f"not a jcoccl Compressor: {type(c).__name__}")
  return fam


def family_of_name(name: str) -> Family | None:
  """The family whose spec names include ``name`` (lower case), or None."""
  return _NAMES.get(name)


def registered() -> tuple[str, ...]:
  """Every spec name, in registration order.

  Example:
    >>> "int8" in registered()
    True
  """
  return tuple(_NAMES)


def spec_names() -> tuple[str, ...]:
  """Every spec name, in registration order (wrapping families written ``name(...)``)."""
  return tuple(f"{n}(...)" if f.wraps else n for n, f in _NAMES.items())

"""Compressor spec strings: ``parse(spec)`` and ``to_string(c)`` (``parse(str(c)) == c``).

Grammar (whitespace ignored, names case-insensitive), generic over the families registered in
:mod:`.registry`::

  spec     := NAME ["(" spec ")"] [":" option ("," option)*]
  option   := FLAG | KEY "=" VALUE

A wrapping family (hadamard) takes the parenthesised inner spec; the others must not. Each
family names its NAMEs, flags and keys:

  none | bf16 (bfloat16) | fp16 (float16, f16)   no options
  int2 ... int8          block=INT | sym | asym | nearest | stochastic
  fp8                    e4m3 | e5m2 | block=INT
  eb (error_bounded)     abs=FLOAT (required) | block=INT
  hadamard(<spec>)       size=INT

Each option is given at most once ("int8:sym,asym" is an error, not "the last one wins"), a
colon is followed by at least one option ("int8:" is an error), INT is decimal digits.

``str(c)`` writes only options that differ from the defaults, e.g. "int8",
"int4:block=128,asym", "int8:stochastic", "fp8:e5m2,block=64", "hadamard(int4:block=128)",
"hadamard(int4):size=64", "eb:abs=0.001", "eb:abs=0.01,block=64". Codecs registered with
``jcoccl.compressors.register`` declare their own names and options.
"""

from __future__ import annotations

import difflib
import re
from typing import Any

from jcoccl._src.compressors import registry

_NAME = re.compile(r"[a-z0-9_]+")


def to_string(c: Any) -> str:
  """The canonical spec of compressor ``c``.

  Example:
    >>> to_string(jc.int4(block_size=128))
    'int4:block=128'
  """
  return registry.family_of(c).to_string(c)


def _bad(spec: str, token: str, accepted: str) -> ValueError:
  return ValueError(
    f"bad compressor spec {spec!r}: unknown or malformed token {token!r}; accepted: {accepted}"
  )


def _options(spec: str, rest: str, fam: registry.Family) -> dict[str, Any]:
  """Keyword arguments from the comma-separated options after ``name:``; each keyword set at
  most once ("sym,asym" and "block=64,block=128" are errors, not "the last one wins")."""
  kw: dict[str, Any] = {}
  given: dict[str, str] = {}
  for o in rest.split(","):
    key, eq, val = o.partition("=")
    if eq and key in fam.keyed:
      arg, conv = fam.keyed[key]
      try:
        value = conv(val)
      except ValueError:
        raise _bad(spec, o, fam.options) from None
    elif not eq and o in fam.flags:
      arg, value = fam.flags[o]
    else:
      raise _bad(spec, o, fam.options)
    if arg in kw:
      raise ValueError(
        f"bad compressor spec {spec!r}: {o!r} after {given[arg]!r} (both set "
        f"{arg}); give each option at most once"
      )
    kw[arg], given[arg] = value, o
  return kw


def _inner(spec: str, s: str) -> tuple[str, str]:
  """Splits "(<inner>)<tail>" at the parenthesis that closes the first one."""
  depth = 0
  for i, ch in enumerate(s):
    depth += (ch == "(") - (ch == ")")
    if depth == 0:
      return s[1:i], s[i + 1 :]
  raise _bad(spec, s, "name(<spec>) with balanced parentheses")


def parse(spec: str) -> Any:
  """Builds a compressor from a spec string (grammar in this module's docstring).

  Args:
    spec: e.g. "int8", "int4:block=128,asym", "hadamard(int4):size=64".

  Returns:
    The compressor (``parse(str(c)) == c``).

  Raises:
    TypeError: ``spec`` is not a str. ValueError: an unknown name or option, naming what
      is accepted.

  Example:
    >>> parse("hadamard(int4:block=128)")
    HadamardCompressor(inner=IntCompressor(bits=4, block_size=128, symmetric=True, rounding='nearest'), size=128)
  """
  if not isinstance(spec, str):
    raise TypeError(f"spec must be a str, got {type(spec).__name__}")
  s = "".join(spec.split()).lower()
  m = _NAME.match(s)
  fam = registry.family_of_name(m.group()) if m else None
  if m is None or fam is None:
    word = s.split(":")[0].split("(")[0]
    bare = [n.removesuffix("(...)") for n in registry.spec_names()]
    close = difflib.get_close_matches(word, bare, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(
      f"bad compressor spec {spec!r}: unknown compressor {word!r}{hint}; "
      f"registered: {', '.join(registry.spec_names())}. "
      "A codec of your own is named here once its module has run "
      "@jcoccl.compressors.register('name') (a policy file can import it: [codecs] "
      "modules = [...]), and a native plugin once jcoccl.compressors.load_plugin(path) ran"
    )
  name, rest = m.group(), s[m.end() :]
  inner = None
  if fam.wraps:
    if not rest.startswith("("):
      raise _bad(spec, s, f"{name}(<spec>) with balanced parentheses")
    inner_text, rest = _inner(spec, rest)
    inner = parse(inner_text)
  if rest and not rest.startswith(":"):
    raise _bad(spec, rest, f"':' and options after {name} ({fam.options})")
  if rest == ":":
    raise _bad(spec, s, "options after ':' (e.g. 'int8:block=128'), or no ':'")
  kw = _options(spec, rest[1:], fam) if rest else {}
  missing = [k for k in fam.required if k not in kw]
  if missing:
    raise _bad(spec, rest[1:] or name, f"{name} needs {fam.options}")
  build = fam.names[name]
  return build(inner, **kw) if fam.wraps else build(**kw)


def split(text: str) -> list[str]:
  """Splits a comma-separated list of specs (commas also separate a spec's options).

  A comma starts a new spec only outside parentheses and where the next item begins with a
  registered name.

  Example:
    >>> split("int4:block=128,asym,fp8,hadamard(int4:block=64,asym)")
    ['int4:block=128,asym', 'fp8', 'hadamard(int4:block=64,asym)']
  """
  parts, depth, cur = [], 0, ""
  for ch in text:
    depth += (ch == "(") - (ch == ")")
    if ch == "," and depth == 0:
      parts.append(cur)
      cur = ""
    else:
      cur += ch
  parts.append(cur)
  specs: list[str] = []
  for p in (q.strip() for q in parts):
    if not p:
      continue
    m = _NAME.match(p.lower())
    if specs and (m is None or registry.family_of_name(m.group()) is None):
      specs[-1] += "," + p
    else:
      specs.append(p)
  return specs

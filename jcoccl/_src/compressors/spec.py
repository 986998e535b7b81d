"""Compressor spec strings: ``parse(spec)`` and ``to_string(c)`` (``parse(str(c)) == c``).

Grammar (whitespace ignored, names case-insensitive)::

  spec     := codec | "hadamard(" spec ")" [":size=" INT]
  codec    := NAME [":" option ("," option)*]
  NAME     := none | bf16 (bfloat16) | fp16 (float16, f16) | int8 | int4 | int2 | fp8 | eb

  options of int8/int4/int2:  block=INT | sym | asym | nearest | stochastic
  options of fp8:             e4m3 | e5m2 | block=INT
  options of eb:              abs=FLOAT (required) | block=INT

Each option is given at most once ("int8:sym,asym" is an error, not "the last one wins"), a
colon is followed by at least one option ("int8:" is an error), INT is decimal digits.

``str(c)`` writes only options that differ from the factory defaults, e.g. "int8",
"int4:block=128,asym", "int8:stochastic", "fp8:e5m2,block=64", "hadamard(int4:block=128)",
"hadamard(int4):size=64", "eb:abs=0.001", "eb:abs=0.01,block=64".
"""

from __future__ import annotations

import re
from typing import Any

from jcoccl._src.compressors import factories as F
from jcoccl._src.compressors._base import Compressor
from jcoccl._src.compressors.error_bounded import ErrorBoundedCompressor
from jcoccl._src.compressors.fp8 import Fp8Compressor
from jcoccl._src.compressors.hadamard import HadamardCompressor, default_size
from jcoccl._src.compressors.identity import CastCompressor, NoneCompressor
from jcoccl._src.compressors.intq import IntCompressor

_NAMES = ("none", "bf16", "fp16", "int8", "int4", "int2", "fp8", "eb", "hadamard(...)")
_CAST = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
         "f16": "float16"}
_OPTS = {
    "int": "block=INT, sym, asym, nearest, stochastic",
    "fp8": "e4m3, e5m2, block=INT",
    "eb": "abs=FLOAT, block=INT",
}
_FLOAT = re.compile(r"[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)(e[-+]?[0-9]+)?")
_INT_FLAGS = {"sym": ("symmetric", True), "asym": ("symmetric", False),
              "nearest": ("rounding", "nearest"), "stochastic": ("rounding", "stochastic")}
_FP8_FLAGS = {"e4m3": ("fmt", "e4m3"), "e5m2": ("fmt", "e5m2")}


def to_string(c: Compressor) -> str:
  """The canonical spec of ``c``."""
  if isinstance(c, NoneCompressor):
    return "none"
  if isinstance(c, CastCompressor):
    return "bf16" if c.dtype.name == "bfloat16" else "fp16"
  if isinstance(c, IntCompressor):
    opts = [] if c.block_size == 256 else [f"block={c.block_size}"]
    opts += [] if c.symmetric else ["asym"]
    opts += [] if c.rounding == "nearest" else [c.rounding]
    return f"int{c.bits}" + (":" + ",".join(opts) if opts else "")
  if isinstance(c, Fp8Compressor):
    opts = [] if c.fmt == "e4m3" else [c.fmt]
    opts += [] if c.block_size == 128 else [f"block={c.block_size}"]
    return "fp8" + (":" + ",".join(opts) if opts else "")
  if isinstance(c, ErrorBoundedCompressor):
    return f"eb:abs={c.abs_error!r}" + ("" if c.block_size == 256 else f",block={c.block_size}")
  if isinstance(c, HadamardCompressor):
    tail = "" if c.size == default_size(c.inner) else f":size={c.size}"
    return f"hadamard({to_string(c.inner)}){tail}"
  raise TypeError(f"not a jcoccl Compressor: {type(c).__name__}")


def _bad(spec: str, token: str, accepted: str) -> ValueError:
  return ValueError(f"bad compressor spec {spec!r}: unknown or malformed token {token!r}; "
                    f"accepted: {accepted}")


def _int(spec: str, tok: str, val: str, accepted: str) -> int:
  # Only plain decimal digits: int() would also take "+8", "1_024" or "٣".
  if not re.fullmatch(r"[0-9]+", val):
    raise _bad(spec, tok, accepted)
  return int(val)


def _float(spec: str, tok: str, val: str, accepted: str) -> float:
  if not _FLOAT.fullmatch(val):
    raise _bad(spec, tok, accepted)
  return float(val)


def _options(spec: str, rest: str, flags: dict[str, tuple[str, Any]],
             keyed: dict[str, tuple[str, Any]], accepted: str) -> dict[str, Any]:
  """Keyword arguments from the comma-separated options after ``name:``.

  Args:
    spec: the whole spec (for messages).
    rest: the text after the colon.
    flags: bare option -> (keyword, value), e.g. "asym" -> ("symmetric", False).
    keyed: option key -> (keyword, converter), e.g. "block" -> ("block_size", _int).
    accepted: the accepted options, for messages.

  Returns:
    keyword -> value; each keyword set at most once ("sym,asym" and "block=64,block=128"
    are errors, not "the last one wins").
  """
  kw: dict[str, Any] = {}
  given: dict[str, str] = {}
  for o in rest.split(","):
    key, eq, val = o.partition("=")
    if eq and key in keyed:
      arg, conv = keyed[key]
      value = conv(spec, o, val, accepted)
    elif not eq and o in flags:
      arg, value = flags[o]
    else:
      raise _bad(spec, o, accepted)
    if arg in kw:
      raise ValueError(f"bad compressor spec {spec!r}: {o!r} after {given[arg]!r} (both set "
                       f"{arg}); give each option at most once")
    kw[arg], given[arg] = value, o
  return kw


_BLOCK = {"block": ("block_size", _int)}


def parse(spec: str) -> Compressor:
  """Builds a compressor from a spec string (grammar in this module's docstring).

  Example:
    >>> parse("hadamard(int4:block=128)")
    HadamardCompressor(inner=IntCompressor(bits=4, block_size=128, symmetric=True, rounding='nearest'), size=128)
  """
  if not isinstance(spec, str):
    raise TypeError(f"spec must be a str, got {type(spec).__name__}")
  s = "".join(spec.split()).lower()
  if s.startswith("hadamard("):
    depth, end = 0, -1
    for i, ch in enumerate(s):
      depth += ch == "("
      depth -= ch == ")"
      if depth == 0 and ch == ")":
        end = i
        break
    if end < 0:
      raise _bad(spec, s, "hadamard(<spec>) with balanced parentheses")
    inner = parse(s[len("hadamard("):end])
    tail = s[end + 1:]
    if not tail:
      return F.hadamard(inner)
    if not tail.startswith(":size="):
      raise _bad(spec, tail, "':size=INT' after hadamard(...)")
    return F.hadamard(inner, size=_int(spec, tail, tail[len(":size="):], "size=INT"))
  name, colon, rest = s.partition(":")
  if colon and not rest:
    raise _bad(spec, s, "options after ':' (e.g. 'int8:block=128'), or no ':'")
  if name in ("none",) or name in _CAST:
    if rest:
      raise _bad(spec, rest, f"no options for {name}")
    return F.none() if name == "none" else F.cast(_CAST[name])
  if name in ("int8", "int4", "int2"):
    kw = _options(spec, rest, _INT_FLAGS, _BLOCK, _OPTS["int"]) if rest else {}
    return {"int8": F.int8, "int4": F.int4, "int2": F.int2}[name](**kw)
  if name == "fp8":
    return F.fp8(**(_options(spec, rest, _FP8_FLAGS, _BLOCK, _OPTS["fp8"]) if rest else {}))
  if name in ("eb", "error_bounded"):
    keyed = {**_BLOCK, "abs": ("abs_error", _float)}
    kw = _options(spec, rest, {}, keyed, _OPTS["eb"]) if rest else {}
    if "abs_error" not in kw:
      raise _bad(spec, rest or name, "eb needs abs=FLOAT, e.g. 'eb:abs=1e-3'")
    return F.error_bounded(**kw)
  raise _bad(spec, name, ", ".join(_NAMES))

"""Compressor spec strings: ``parse(spec)`` and ``to_string(c)`` (``parse(str(c)) == c``).

Grammar (whitespace ignored, names case-insensitive)::

  spec     := codec | "hadamard(" spec ")" [":size=" INT]
  codec    := NAME [":" option ("," option)*]
  NAME     := none | bf16 (bfloat16) | fp16 (float16, f16) | int8 | int4 | int2 | fp8 | eb

  options of int8/int4/int2:  block=INT | sym | asym | nearest | stochastic
  options of fp8:             e4m3 | e5m2 | block=INT
  options of eb:              abs=FLOAT (required) | block=INT

``str(c)`` writes only options that differ from the factory defaults, e.g. "int8",
"int4:block=128,asym", "int8:stochastic", "fp8:e5m2,block=64", "hadamard(int4:block=128)",
"hadamard(int4):size=64", "eb:abs=0.001", "eb:abs=0.01,block=64".
"""

from __future__ import annotations

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
  try:
    return int(val)
  except ValueError:
    raise _bad(spec, tok, accepted) from None


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
  name, _, rest = s.partition(":")
  opts = [o for o in rest.split(",")] if rest else []
  if name in ("none",) or name in _CAST:
    if opts:
      raise _bad(spec, rest, f"no options for {name}")
    return F.none() if name == "none" else F.cast(_CAST[name])
  if name in ("int8", "int4", "int2"):
    kw: dict = {}
    for o in opts:
      if o.startswith("block="):
        kw["block_size"] = _int(spec, o, o[6:], _OPTS["int"])
      elif o in ("sym", "asym"):
        kw["symmetric"] = o == "sym"
      elif o in ("nearest", "stochastic"):
        kw["rounding"] = o
      else:
        raise _bad(spec, o, _OPTS["int"])
    return {"int8": F.int8, "int4": F.int4, "int2": F.int2}[name](**kw)
  if name == "fp8":
    kw = {}
    for o in opts:
      if o in ("e4m3", "e5m2"):
        kw["fmt"] = o
      elif o.startswith("block="):
        kw["block_size"] = _int(spec, o, o[6:], _OPTS["fp8"])
      else:
        raise _bad(spec, o, _OPTS["fp8"])
    return F.fp8(**kw)
  if name in ("eb", "error_bounded"):
    kw = {}
    for o in opts:
      if o.startswith("abs="):
        try:
          kw["abs_error"] = float(o[4:])
        except ValueError:
          raise _bad(spec, o, _OPTS["eb"]) from None
      elif o.startswith("block="):
        kw["block_size"] = _int(spec, o, o[6:], _OPTS["eb"])
      else:
        raise _bad(spec, o, _OPTS["eb"])
    if "abs_error" not in kw:
      raise _bad(spec, rest or name, "eb needs abs=FLOAT, e.g. 'eb:abs=1e-3'")
    return F.error_bounded(**kw)
  raise _bad(spec, name, ", ".join(_NAMES))

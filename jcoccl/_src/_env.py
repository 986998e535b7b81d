"""Reading jcoccl's settings from environment variables, with errors that name them.

:mod:`jcoccl._src.base.config` reads the collectives' settings through these once, into the
process defaults; nothing else reads them while a program is traced or run.
"""

from __future__ import annotations

import math
import os
import re
from typing import overload


@overload
def integer(name: str, default: int, lo: int, hi: int | None = None) -> int: ...
@overload
def integer(name: str, default: None, lo: int, hi: int | None = None) -> int | None: ...


def integer(name: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
  """The integer in environment variable ``name``, checked against [lo, hi].

  Args:
    name: the variable.
    default: returned when the variable is unset or empty.
    lo: smallest accepted value.
    hi: largest accepted value (None: no bound).

  Returns:
    The value, or ``default``.

  Raises:
    ValueError: the variable is not a whole number in range (the message names it, the
      accepted range and what it holds).

  Example:
    >>> os.environ["JCOCCL_MIN_BYTES"] = "0"
    >>> integer("JCOCCL_MIN_BYTES", None, 0)
    0
  """
  text = os.environ.get(name, "")
  if not text:
    return default
  accepted = f"an integer >= {lo}" + ("" if hi is None else f" and <= {hi}")
  try:
    value = int(text)
  except ValueError:
    raise ValueError(f"{name} must be {accepted}, got {text!r}") from None
  if value < lo or (hi is not None and value > hi):
    raise ValueError(f"{name} must be {accepted}, got {value}")
  return value


DEFAULT_TIMEOUT_S = 300.0
MAX_TIMEOUT_S = 1e8  # "no limit": larger values (inf too) are clamped to about 3 years
# A decimal number, or inf / infinity; blanks around it allowed.
_SECONDS_RE = re.compile(
  r"\s*\+?(?:(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|inf|infinity)\s*", re.IGNORECASE | re.ASCII
)


def seconds(name: str, default: float) -> float:
  """The positive number of seconds in environment variable ``name``.

  Args:
    name: the variable (e.g. ``JCOCCL_TIMEOUT_S``).
    default: returned when it is unset or empty.

  Returns:
    The value in (0, 1e8]: ``inf`` and anything above 1e8 s (about 3 years) is clamped to
    1e8, which still fits every clock's deadline arithmetic.

  Raises:
    ValueError: anything else (0, negatives, nan, hexadecimal, text), naming the variable.

  Example:
    >>> os.environ["JCOCCL_TIMEOUT_S"] = "inf"
    >>> seconds("JCOCCL_TIMEOUT_S", 300.0)
    100000000.0
  """
  text = os.environ.get(name, "")
  if text == "":
    return default
  value = float(text) if _SECONDS_RE.fullmatch(text) else math.nan
  if not value > 0:
    raise ValueError(
      f"{name} must be a positive number of seconds, or inf for no "
      f"limit (clamped to {MAX_TIMEOUT_S:g} s); got {text!r}"
    )
  return min(value, MAX_TIMEOUT_S)

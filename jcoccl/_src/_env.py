"""Reading jcoccl's settings from environment variables, with errors that name them."""

from __future__ import annotations

import os
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

"""Shared benchmark harness: timing loop, nccl-tests-style table, JSON output."""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

import jax

# Size suffixes: binary (KiB = 2**10) and decimal (KB = 10**3), case-insensitive; no suffix or
# "B" means bytes. Bare K/M/G are refused: they have meant both.
UNITS = {
  "b": 1,
  "kib": 2**10,
  "mib": 2**20,
  "gib": 2**30,
  "tib": 2**40,
  "kb": 10**3,
  "mb": 10**6,
  "gb": 10**9,
  "tb": 10**12,
}
SIZE_HELP = (
  "bytes, with an optional unit: B, KiB, MiB, GiB (powers of 2) or KB, MB, GB "
  "(powers of 10); a plain integer is bytes, e.g. 4MiB, 64KiB, 1GB, 512"
)
_SIZE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([a-z]*)")


def time_fn(fn: Callable[..., Any], *args: Any, warmup: int = 2, iters: int = 5) -> float:
  """Median wall time in seconds of ``fn(*args)`` (results waited on with block_until_ready).

  Args:
    fn: a (jitted) function.
    args: its arguments.
    warmup: untimed calls first (compilation, caches).
    iters: timed calls; the median is returned.

  Returns:
    Seconds.

  Example:
    >>> time_fn(jax.jit(lambda x: x + 1), jax.numpy.ones(10)) > 0
    True
  """
  if iters < 1:
    raise ValueError(f"iters must be >= 1, got {iters}")
  for _ in range(max(warmup, 0)):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def time_interleaved(
  fns: Sequence[Callable[..., Any]], *args: Any, warmup: int = 1, iters: int = 5
) -> list[float]:
  """Median wall time in seconds of each ``fn(*args)``, timed in interleaved rounds.

  Each round times every function once, in order, so that a slow spell of a shared machine
  or link falls on all of them alike rather than on whichever ran then.

  Args:
    fns: (jitted) functions of the same arguments.
    args: their arguments.
    warmup: untimed rounds first (compilation, caches, page faults).
    iters: timed rounds; the median of each function's times is returned.

  Returns:
    Seconds, one per function; across processes, each sample runs from a barrier before
    the call to one after it (:func:`barrier`).

  Example:
    >>> f = jax.jit(lambda x: x + 1)
    >>> len(time_interleaved([f, f], jax.numpy.ones(10)))
    2
  """
  if iters < 1:
    raise ValueError(f"iters must be >= 1, got {iters}")
  for _ in range(max(warmup, 0)):
    for fn in fns:
      jax.block_until_ready(fn(*args))
  times: list[list[float]] = [[] for _ in fns]
  for _ in range(iters):
    for fn, ts in zip(fns, times):
      barrier()
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args))
      barrier()
      ts.append(time.perf_counter() - t0)
  return [statistics.median(ts) for ts in times]


def barrier() -> None:
  """Waits for every process (no-op in one process).

  Across processes, a rank's call returns once its own results are in, while its peers may
  still be sending: timing from one barrier to the next makes a sample cover the whole
  collective on every rank and start with no earlier traffic still on the link, as
  nccl-tests' do.

  Example:
    >>> barrier()  # one process: returns at once
  """
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices("jcoccl.bench")


def parse_list(text: str, conv: Callable[[str], Any] = str, what: str = "list") -> list[Any]:
  """Splits a comma-separated command line value; ValueError naming ``what`` on bad items."""
  items = [t.strip() for t in text.split(",") if t.strip()]
  if not items:
    raise ValueError(f"{what} must be a non-empty comma-separated list, got {text!r}")
  out = []
  for t in items:
    try:
      out.append(conv(t))
    except ValueError as e:
      raise ValueError(f"{what}: bad item {t!r} ({e})") from None
  return out


def parse_size(text: str) -> int:
  """A message size in bytes from ``"4MiB"``, ``"64KiB"``, ``"1GB"``, ``"512B"`` or ``"512"``.

  Args:
    text: a number and an optional unit of :data:`UNITS` (case-insensitive); no unit means
      bytes. Fractions are allowed where the result is a whole number of bytes ("1.5KiB").

  Returns:
    The size in bytes, >= 1.

  Raises:
    ValueError: zero, negative, fractional bytes, an unknown or ambiguous unit, or garbage.

  Example:
    >>> parse_size("4MiB"), parse_size("64KiB"), parse_size("1MB"), parse_size("512")
    (4194304, 65536, 1000000, 512)
  """
  m = _SIZE.fullmatch(text.strip().lower())
  if text.strip().startswith("-"):
    raise ValueError(f"{text!r}: a size must be at least 1 byte")
  if not m:
    raise ValueError(f"{text!r} is not a size ({SIZE_HELP})")
  number, unit = m.groups()
  if unit in ("k", "m", "g", "t"):
    raise ValueError(
      f"{text!r}: ambiguous unit {unit.upper()!r}; write "
      f"{number}{unit.upper()}iB (2**{10 * 'kmgt'.index(unit) + 10}) or "
      f"{number}{unit.upper()}B (10**{3 * 'kmgt'.index(unit) + 3})"
    )
  if unit not in UNITS and unit != "":
    raise ValueError(f"{text!r}: unknown unit {unit!r} ({SIZE_HELP})")
  scale = UNITS.get(unit, 1)
  whole, _, frac = number.partition(".")
  # Exact arithmetic: 1.1MB is 1100000 bytes, not what a float makes of it.
  numerator = int(whole + frac) * scale
  denominator = 10 ** len(frac)
  if numerator % denominator:
    raise ValueError(f"{text!r} is not a whole number of bytes")
  nbytes = numerator // denominator
  if nbytes < 1:
    raise ValueError(f"{text!r}: a size must be at least 1 byte")
  return nbytes


def size_list(text: str) -> list[int]:
  """``--sizes``: comma-separated sizes (:func:`parse_size`), as an argparse ``type``.

  Raises:
    argparse.ArgumentTypeError: an empty list or a bad item (argparse then names --sizes).
  """
  items = [t.strip() for t in text.split(",")]
  if not any(items):
    raise argparse.ArgumentTypeError(f"needs at least one size, got {text!r}")
  try:
    return [parse_size(t) for t in items]
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from None


def positive_int(text: str) -> int:
  """An integer >= 1, as an argparse ``type`` (``--iters``)."""
  try:
    v = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
  if v < 1:
    raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
  return v


def _fmt(v: Any, spec: str | None = None) -> str:
  if spec is not None and isinstance(v, (int, float)):
    return format(v, spec)
  if isinstance(v, float):
    return f"{v:.3f}" if abs(v) < 1e5 else f"{v:.4g}"
  return str(v)


def print_table(
  rows: Sequence[dict[str, Any]],
  columns: Sequence[str],
  *,
  title: str = "",
  headers: Mapping[str, str] | None = None,
  formats: Mapping[str, str] | None = None,
  out: TextIO | None = None,
) -> None:
  """Prints ``rows`` as an aligned, right-justified table with a '#'-prefixed header.

  Args:
    rows: one dict per row, keyed by column.
    columns: the keys to print, in order.
    title: an optional '#'-prefixed line above the header.
    headers: optional header text per column key (default: the key).
    formats: optional ``format()`` spec per column key for numbers (e.g. ".2e"); default
      3 decimals (4 significant digits from 1e5 up).
    out: the stream (default: ``sys.stdout`` at the time of the call).

  Example:
    >>> print_table([{"size": 1, "GB/s": 2.0}], ["size", "GB/s"])  # doctest: +SKIP
  """
  headers, formats, out = headers or {}, formats or {}, out or sys.stdout
  names = [headers.get(c, c) for c in columns]
  cells = [[_fmt(r.get(c, ""), formats.get(c)) for c in columns] for r in rows]
  widths = [max([len(n)] + [len(row[i]) for row in cells]) for i, n in enumerate(names)]
  if title:
    print(f"# {title}", file=out)
  print("#  " + "  ".join(n.rjust(w) for n, w in zip(names, widths)), file=out)
  for row in cells:
    print("   " + "  ".join(v.rjust(w) for v, w in zip(row, widths)), file=out)


def print_json(rows: Sequence[dict[str, Any]], out: TextIO | None = None) -> None:
  """Prints ``rows`` as one JSON list (to ``sys.stdout`` at the time of the call by default)."""
  out = out or sys.stdout
  json.dump(list(rows), out, indent=1)
  print(file=out)


def device_line() -> str:
  """A one-line description of the default device."""
  d = jax.devices()[0]
  return f"jax {jax.__version__}, backend {jax.default_backend()}, device {d.device_kind} x{jax.device_count()}"


def emit(
  rows: Sequence[dict[str, Any]],
  columns: Sequence[str],
  *,
  as_json: bool,
  title: str,
  headers: Mapping[str, str] | None = None,
  formats: Mapping[str, str] | None = None,
) -> None:
  """Table (with a device header) or JSON, as the ``--json`` flag asks.

  ``headers`` and ``formats`` are passed to :func:`print_table`; JSON keeps the row keys.
  """
  if as_json:
    print_json(rows)
  else:
    print(f"# {device_line()}")
    print_table(rows, columns, title=title, headers=headers, formats=formats)

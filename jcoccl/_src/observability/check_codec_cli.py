"""``python -m jcoccl check-codec``: the conformance check of codecs from the command line.

Each argument names one codec: a spec string (``int8``, ``"hadamard(int4)"``,
``int4:block=128``) or ``module:factory``, where ``module`` is imported (the current
directory is searched first) and ``factory`` is a Compressor instance or a function that
takes no arguments and returns one. ``--codec MODULE|FILE.py|PLUGIN`` (or its older name
``--import``) brings in a codec family first, so that its spec strings parse, by the rule
every jcoccl tool shares (jcoccl.compressors.import_codecs). Exit status: 0 when every codec passes, 1 when
a property fails, 2 for bad arguments.

Example:
  $ python -m jcoccl check-codec int8 mycodecs:make_topk --dtypes float32
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from typing import Any

from jcoccl._src.compressors import sources

_FACTORY = re.compile(r"([A-Za-z_][\w.]*):([A-Za-z_]\w*)")


class UsageError(ValueError):
  """A bad command-line argument (exit status 2)."""


def add_parser(sub: Any) -> None:
  """Adds the ``check-codec`` subcommand to ``sub`` (argparse subparsers)."""
  c = sub.add_parser(
    "check-codec",
    help="run the conformance check on codecs (spec strings or module:factory)",
    description=__doc__.split("\n\n")[1],
  )
  c.add_argument("codecs", nargs="*", metavar="SPEC_OR_FACTORY", help="int8, or module:factory")
  c.add_argument("--all-builtins", action="store_true", help="check one codec of every family")
  c.add_argument(
    "--dtypes",
    nargs="+",
    default=["float32", "bfloat16", "float16"],
    choices=["float32", "bfloat16", "float16"],
    help="input dtypes (default: all three)",
  )
  c.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
  c.add_argument(
    "--sizes",
    nargs="+",
    type=int,
    metavar="N",
    help="row lengths to run at, multiples of each codec's granule (default: two granules)",
  )
  sources.add_codec_flag(c)
  c.add_argument(
    "--import",
    dest="codec_sources",
    action="append",
    metavar="MODULE",
    help="the same as --codec",
  )
  c.add_argument("--out", metavar="FILE", help="also write the tables to FILE")


def resolve(arg: str) -> Any:
  """The Compressor that one command-line argument names.

  Args:
    arg: a spec string, or ``module:factory``.

  Returns:
    A ``jcoccl.compressors.Compressor``.

  Raises:
    UsageError: the argument names no codec; the message says why and what to write.

  Example:
    >>> str(resolve("int4:block=64"))
    'int4:block=64'
  """
  from jcoccl import compressors as jc
  from jcoccl._src.compressors import registry

  head = re.split(r"[:(]", arg.strip(), maxsplit=1)[0].lower()
  m = _FACTORY.fullmatch(arg.strip())
  if registry.family_of_name(head) is None and m is not None:
    return _from_factory(m.group(1), m.group(2))
  try:
    return jc.parse(arg)
  except (ValueError, TypeError) as e:
    raise UsageError(
      f"{arg!r} is neither a compressor spec nor module:factory ({e}); write a spec "
      "(int8, 'hadamard(int4)') or module:factory with module importable from here"
    ) from e


def _from_factory(module: str, attr: str) -> Any:
  from jcoccl import compressors as jc

  try:
    mod = importlib.import_module(module)
  except ImportError as e:
    raise UsageError(
      f"cannot import module {module!r} ({e}); run from its directory or add it to PYTHONPATH"
    ) from e
  obj = getattr(mod, attr, None)
  if obj is None:
    raise UsageError(f"module {module!r} has no attribute {attr!r}")
  if callable(obj) and not isinstance(obj, jc.Compressor):
    try:
      obj = obj()
    except Exception as e:
      raise UsageError(
        f"{module}:{attr}() raised {type(e).__name__}: {e}; a factory takes no arguments"
      ) from e
  if not isinstance(obj, jc.Compressor):
    raise UsageError(
      f"{module}:{attr} gave a {type(obj).__name__}, not a jcoccl.compressors.Compressor; "
      "point at a Compressor or a function of no arguments that returns one"
    )
  return obj


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
  """Runs the check on every codec named by ``args``; returns the exit status."""
  from jcoccl._src.compressors import conformance

  sys.path.insert(0, os.getcwd())
  try:
    try:
      sources.import_flagged(args)
    except ValueError as e:
      raise UsageError(str(e)) from e
    names = list(args.codecs) + (list(conformance.BUILTINS) if args.all_builtins else [])
    if not names:
      raise UsageError("name at least one codec (e.g. int8, module:factory) or --all-builtins")
    codecs = [resolve(a) for a in names]
  except UsageError as e:
    print(f"jcoccl check-codec: error: {e}", file=sys.stderr)
    return 2
  results = []
  for c in codecs:
    try:
      r = conformance.check(c, dtypes=args.dtypes, seed=args.seed, sizes=args.sizes)
    except ValueError as e:  # a size that is not a multiple of the granule
      print(f"jcoccl check-codec: error: --sizes: {e}", file=sys.stderr)
      return 2
    results.append(r)
    print(flush=True)
  if args.out:
    with open(args.out, "w") as f:
      f.write("\n\n".join(r.table() for r in results) + "\n")
  bad = [r.codec for r in results if not r]
  print(
    f"{len(results) - len(bad)}/{len(results)} codecs pass"
    + (f"; failing: {', '.join(bad)}" if bad else "")
  )
  return 1 if bad else 0

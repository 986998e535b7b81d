"""``python -m jcoccl.bench <subcommand>``: dispatches to the registered benchmark modules."""

from __future__ import annotations

import argparse
import importlib
import sys

# Subcommand -> module; each module has add_parser(subparsers) and run(args) -> int.
SUBCOMMANDS: dict[str, str] = {
  "codecs": "jcoccl.bench.codecs",
  "collectives": "jcoccl.bench.collectives",
  "calibrate": "jcoccl.bench.calibrate",
  "predict": "jcoccl.bench.predict",
}


def _modules():
  mods = {}
  for name, path in SUBCOMMANDS.items():
    try:
      mods[name] = importlib.import_module(path)
    except ModuleNotFoundError as e:
      if e.name != path:  # a real import error inside an existing module
        raise
  return mods


def main(argv: list[str] | None = None) -> int:
  """Parses the command line and runs one benchmark subcommand."""
  mods = _modules()
  p = argparse.ArgumentParser(prog="python -m jcoccl.bench", description="jcoccl benchmarks")
  sub = p.add_subparsers(dest="cmd", required=True)
  for m in mods.values():
    m.add_parser(sub)
  args = p.parse_args(argv)
  try:
    return mods[args.cmd].run(args)
  except ValueError as e:
    p.error(str(e))
    return 2


if __name__ == "__main__":
  sys.exit(main())

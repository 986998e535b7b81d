"""Command line (also as the ``jcoccl`` script)::

python -m jcoccl info [--json]
python -m jcoccl check-codec SPEC_OR_FACTORY [...] [--all-builtins] [--dtypes ...]
python -m jcoccl explain MODULE:FUNCTION [--devices N] [--json]
python -m jcoccl --version
"""

from __future__ import annotations

import argparse
import json
import sys

from jcoccl._src.observability.info import version


def main(argv: list[str] | None = None) -> int:
  """Entry point of ``python -m jcoccl`` and the ``jcoccl`` script."""
  p = argparse.ArgumentParser(prog="jcoccl", description="jcoccl utilities")
  p.add_argument(
    "--version",
    action="version",
    version=f"jcoccl {version()}",
    help="print jcoccl's version and exit",
  )
  sub = p.add_subparsers(dest="cmd", required=True)
  i = sub.add_parser("info", help="versions, native extensions, devices")
  i.add_argument("--json", action="store_true", help="print JSON instead of text")
  from jcoccl._src.observability import check_codec_cli

  check_codec_cli.add_parser(sub)
  from jcoccl._src.observability import explain

  explain.add_parser(sub)
  args = p.parse_args(argv)
  if args.cmd == "check-codec":
    return check_codec_cli.run(args, p)
  if args.cmd == "explain":
    return explain.run(args, p)
  from jcoccl._src.observability.info import format_info, info

  d = info()
  print(json.dumps(d, indent=2) if args.json else format_info(d))
  return 0


if __name__ == "__main__":
  sys.exit(main())

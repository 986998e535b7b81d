"""Benchmarks with nccl-tests-style tables: ``python -m jcoccl.bench <subcommand> [--json]``.

Subcommands are registered in :data:`jcoccl.bench.__main__.SUBCOMMANDS`; each is a module
exposing ``add_parser(subparsers)`` and ``run(args) -> int``.
"""

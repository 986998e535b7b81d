"""jcoccl's version, in a module of its own: the codec plugin loader checks it and must not
import :mod:`jcoccl._src.observability.info` (which reports on every part of the package)."""

from __future__ import annotations

import importlib.metadata as md

# The source tree's version (pyproject.toml's); an installed distribution reports its own.
__version__ = "0.1.0"


def dist_version(dist: str) -> str | None:
  """The installed version of distribution ``dist``, or None where it is not installed.

  Args:
    dist: a distribution name, e.g. ``"jax"``.

  Returns:
    The version string, or None.

  Example:
    >>> dist_version("no-such-distribution") is None
    True
  """
  try:
    return md.version(dist)
  except md.PackageNotFoundError:
    return None


def version() -> str:
  """jcoccl's version: the installed distribution's, else ``jcoccl.__version__``.

  Returns:
    The version string.

  Example:
    >>> from jcoccl._src.version import version
    >>> version()
    '0.1.0'
  """
  return dist_version("jcoccl") or __version__

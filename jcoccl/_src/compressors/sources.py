"""Bringing codecs into a process by name: Python modules that register them, native plugins.

Policy files (``[codecs]``), ``python -m models.train --codec`` and launched workers name the
codecs they need this way, so every process of a run registers the same families before it
parses a spec.

Example:
  >>> import_codecs("examples.custom_codecs.topk")  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
import os
import pathlib
from collections.abc import Iterable

PLUGIN_SUFFIXES = (".so", ".dylib", ".dll")


def is_plugin(source: str) -> bool:
  """True if ``source`` names a native plugin library (by its file suffix)."""
  return pathlib.PurePath(source).suffix in PLUGIN_SUFFIXES or ".so." in source


def import_codecs(*sources: str | Iterable[str], base_dir: str | None = None) -> list[str]:
  """Imports codec modules and loads native codec plugins.

  Args:
    *sources: module names (``"mypkg.codecs"``: importing it runs its ``register`` calls)
      and plugin library paths (``"build/sign/libsign_codec.so"``: ``load_plugin``); lists
      of them are flattened.
    base_dir: relative plugin paths are taken from here (a policy file's directory);
      default: the current directory.

  Returns:
    The sources, plugin paths made absolute.

  Raises:
    ValueError: a module that cannot be imported or a plugin that cannot be loaded, naming
      it and the fix.

  Example:
    >>> import_codecs(["jcoccl.compressors"])
    ['jcoccl.compressors']
  """
  flat: list[str] = []
  for s in sources:
    flat.extend([s] if isinstance(s, str) else list(s))
  done = []
  for s in flat:
    if not isinstance(s, str) or not s.strip():
      raise ValueError(f"a codec source must be a module name or a plugin path, got {s!r}")
    if is_plugin(s):
      done.append(_plugin(s, base_dir))
    else:
      _module(s)
      done.append(s)
  return done


def _module(name: str) -> None:
  try:
    importlib.import_module(name)
  except ImportError as e:
    raise ValueError(
      f"cannot import codec module {name!r}: {e}; it must be importable from sys.path "
      "(install it, or run from the directory that holds it)"
    ) from e


def _plugin(path: str, base_dir: str | None) -> str:
  from jcoccl._src.compressors import plugins

  p = pathlib.Path(os.path.expanduser(path))
  if not p.is_absolute() and base_dir is not None:
    p = pathlib.Path(base_dir) / p
  p = p.resolve()
  plugins.load_plugin(str(p))
  return str(p)

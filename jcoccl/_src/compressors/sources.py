"""Bringing codecs into a process by name: Python modules that register them, native plugins.

Every tool that takes a codec spec finds the codec's code by one rule, :func:`import_codecs`:
policy files (``[codecs] modules`` and ``plugins``), ``--codec`` of ``python -m
models.train``, ``python -m jcoccl.bench`` (codecs, collectives, calibrate) and ``python -m
jcoccl check-codec``, and launched workers (which rerun the same command line).

A source is one of:

- a native plugin library (``.so``, ``.dylib``, ``.dll``): loaded with ``load_plugin``;
- a Python file (``.py``): imported from that file, as module ``<file stem>``;
- a module name (``mycodecs``, ``mypkg.codecs``): imported.

Relative paths, and module names, are looked up in the *base directory* first: the policy
file's directory for a TOML table, the current directory for a command-line flag. A module
name not found there is looked up on ``sys.path`` as ``import`` does.

Example:
  >>> import_codecs("examples.custom_codecs.topk")  # doctest: +SKIP
  ['examples.custom_codecs.topk']
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pathlib
import sys
import threading
from collections.abc import Iterable
from types import ModuleType
from typing import Any

PLUGIN_SUFFIXES = (".so", ".dylib", ".dll")
CODEC_FLAG_HELP = (
  "bring in a codec of your own before any spec is read: a module name (mycodecs), a "
  "Python file (path/to/log8.py) or a native plugin library (.so); relative paths and "
  "module names are looked up in the current directory first, then sys.path for modules "
  "(repeatable; docs/custom_compressors.md)"
)
_FILES: dict[str, ModuleType] = {}  # resolved .py path -> the module imported from it
_LOCK = threading.RLock()


def is_plugin(source: str) -> bool:
  """True if ``source`` names a native plugin library (by its file suffix)."""
  return pathlib.PurePath(source).suffix in PLUGIN_SUFFIXES or ".so." in source


def is_python_file(source: str) -> bool:
  """True if ``source`` names a Python file (``.py``) rather than a module."""
  return pathlib.PurePath(source).suffix == ".py"


def add_codec_flag(parser: Any, flag: str = "--codec") -> None:
  """Adds the ``--codec MODULE|FILE.py|PLUGIN`` flag (repeatable, dest ``codec_sources``)
  that every jcoccl command line shares; :func:`import_flagged` imports what it named.

  Example:
    >>> import argparse
    >>> p = argparse.ArgumentParser(); add_codec_flag(p)
    >>> p.parse_args(["--codec", "log8.py"]).codec_sources
    ['log8.py']
  """
  parser.add_argument(
    flag,
    dest="codec_sources",
    action="append",
    default=[],
    metavar="MODULE|FILE.py|PLUGIN",
    help=CODEC_FLAG_HELP,
  )


def import_flagged(args: Any, flag: str = "--codec") -> list[str]:
  """Imports the sources of :func:`add_codec_flag`'s flag (from the current directory);
  a failure is a ValueError that starts with the flag's name.

  Returns:
    The sources, file paths made absolute.
  """
  try:
    return import_codecs(list(getattr(args, "codec_sources", []) or []))
  except (ValueError, OSError, ImportError) as e:
    raise ValueError(f"{flag}: {e}") from None


def import_codecs(*sources: str | Iterable[str], base_dir: str | None = None) -> list[str]:
  """Imports codec modules and Python files, and loads native codec plugins.

  Args:
    *sources: module names (``"mypkg.codecs"``: importing it runs its ``register`` calls),
      Python files (``"codecs/log8.py"``) and plugin library paths
      (``"build/sign/libjcoccl_sign.so"``: ``load_plugin``); lists of them are flattened.
    base_dir: where relative paths and module names are looked up first (a policy file's
      directory); default: the current directory. Module names not found there come from
      ``sys.path``.

  Returns:
    The sources, file paths made absolute (so that a policy rebuilt elsewhere finds them).

  Raises:
    ValueError: a source that cannot be imported or loaded, naming it and the fix.

  Example:
    >>> import_codecs(["jcoccl.compressors"])
    ['jcoccl.compressors']
  """
  flat: list[str] = []
  for s in sources:
    flat.extend([s] if isinstance(s, str) else list(s))
  base = os.path.abspath(base_dir if base_dir is not None else os.getcwd())
  done = []
  for s in flat:
    if not isinstance(s, str) or not s.strip():
      raise ValueError(
        f"a codec source must be a module name, a .py file or a plugin library path, got {s!r}"
      )
    if is_plugin(s):
      done.append(_plugin(s, base))
    elif is_python_file(s):
      done.append(_file(s, base))
    else:
      _module(s, base)
      done.append(s)
  return done


def _path(source: str, base: str) -> pathlib.Path:
  p = pathlib.Path(os.path.expanduser(source))
  return (p if p.is_absolute() else pathlib.Path(base) / p).resolve()


def _module(name: str, base: str) -> None:
  """Imports module ``name``, from ``base`` if it is there, else from sys.path."""
  top = name.split(".")[0]
  local = any((pathlib.Path(base) / f).exists() for f in (f"{top}.py", f"{top}/__init__.py"))
  with _LOCK:
    added = local and base not in sys.path
    if added:
      sys.path.insert(0, base)
    try:
      importlib.import_module(name)
    except ImportError as e:
      where = f"{base} (then sys.path)" if local else f"{base} or sys.path"
      raise ValueError(
        f"cannot import codec module {name!r} from {where}: {e}; give a module importable "
        "from there, or the path of its .py file"
      ) from e
    finally:
      if added:
        sys.path.remove(base)


def _file(source: str, base: str) -> str:
  """Imports a Python file as module ``<stem>`` (once per file); returns its path."""
  p = _path(source, base)
  if not p.is_file():
    raise ValueError(f"no codec module file at {source!r} (looked at {p})")
  with _LOCK:
    if str(p) in _FILES:
      return str(p)
    name = p.stem
    other = sys.modules.get(name)
    if other is not None and getattr(other, "__file__", None) != str(p):
      raise ValueError(
        f"codec file {source!r} would be imported as module {name!r}, but a module of that "
        f"name is already imported from {getattr(other, '__file__', None)!r}; rename the file"
      )
    if other is None:
      spec = importlib.util.spec_from_file_location(name, p)
      assert spec is not None and spec.loader is not None
      other = importlib.util.module_from_spec(spec)
      sys.modules[name] = other  # dataclasses and pickling look the class's module up
      try:
        spec.loader.exec_module(other)
      except BaseException as e:
        del sys.modules[name]
        raise ValueError(f"codec file {source!r} failed to import: {type(e).__name__}: {e}") from e
    _FILES[str(p)] = other
  return str(p)


def _plugin(path: str, base: str) -> str:
  from jcoccl._src.compressors import plugins

  p = _path(path, base)
  plugins.load_plugin(str(p))
  return str(p)

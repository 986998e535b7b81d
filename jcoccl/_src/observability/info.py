"""``jcoccl.info()`` and ``python -m jcoccl info``: what this installation has."""

from __future__ import annotations

import os
from typing import Any

import jax
import jaxlib

from jcoccl._src.engine import nccl_interposer
from jcoccl._src.native import _ffi
from jcoccl._src.version import __version__ as __version__
from jcoccl._src.version import dist_version as _version
from jcoccl._src.version import version as version

# jcoccl/ (this file is jcoccl/_src/observability/info.py): include/ and share/ ship inside the package.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def get_include() -> str:
  """The directory to add to a compiler's include path for ``<jcoccl/codec_plugin.h>``.

  Example:
    >>> import os, jcoccl
    >>> os.path.isfile(os.path.join(jcoccl.get_include(), "jcoccl", "codec_plugin.h"))
    True
  """
  return os.path.join(_PACKAGE_DIR, "include")


def get_cmake_dir() -> str:
  """The directory holding ``jcocclConfig.cmake``: pass it as ``-Djcoccl_DIR=...`` so that
  ``find_package(jcoccl CONFIG)`` finds the ``jcoccl::codec_plugin`` target.

  Example:
    >>> import os, jcoccl
    >>> os.path.isfile(os.path.join(jcoccl.get_cmake_dir(), "jcocclConfig.cmake"))
    True
  """
  return os.path.join(_PACKAGE_DIR, "share", "cmake", "jcoccl")


def _nccl_version() -> str | None:
  mod = _ffi.native_module("cuda")
  fn = getattr(mod, "nccl_version", None) if mod is not None else None
  if fn is not None:
    try:
      code = fn()
    except Exception as e:
      return f"unavailable ({e})"
    # NCCL_VERSION_CODE since 2.9: major * 10000 + minor * 100 + patch.
    return f"{code // 10000}.{code % 10000 // 100}.{code % 100}" if isinstance(code, int) else code
  return _version("nvidia-nccl-cu13")


def info() -> dict[str, Any]:
  """Versions, native extensions and devices of this installation.

  Returns:
    A dict with keys ``jcoccl``, ``jax``, ``jaxlib``, ``nccl``, ``extensions`` (module ->
    {"loaded": bool, "targets": [...], "error": str | None}), ``devices`` and
    ``nccl_interposer`` (whether libjcoccl_nccl.so answers for libnccl.so.2, docs/nccl.md).

  Example:
    >>> import jcoccl
    >>> jcoccl.info()["extensions"]["cpu"]["loaded"]
    True
  """
  exts = {}
  for platform in ("cpu", "cuda"):
    mod = _ffi.native_module(platform)
    targets = sorted(mod.registrations()) if mod is not None else []
    exts[platform] = {
      "loaded": mod is not None,
      "targets": targets,
      "error": None if mod is not None else _ffi.native_import_error(platform),
    }
  return {
    "jcoccl": version(),
    "jax": jax.__version__,
    "jaxlib": jaxlib.__version__,
    "nccl": _nccl_version(),
    "extensions": exts,
    "devices": [f"{d.platform}:{d.id} {d.device_kind}" for d in jax.devices()],
    "nccl_interposer": nccl_interposer.summary(),
  }


def format_info(d: dict[str, Any]) -> str:
  """Renders :func:`info` as the text ``python -m jcoccl info`` prints."""
  lines = [
    f"jcoccl   {d['jcoccl']}",
    f"jax      {d['jax']}",
    f"jaxlib   {d['jaxlib']}",
    f"nccl     {d['nccl'] or 'not installed'}",
  ]
  for platform, e in d["extensions"].items():
    state = f"loaded, {len(e['targets'])} FFI targets" if e["loaded"] else "not built"
    if not e["loaded"] and e["error"]:
      state += f" ({e['error']})"
    lines.append(f"_{platform:<7} {state}")
  lines.append(f"devices  {', '.join(d['devices'])}")
  lines.append(f"nccl interposer  {d.get('nccl_interposer', 'not loaded')}")
  return "\n".join(lines)

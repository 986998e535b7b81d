"""Loads jcoccl's native extensions and registers their XLA FFI targets.

``jcoccl._cpu`` is always built; ``jcoccl._cuda`` only where nvcc and NCCL headers were
found at build time. A missing CUDA extension is normal on CPU machines. Targets are
registered once, on first use, under the names the C++ code gives them.
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType

import jax

from jcoccl._src.base import config as _config

_PLATFORMS = {"cpu": "jcoccl._cpu", "cuda": "jcoccl._cuda"}
# The platform names jax.ffi.register_ffi_target files handlers under. The CUDA PJRT plugin
# collects its handlers under "CUDA" (xla_client maps only "gpu" to it): a handler filed
# under "cuda" is queued for a platform that never comes, and every call of it fails with
# "No FFI handler registered ... on a platform CUDA".
_XLA_PLATFORMS = {"cpu": "cpu", "cuda": "CUDA"}


def native_module(platform: str) -> ModuleType | None:
  """Returns the native module for ``platform`` ("cpu" or "cuda"), or None if absent.

  None too where jcoccl's config says ``native=False`` (``JCOCCL_DISABLE_NATIVE=1``, read
  once into the config's defaults, or ``with jcoccl.config(native=False)``): every codec
  then runs its jnp specification. The config is part of ``jax.jit``'s cache key, so a
  program traced under one setting is traced again under the other.

  Example:
    >>> native_module("cpu") is not None
    True
  """
  if platform not in _PLATFORMS:
    raise ValueError(f"platform must be one of {sorted(_PLATFORMS)}, got {platform!r}")
  if not _config.current().native:
    return None
  return _import(platform)


@functools.cache
def _import(platform: str) -> ModuleType | None:
  if platform == "cuda":
    _preload_nccl()
  try:
    return importlib.import_module(_PLATFORMS[platform])
  except ImportError:
    return None


@functools.cache
def codes(table: str) -> dict[str, int]:
  """Name -> value of a C++ enum that crosses the FFI boundary, as the native module exports it.

  Tables: "CODEC_KINDS", "DTYPES" (by dtype name), "FP8_FORMATS" and "OPS" (fused engine).
  They are read from ``jcoccl._cpu`` even under ``native=False`` (they are constants,
  not kernels), so Python never keeps its own copy of the C++ values.

  Args:
    table: the table's name.

  Returns:
    A dict from name to integer value.

  Example:
    >>> codes("DTYPES")["bfloat16"]
    1
  """
  try:
    mod = importlib.import_module(_PLATFORMS["cpu"])
  except ImportError as e:
    raise ImportError(
      f"jcoccl's native module jcoccl._cpu is missing ({e}); reinstall jcoccl"
    ) from e
  if not hasattr(mod, table):
    raise ValueError(f"table must be one of CODEC_KINDS, DTYPES, FP8_FORMATS, OPS, got {table!r}")
  return {str(k): int(v) for k, v in getattr(mod, table).items()}


def require_module(platform: str) -> ModuleType:
  """The native module for ``platform``; ImportError saying why where it is absent.

  Example:
    >>> require_module("cpu").__name__
    'jcoccl._cpu'
  """
  mod = native_module(platform)
  if mod is None:
    why = unavailable_reason(platform)
    raise ImportError(f"jcoccl's native module for {platform!r} is unavailable: {why}")
  return mod


def unavailable_reason(platform: str) -> str:
  """Why :func:`native_module` gives None for ``platform``: its ImportError, or the config."""
  return native_import_error(platform) or (
    "disabled by jcoccl.config(native=False) or JCOCCL_DISABLE_NATIVE=1"
  )


def native_import_error(platform: str) -> str | None:
  """The ImportError text of a native module that failed to load, else None."""
  try:
    importlib.import_module(_PLATFORMS[platform])
  except ImportError as e:
    return str(e)
  return None


def register(platform: str) -> frozenset[str]:
  """Registers every FFI target of ``platform``'s native module; returns their names.

  Returns an empty set when the module is absent or not to be used (``native=False``).
  Safe to call many times.
  """
  return _register(platform) if _config.current().native else frozenset()


@functools.cache
def _register(platform: str) -> frozenset[str]:
  mod = _import(platform)
  if mod is None:
    return frozenset()
  names = []
  for name, capsule in mod.registrations().items():
    jax.ffi.register_ffi_target(name, capsule, platform=_XLA_PLATFORMS[platform])
    names.append(name)
  return frozenset(names)


def has_target(name: str, platform: str) -> bool:
  """True if the native FFI target ``name`` exists (and is registered) for ``platform``."""
  return name in register(platform)


def _preload_nccl() -> None:
  """Makes libnccl.so.2 from the nvidia-nccl-cu13 wheel findable by its SONAME.

  The CUDA extension opens NCCL with dlopen("libnccl.so.2"); loading the wheel's copy
  with RTLD_GLOBAL first lets that call find it without LD_LIBRARY_PATH.
  ``JCOCCL_NCCL_LIBRARY`` names another libnccl.so.2 to use instead.
  """
  import ctypes

  path = os.environ.get("JCOCCL_NCCL_LIBRARY")
  if not path:
    try:
      import nvidia.nccl
    except ImportError:
      return
    path = os.path.join(list(nvidia.nccl.__path__)[0], "lib", "libnccl.so.2")
  if os.path.exists(path):
    try:
      ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError:
      pass

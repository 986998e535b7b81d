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

_PLATFORMS = {"cpu": "jcoccl._cpu", "cuda": "jcoccl._cuda"}
# The platform names jax.ffi.register_ffi_target files handlers under. The CUDA PJRT plugin
# collects its handlers under "CUDA" (xla_client maps only "gpu" to it): a handler filed
# under "cuda" is queued for a platform that never comes, and every call of it fails with
# "No FFI handler registered ... on a platform CUDA".
_XLA_PLATFORMS = {"cpu": "cpu", "cuda": "CUDA"}


@functools.cache
def native_module(platform: str) -> ModuleType | None:
  """Returns the native module for ``platform`` ("cpu" or "cuda"), or None if absent.

  Set ``JCOCCL_DISABLE_NATIVE=1`` to ignore both modules (every codec then runs its jnp
  specification).

  Example:
    >>> native_module("cpu") is not None
    True
  """
  if platform not in _PLATFORMS:
    raise ValueError(f"platform must be one of {sorted(_PLATFORMS)}, got {platform!r}")
  if os.environ.get("JCOCCL_DISABLE_NATIVE", "") not in ("", "0"):
    return None
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
  They are read from ``jcoccl._cpu`` even under ``JCOCCL_DISABLE_NATIVE`` (they are constants,
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
    why = native_import_error(platform) or "disabled by JCOCCL_DISABLE_NATIVE"
    raise ImportError(f"jcoccl's native module for {platform!r} is unavailable: {why}")
  return mod


def native_import_error(platform: str) -> str | None:
  """The ImportError text of a native module that failed to load, else None."""
  try:
    importlib.import_module(_PLATFORMS[platform])
  except ImportError as e:
    return str(e)
  return None


@functools.cache
def register(platform: str) -> frozenset[str]:
  """Registers every FFI target of ``platform``'s native module; returns their names.

  Returns an empty set when the module is absent. Safe to call many times.
  """
  mod = native_module(platform)
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

"""The size threshold: messages (per pytree leaf, local bytes) under ``min_bytes`` go
uncompressed, and a codec the caller named but the built-in default dropped is said once
(:class:`SkippedCompression`). The default is the current config's
(:mod:`jcoccl._src.base.config`).
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp

from jcoccl._src.base import config as _config
from jcoccl._src.compressors.compressor_args import check_dtype, is_float


def set_default_min_bytes(nbytes: int | None) -> None:
  """Sets the process-wide default ``min_bytes`` of every collective.

  Messages (each pytree leaf's local size in bytes) smaller than this go uncompressed
  through the plain lax collective. The built-in default is 4 MiB; the environment
  variable ``JCOCCL_MIN_BYTES`` overrides it; ``None`` restores that. A shorthand kept for
  existing code: the documented way is ``jcoccl.set_config_defaults(min_bytes=...)`` (the
  README's, and what the :class:`SkippedCompression` warning names); ``with
  jcoccl.config(min_bytes=...)`` sets it for a block.

  Args:
    nbytes: non-negative int, or None.

  Example:
    >>> import jcoccl
    >>> jcoccl.set_default_min_bytes(0)  # compress everything
    >>> jcoccl.set_default_min_bytes(None)
  """
  if nbytes is not None and (isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0):
    raise ValueError(f"min_bytes must be a non-negative int or None, got {nbytes!r}")
  if nbytes is None:
    nbytes = _config.from_environment().min_bytes
  _config.set_defaults(min_bytes=nbytes)


def default_min_bytes() -> int:
  """The ``min_bytes`` in effect (the current :func:`jcoccl.config`'s)."""
  return _config.current().min_bytes


def effective_compressor(
  x: jax.Array, compressor: Any, min_bytes: int | None, strict: bool = True
) -> Any:
  """The compressor for leaf ``x`` after the size threshold (None = exact lax path).

  A lossy compressor applies to float32/bfloat16/float16 leaves of at least ``min_bytes``
  bytes; other leaves of a pytree go exactly (``strict=False``), while a lone array of
  another dtype (``strict=True``) raises TypeError.
  """
  if compressor is None:
    return None
  if not strict and not compressor.lossless and not is_float(x.dtype):
    return None
  check_dtype(x.dtype, compressor)
  threshold = default_min_bytes() if min_bytes is None else min_bytes
  if not isinstance(threshold, int) or threshold < 0:
    raise ValueError(f"min_bytes must be a non-negative int or None, got {min_bytes!r}")
  nbytes = x.size * jnp.dtype(x.dtype).itemsize
  return compressor if nbytes >= threshold else None


class SkippedCompression(UserWarning):
  """A codec the caller named was not applied to a leaf because the leaf is under the
  built-in default ``min_bytes`` (4 MiB; the caller set none: not in the call, a policy,
  :func:`jcoccl.config` or ``JCOCCL_MIN_BYTES``). Said once per (op, axes) in a process;
  ``warnings.simplefilter("ignore", jcoccl.SkippedCompression)`` silences it, and
  ``min_bytes=0`` (or :func:`jcoccl.config`, a policy's ``min_bytes``) compresses."""


_SKIP_WARNED: set = set()  # (op, axes): said already in this process (warnings only)


def skip_reason(x: jax.Array, compressor: Any, min_bytes: int | None, strict: bool) -> str:
  """Why ``compressor`` does not apply to leaf ``x`` ("" when it does): the dtype, or the
  size threshold (saying whether it is the default or the one given).

  Example:
    >>> skip_reason(jnp.zeros(8), jcoccl.compressors.int8(), None, False)  # doctest: +SKIP
    'under min_bytes: 32 B < 4194304 B (the default; min_bytes=0 compresses it)'
  """
  if compressor is None:
    return ""
  if not strict and not compressor.lossless and not is_float(x.dtype):
    return f"dtype {jnp.dtype(x.dtype).name} is not float32/bfloat16/float16"
  threshold = default_min_bytes() if min_bytes is None else min_bytes
  nbytes = x.size * jnp.dtype(x.dtype).itemsize
  if nbytes >= threshold:
    return ""
  given = "the default; min_bytes=0 compresses it" if min_bytes is None else "given"
  return f"under min_bytes: {nbytes} B < {threshold} B ({given})"


def warn_default_threshold(
  op: str, axes: tuple, x: jax.Array, compressor: Any, min_bytes: Any
) -> None:
  """Warns (:class:`SkippedCompression`, once per (op, axes)) when a named codec is
  dropped for leaf ``x`` only because it is under the built-in default ``min_bytes``; a
  threshold the caller gave (in the call, a policy, :func:`jcoccl.config` or
  ``JCOCCL_MIN_BYTES``) is what they asked for and goes unsaid."""
  levels = compressor if isinstance(compressor, tuple) else (compressor,)
  named = next((c for c in levels if c is not None), None)
  if min_bytes is not None or named is None or (op, axes) in _SKIP_WARNED:
    return
  if not named.lossless and not is_float(x.dtype):
    return
  nbytes, threshold = x.size * jnp.dtype(x.dtype).itemsize, default_min_bytes()
  if nbytes >= threshold or threshold != _config.BUILTIN_MIN_BYTES:
    return
  _SKIP_WARNED.add((op, axes))
  import warnings

  warnings.warn(
    f"jcoccl.{op} over {axes}: a {jnp.dtype(x.dtype).name}{list(x.shape)} leaf "
    f"({nbytes} B) goes exactly, without compressor {named}: it is under the built-in "
    f"default min_bytes of {threshold} B. To compress it pass min_bytes=0 (or a smaller threshold) "
    "to the call, use a policy's min_bytes, or set it for a block with "
    "jcoccl.config(min_bytes=...) or for the process with "
    "jcoccl.set_config_defaults(min_bytes=...). Said once per op and axes; jcoccl.explain(fn, ...) lists "
    "every leaf.",
    SkippedCompression,
    skip_file_prefixes=(_package_dir(), os.path.dirname(jax.__file__)),
  )


def _package_dir() -> str:
  # jcoccl/ (this file is jcoccl/_src/compressors/threshold.py).
  return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

"""Shared canonicalisation for the collectives: axes, compressors, chunks, threshold, the
payload gathers, and the all_reduce algorithm cost model.

How a message becomes padded, sliced rows is :mod:`jcoccl._src.layout`'s.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jcoccl._src import _compat, auto_model, layout
from jcoccl._src import config as _config

# ----------------------------------------------------------------------------------------
# Threshold: messages (per pytree leaf, local bytes) under it go uncompressed.

# The default is the current config's (:mod:`jcoccl._src.config`).


def set_default_min_bytes(nbytes: int | None) -> None:
  """Sets the process-wide default ``min_bytes`` of every collective.

  Messages (each pytree leaf's local size in bytes) smaller than this go uncompressed
  through the plain lax collective. The built-in default is 4 MiB; the environment
  variable ``JCOCCL_MIN_BYTES`` overrides it; ``None`` restores that. Shorthand for
  ``jcoccl.set_config_defaults(min_bytes=...)``; ``with jcoccl.config(min_bytes=...)``
  sets it for a block.

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


# ----------------------------------------------------------------------------------------
# Axes.


def canonical_axes(axis_name: Any, empty: bool = False) -> tuple[str, ...]:
  """``axis_name`` (a name or a tuple/list of names) as a tuple, non-empty unless ``empty``
  (the collectives take ``()`` as lax's do: a group of one, whose result is the lax op's
  over no axis).

  Example:
    >>> canonical_axes("data"), canonical_axes(["pod", "data"]), canonical_axes((), empty=True)
    (('data',), ('pod', 'data'), ())
  """
  axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
  if not axes and not empty:
    raise ValueError("axis_name must be a mesh axis name or a non-empty tuple of them")
  if len(set(axes)) != len(axes):
    raise ValueError(f"axis_name has duplicate names: {axis_name!r}")
  return axes


class AxisNameError(NameError, ValueError):
  """An axis name not bound where the collective runs (a NameError, as lax raises, and a
  ValueError, as earlier jcoccl versions raised). The message is lax's (``lax.axis_size``'s;
  the ops put their lax op's in its place, :mod:`jcoccl._src.lax_errors`), then jcoccl's
  ``hint``."""

  def __init__(self, message: str, hint: str = "") -> None:
    super().__init__(message)
    self.hint = hint


def group_size(axes: Sequence[Any]) -> int:
  """Product of the sizes of ``axes``; raises :class:`AxisNameError` for unbound names."""
  size = 1
  for a in axes:
    try:
      size *= lax.axis_size(a)
    except (NameError, KeyError, ValueError) as e:
      hint = (
        f"axis_name {a!r} is not a mesh axis bound here: call the op inside jax.shard_map "
        "over a mesh with that axis"
      )
      raise AxisNameError(f"{e}\n(jcoccl: {hint})", hint) from None
  return int(size)


def off_mesh(axes: Sequence[str]) -> bool:
  """True when some of ``axes`` are bound by ``jax.vmap(..., axis_name=...)`` rather than by
  a mesh, or there are none (``()``): values there live in one program and nothing crosses
  a wire, so the collective runs exactly (the lax op)."""
  names = _compat.mesh_axis_names()
  return not axes or any(a not in names for a in axes)


def ensure_varying(x: jax.Array, axes: Sequence[str]) -> jax.Array:
  """Marks ``x`` as varying over ``axes`` (as lax collectives do implicitly) under check_vma."""
  if not _compat.check_vma_enabled():
    return x
  # Unreduced axes stay so: the sum over them is the collective's (see all_reduce).
  have = _compat.varying_axes(x) | _compat.unreduced_axes(x)
  missing = tuple(a for a in axes if a not in have)
  return lax.pcast(x, missing, to="varying") if missing else x


def vma_of(x: jax.Array) -> frozenset:
  """The axes ``x`` varies over (empty outside check_vma)."""
  return _compat.varying_axes(x) if _compat.check_vma_enabled() else frozenset()


def match_vma(x: jax.Array, vma: frozenset) -> jax.Array:
  """Marks ``x`` varying over the axes of ``vma`` it lacks (cotangents must carry the
  primal's varying axes)."""
  missing = tuple(sorted(a for a in vma if a not in _compat.varying_axes(x)))
  return lax.pcast(x, missing, to="varying") if missing else x


# Codec calls that keep the input's varying axes: native custom calls (ffi_call) return
# results without them, which would make shard_map insert pvary/psum pairs around the op.


def encode_rows(c: Any, x2d: jax.Array, key: Any = None) -> jax.Array:
  return match_vma(c.encode_rows(x2d, key=key), vma_of(x2d))


def decode_rows(c: Any, buf: jax.Array, n: int, dtype: Any) -> jax.Array:
  return match_vma(c.decode_rows(buf, n, dtype), vma_of(buf))


def decode_sum(c: Any, buf: jax.Array, n: int, dtype: Any) -> jax.Array:
  return match_vma(c.decode_sum(buf, n, dtype), vma_of(buf))


def decode_sum_encode(c: Any, buf: jax.Array, n: int, dtype: Any) -> jax.Array:
  return match_vma(c.decode_sum_encode(buf, n, dtype), vma_of(buf))


# Payload all-gathers. XLA's all-gather is the default everywhere: across 4 CPU processes
# (gloo, 16 MiB per rank, barrier-timed) it beat an all-to-all of the row broadcast to every
# rank by 15% at 1 Gbit/s (int8 all_gather 425 vs 502 ms) and 19% at 10 Gbit/s (79 vs
# 97 ms). The all-to-all stays selectable for transports whose all-gather is the slow one.
GATHERS = _config.GATHERS


def gather_method() -> str:
  """How payload rows are all-gathered: the current config's ``gather`` (default env
  JCOCCL_GATHER = auto | all_gather | all_to_all; auto: XLA's all-gather)."""
  return _config.current().gather


def gather_decode(
  c: Any,
  row: jax.Array,
  axes: Sequence[str],
  n: int,
  dtype: Any,
  *,
  sum_rows: bool,
  invariant: bool,
) -> jax.Array:
  """All-gathers one payload row per rank of ``axes`` and decodes what arrived.

  Args:
    c: the compressor of the payloads.
    row: this rank's ``uint8[P]`` payload.
    axes: the mesh axes to gather over.
    n: elements per decoded row.
    dtype: decoded dtype.
    sum_rows: return the float32 left-fold sum of the rows in rank order (``dtype[n]``)
      instead of the rows (``dtype[ranks, n]``).
    invariant: type the result device-invariant over ``axes`` (every rank decodes the same
      bytes in the same order, so it is the same value everywhere).

  Returns:
    The decoded rows, or their sum.
  """
  axes = tuple(axes)
  d = jnp.dtype(dtype)
  decode = decode_sum if sum_rows else decode_rows
  if gather_method() == "all_to_all":
    from jcoccl._src.compressors import native

    op = "decode_sum" if sum_rows else "decode"
    if not invariant or native.available(c, op, d):
      k = group_size(axes)
      every = lax.all_to_all(jnp.broadcast_to(row[None], (k,) + row.shape), axes, 0, 0, tiled=True)
      if not invariant:
        return decode(c, every, n, d)
      fn = native.decode_sum if sum_rows else native.decode_rows
      return fn(c, every, n, d, invariant_over=axes)
  every = lax.all_gather(row, axes, axis=0, tiled=False, to="invarying" if invariant else "varying")
  return decode(c, every, n, d)


# ----------------------------------------------------------------------------------------
# Compressors.


def resolve_compressor(compressor: Any, argname: str = "compressor") -> Any:
  """A Compressor from a Compressor, spec string or None; None for the exact path.

  ``none()`` and None both mean "exact": the op calls the lax collective itself.
  """
  if compressor is None:
    return None
  if isinstance(compressor, str) and compressor.strip().startswith("auto:"):
    rest = compressor.strip()[len("auto:") :]
    raise ValueError(
      f"{argname}={compressor!r}: 'auto:' lets all_reduce's algorithm='auto' run the exact "
      f"op where that is predicted faster; it applies to jcoccl.all_reduce's compressor "
      f"(and a policy's all_reduce entry) only. Here write {rest!r} (error feedback: "
      f"{rest!r} with algorithm='auto_exact')"
    )
  if isinstance(compressor, str):
    from jcoccl import compressors as _c

    try:
      compressor = _c.parse(compressor)
    except ValueError as e:
      raise ValueError(f"{argname}: {e}") from None
  if not hasattr(compressor, "encode_rows") or not hasattr(compressor, "granule"):
    raise TypeError(
      f"{argname} must be a jcoccl Compressor, a spec string (e.g. 'int8') or None, "
      f"got {compressor!r}"
    )
  from jcoccl._src.compressors import registry

  try:
    registry.family_of(compressor)  # the ops carry it as its spec string
  except TypeError as e:
    raise TypeError(f"{argname}: {e}") from None
  if getattr(compressor, "kind", None) == "none":
    return None
  return compressor


def check_dtype(dtype: Any, compressor: Any, argname: str = "compressor") -> None:
  """Raises TypeError when a lossy ``compressor`` is given a non-floating ``dtype``."""
  if compressor is None or compressor.lossless:
    return
  if jnp.dtype(dtype) not in (
    jnp.dtype(jnp.float32),
    jnp.dtype(jnp.bfloat16),
    jnp.dtype(jnp.float16),
  ):
    raise TypeError(
      f"{argname} {compressor} is lossy and accepts float32, bfloat16 or float16 inputs; "
      f"got dtype {jnp.dtype(dtype).name} (pass compressor=None for this leaf)"
    )


def is_float(dtype: Any) -> bool:
  """float32, bfloat16 or float16: the dtypes lossy compressors take."""
  return jnp.dtype(dtype) in (
    jnp.dtype(jnp.float32),
    jnp.dtype(jnp.bfloat16),
    jnp.dtype(jnp.float16),
  )


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
    "to the call, or set jcoccl.config(min_bytes=...) / jcoccl.set_default_min_bytes(...) "
    "or a policy's min_bytes. Said once per op and axes; jcoccl.explain(fn, ...) lists "
    "every leaf.",
    SkippedCompression,
    skip_file_prefixes=(_package_dir(), os.path.dirname(jax.__file__)),
  )


def _package_dir() -> str:
  return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def is_lone_array(x: Any) -> bool:
  """True when ``x`` is one array rather than a container of them."""
  return jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(x))


SAME = "same"  # grad_compressor default: reuse the forward compressor


def resolve_grad_compressor(grad_compressor: Any, forward: Any) -> Any:
  """``grad_compressor`` resolved; the default ("same") is the forward compressor."""
  if isinstance(grad_compressor, str) and grad_compressor == SAME:
    return forward
  return resolve_compressor(grad_compressor, "grad_compressor")


def grad_for(x: jax.Array, grad_compressor: Any) -> Any:
  """The backward compressor for leaf ``x`` (dtype-checked; threshold applied in bwd)."""
  if grad_compressor is None or grad_compressor.lossless:
    return grad_compressor
  if jnp.dtype(x.dtype) not in (
    jnp.dtype(jnp.float32),
    jnp.dtype(jnp.bfloat16),
    jnp.dtype(jnp.float16),
  ):
    return None  # integer leaves have no cotangent to compress
  return grad_compressor


def canonical_args(
  axis_name: Any, compressor: Any, grad_compressor: Any, chunks: Any, tiled: Any = False
) -> tuple[tuple[str, ...], Any, Any]:
  """The arguments every compressed collective shares, checked and canonicalised.

  Args:
    axis_name: mesh axis name or tuple of names.
    compressor: Compressor, spec string or None.
    grad_compressor: the backward compressor (``SAME`` = ``compressor``).
    chunks: positive int.
    tiled: a bool, or 0/1 (ops without ``tiled`` pass the default).

  Returns:
    (axes tuple, forward compressor or None, backward compressor or None).

  Example:
    >>> canonical_args("data", "int8", SAME, 1)  # doctest: +SKIP
  """
  axes = canonical_axes(axis_name, empty=True)
  comp = resolve_compressor(compressor)
  gcomp = resolve_grad_compressor(grad_compressor, comp)
  check_chunks(chunks)
  # lax takes any truth value; 0 and 1 (and numpy's bools) are ones people write.
  if not (isinstance(tiled, (bool, int, np.bool_, np.integer)) and tiled in (0, 1)):
    raise TypeError(f"tiled must be a bool (or 0/1, as lax takes them), got {tiled!r}")
  return axes, comp, gcomp


def check_chunks(chunks: Any) -> int:
  """Checks that ``chunks`` is a positive int (its upper limit depends on the message:
  see :func:`jcoccl._src.layout.slices`)."""
  if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
    raise ValueError(f"chunks must be a positive int, got {chunks!r}")
  return chunks


# ----------------------------------------------------------------------------------------
# Per-slice keys.


def rank_key(key: Any, axes: Sequence[str], chunk: int) -> Any:
  """A per-rank, per-chunk PRNG key (None stays None)."""
  if key is None:
    return None
  idx = lax.axis_index(tuple(axes))
  return jax.random.fold_in(jax.random.fold_in(key, idx), chunk)


# ----------------------------------------------------------------------------------------
# Cost model for all_reduce algorithm="auto".


def choose_all_reduce(nbytes: int, n: int, ratio: float) -> str:
  """The cheaper of one_shot and two_shot under the platform's default cost model
  (:mod:`jcoccl._src.cost_model`), by time alone; algorithm="auto" without a calibration
  also keeps within the exact op's bytes (:func:`jcoccl._src.all_reduce.choose`).

  Example:
    >>> choose_all_reduce(64 * 1024, 8, 0.26), choose_all_reduce(64 << 20, 8, 0.26)
    ('one_shot', 'two_shot')
  """
  return auto_model.active().choose(nbytes, n, ratio)


def compression_ratio(compressor: Any, n: int, dtype: Any) -> float:
  """payload_nbytes / raw bytes for a row of ``n`` elements (granule-padded)."""
  n = layout.padded_len(n, compressor.granule)
  return compressor.payload_nbytes(n, dtype) / (n * jnp.dtype(dtype).itemsize)

"""Backend registry for the compressed collectives.

Each public op (all_reduce, all_gather, reduce_scatter, all_to_all, ppermute) canonicalises
its arguments (pytree leaf -> padded rows, axis names -> tuple, compressor resolved) and then
calls the implementation registered for the chosen backend. Backends:

  "xla"    codec (jnp or native custom call) + XLA's own collectives; registered by each op
           module of jcoccl/_src; always available.
  "fused"  one custom call per collective, run by jcoccl's engine; registered by
           jcoccl/_src/engine/fused_comms.py (at init, the implementations of fused_ops.py) with
           ``register("fused", op, fn)`` and ``set_fused_check(fn)``.

One predicate, the fused check ``fn(op, axes, **call) -> str | None``, says why the fused
engine cannot run a call (or None when it can); ``call`` holds what the op module knows at
trace time (``compressor``, ``dtype``, and ``algorithm`` for all_reduce). ``backend="auto"``
picks "fused" when it is registered for the op and the check passes, else "xla";
``backend="fused"`` raises ValueError with the check's reason.

Implementation signatures (every implementation of an op takes exactly these arguments;
all arrays are local, per-device values inside ``jax.shard_map``; ``n`` = product of the
sizes of ``axes``; ``dtype`` is float32, bfloat16 or float16; ``chunks`` is the slice count
the op module settled on (the user's value clamped by :func:`jcoccl._src.compressors.layout.slices`);
every row length is already padded with zeros so that it is a multiple of
``chunks * granule`` (see :class:`jcoccl._src.compressors.layout.RowLayout`); AD, vmap and
varying-axes bookkeeping are done by the op module, so implementations need none of them):

  all_reduce(x: dtype[M], *, axes, compressor, algorithm, chunks, key) -> dtype[M]
      algorithm in {"one_shot", "two_shot", "hierarchical"}. For "hierarchical" the outer
      level is ``axes[:-1]``, the inner level ``axes[-1:]``, and ``compressor`` is a pair
      (outer, inner) of Compressor-or-None; otherwise a Compressor.
      M is a multiple of chunks * granule (one_shot), chunks * n * granule (two_shot),
      chunks * n_inner * lcm(granules) (hierarchical; outer level runs one_shot).
  reduce_scatter(x: dtype[n, C], *, axes, compressor, chunks, key) -> dtype[C]
      row j is this rank's contribution to rank j; the result is sum over source ranks
      (f32 left fold in source-rank order, cast once).
  all_gather(x: dtype[C], *, axes, compressor, chunks, key) -> dtype[n, C]
      row i of the result is rank i's x (decoded).
  all_to_all(x: dtype[n, C], *, axes, compressor, chunks, key) -> dtype[n, C]
      row j is sent to rank j; row i of the result came from rank i.
  ppermute(x: dtype[C], *, axes, perm, compressor, chunks, key) -> dtype[C]
      perm: tuple of (source, destination) pairs over the linear index of ``axes``;
      ranks that receive nothing return zeros (as lax.ppermute).

Chunking (``chunks = k``): the row length (M or C) is split into k equal contiguous column
slices, and slice i is processed entirely on its own (encode -> collective -> decode); the
results are concatenated. ``key`` (stochastic rounding) is None, or a PRNG key that the
implementation folds with the chunk index and the rank's linear index along ``axes``.

Example:
  >>> from jcoccl._src.native import _backend
  >>> "xla" in _backend.registered("all_reduce")
  True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from jcoccl._src.base.op_names import OPS as OPS

BACKENDS = ("auto", "xla", "fused")

_REGISTRY: dict[str, dict[str, Callable[..., Any]]] = {op: {} for op in OPS}
_fused_check: Callable[..., str | None] | None = None
# Part of jit's cache key (as jcoccl's config is): a new value whenever the table or the
# fused check changes, so a program traced before jcoccl.init (or shutdown) traces again
# and picks its backend from the registry as it is now.
_JIT_KEY = jax.make_user_context(0)


def _changed() -> None:
  _JIT_KEY.set_global(_JIT_KEY.get_global() + 1)


def register(backend: str, op: str, fn: Callable[..., Any]) -> None:
  """Registers ``fn`` as ``backend``'s implementation of ``op`` (signatures: module doc).

  Args:
    backend: backend name, e.g. "xla" or "fused".
    op: one of :data:`OPS`.
    fn: the implementation.
  """
  if op not in _REGISTRY:
    raise ValueError(f"op must be one of {OPS}, got {op!r}")
  if backend == "auto":
    raise ValueError("backend name 'auto' is reserved")
  _REGISTRY[op][backend] = fn
  _changed()


def unregister(backend: str, op: str) -> None:
  """Removes ``backend``'s implementation of ``op`` if present."""
  if _REGISTRY.get(op, {}).pop(backend, None) is not None:
    _changed()


def registered(op: str) -> tuple[str, ...]:
  """The backend names registered for ``op``."""
  return tuple(_REGISTRY[op])


def set_fused_check(fn: Callable[..., str | None] | None) -> None:
  """Sets the predicate ``fn(op, axes, **call) -> reason or None`` of the fused backend.

  The fused module sets it when its engine is initialised (and clears it with None on
  shutdown). A string return is why "fused" cannot run the call: "auto" then uses "xla",
  and an explicit "fused" raises ValueError with that text.
  """
  global _fused_check
  _fused_check = fn
  _changed()


def validate(op: str, backend: Any) -> None:
  """Checks ``backend`` names a backend usable for ``op`` (before the call is known).

  Raises:
    TypeError: ``backend`` is not a str.
    ValueError: unknown ``backend``, or one not registered for ``op``.
  """
  if not isinstance(backend, str):
    raise TypeError(f"backend must be a str, one of {BACKENDS}, got {backend!r}")
  impls = _REGISTRY[op]
  if backend == "auto" or backend in impls:
    return
  if backend == "fused":
    raise ValueError(
      "backend='fused' is not available: call jcoccl.init(mesh) first (it registers "
      "the fused engine), or use backend='xla' or 'auto'"
    )
  raise ValueError(f"backend must be one of {sorted(set(BACKENDS) | set(impls))}, got {backend!r}")


def resolve(
  op: str, backend: str, axes: Sequence[str], **call: Any
) -> tuple[str, Callable[..., Any]]:
  """Returns (name, implementation) of the backend that runs ``op`` over ``axes``.

  Args:
    op: one of :data:`OPS`.
    backend: "auto", "xla" or "fused" (or another registered name).
    axes: the op's tuple of mesh axis names.
    **call: what the fused check needs: ``compressor`` (a Compressor, or for a
      hierarchical all_reduce the pair (outer, inner)), ``dtype``, and ``algorithm`` for
      all_reduce.

  Raises:
    ValueError: unknown ``backend``, a backend not registered for ``op``, or
      backend="fused" for a call the fused engine cannot run (the message says why).
  """
  validate(op, backend)
  impls = _REGISTRY[op]
  if backend == "auto":
    if "fused" in impls and _fused_reason(op, axes, call) is None:
      return "fused", impls["fused"]
    return "xla", impls["xla"]
  if backend == "fused":
    reason = _fused_reason(op, axes, call)
    if reason is not None:
      raise ValueError(reason)
  return backend, impls[backend]


def at_lowering(op: str, params: dict[str, Any], **call: Any) -> dict[str, Any]:
  """``params`` of a leaf, with an automatic "fused" choice checked again while lowering.

  At trace time the devices of a ``jax.shard_map`` under ``jax.jit`` are not known (only
  its axis names and sizes); the lowering knows them. A leaf for which ``backend="auto"``
  chose "fused" runs "xla" where the fused check now gives a reason (e.g. a mesh with
  other devices than ``jcoccl.init``'s); an explicit "fused" raises ValueError with it.

  Args:
    op: one of :data:`OPS`.
    params: the leaf's primitive params (``backend``, ``backend_arg``, ``axes``).
    **call: as :func:`resolve`'s.

  Returns:
    ``params``, or a copy with ``backend="xla"``.

  Example:
    >>> at_lowering("all_gather", {"backend": "xla"})["backend"]
    'xla'
  """
  if params.get("backend") != "fused":
    return params
  reason = _fused_reason(op, params["axes"], call)
  if reason is None:
    return params
  if params.get("backend_arg") == "fused":
    raise ValueError(reason)
  return {**params, "backend": "xla"}


def implementation(op: str, name: str) -> Callable[..., Any]:
  """The implementation of ``op`` registered by backend ``name`` (already resolved)."""
  return _REGISTRY[op][name]


def _fused_reason(op: str, axes: Sequence[str], call: dict[str, Any]) -> str | None:
  if _fused_check is None:
    return (
      "backend='fused' is not available: call jcoccl.init(mesh) first, or use "
      "backend='xla' or 'auto'"
    )
  return _fused_check(op, tuple(axes), **call)

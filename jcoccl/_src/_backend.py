"""Backend registry for the compressed collectives.

Each public op (all_reduce, all_gather, reduce_scatter, all_to_all, ppermute) canonicalises
its arguments (pytree leaf -> padded rows, axis names -> tuple, compressor resolved) and then
calls the implementation registered for the chosen backend. Backends:

  "xla"    codec (jnp or native custom call) + XLA's own collectives; registered by each op
           module of jcoccl/_src; always available.
  "fused"  one custom call per collective, run by jcoccl's engine; registered by
           jcoccl/_src/fused.py with ``register("fused", op, fn)`` and
           ``set_auto_hook(fn)``.

``backend="auto"`` picks "fused" when the auto hook says the fused engine is initialised for
the op's axes and "fused" is registered for the op, else "xla".

Implementation signatures (every implementation of an op takes exactly these arguments;
all arrays are local, per-device values inside ``jax.shard_map``; ``n`` = product of the
sizes of ``axes``; ``dtype`` is float32, bfloat16 or float16; every row length is already
padded with zeros so that it is a multiple of ``chunks * granule`` (see
:func:`jcoccl._src._common.padded_len`); AD, vmap and varying-axes bookkeeping are done by
the op module, so implementations need none of them):

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
  >>> from jcoccl._src import _backend
  >>> "xla" in _backend.registered("all_reduce")
  True
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "ppermute")
BACKENDS = ("auto", "xla", "fused")

_REGISTRY: dict[str, dict[str, Callable[..., Any]]] = {op: {} for op in OPS}
_auto_hook: Callable[[Sequence[str]], bool] | None = None


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


def unregister(backend: str, op: str) -> None:
  """Removes ``backend``'s implementation of ``op`` if present."""
  _REGISTRY.get(op, {}).pop(backend, None)


def registered(op: str) -> tuple[str, ...]:
  """The backend names registered for ``op``."""
  return tuple(_REGISTRY[op])


def set_auto_hook(fn: Callable[[Sequence[str]], bool] | None) -> None:
  """Sets the predicate ``fn(axes) -> bool`` that makes backend="auto" choose "fused".

  The fused module sets it when its engine is initialised (and clears it with None on
  shutdown); ``axes`` is the op's tuple of mesh axis names.
  """
  global _auto_hook
  _auto_hook = fn


def resolve(op: str, backend: str, axes: Sequence[str]) -> tuple[str, Callable[..., Any]]:
  """Returns (name, implementation) of the backend that runs ``op`` over ``axes``.

  Raises:
    ValueError: unknown ``backend``, or a backend not registered for ``op``.
  """
  if not isinstance(backend, str):
    raise TypeError(f"backend must be a str, one of {BACKENDS}, got {backend!r}")
  impls = _REGISTRY[op]
  if backend == "auto":
    if "fused" in impls and _auto_hook is not None and _auto_hook(tuple(axes)):
      return "fused", impls["fused"]
    return "xla", impls["xla"]
  if backend not in impls:
    if backend == "fused":
      raise ValueError(
          "backend='fused' is not available: call jcoccl.init(mesh) first (it registers "
          "the fused engine), or use backend='xla' or 'auto'")
    raise ValueError(
        f"backend must be one of {sorted(set(BACKENDS) | set(impls))}, got {backend!r}")
  return backend, impls[backend]

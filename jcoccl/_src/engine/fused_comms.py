"""The fused backend's communicators: init / shutdown, the mesh-keyed state, communicator ids.

The fused backend runs each compressed collective as ONE XLA custom call of jcoccl's engine.

The engine (cuda/engine/) runs the same algorithms as the "xla" backend (encode, move the
uint8 payloads, decode_sum as an f32 left fold over source ranks in rank order, cast once)
inside a single custom call, over jcoccl's own communicators:

  CPU  an in-process host transport: XLA runs each CPU device's program on its own thread,
       and the ranks of a group meet in a rendezvous keyed by the FFI RunId and a per-rank
       op counter (every device issues collectives in the same order).
  GPU  NCCL (libnccl.so.2 opened with dlopen), one communicator per mesh axis tuple, with
       encode / communicate / decode on three CUDA streams ordered by per-slice events.

Results are bit-identical to backend="xla" for the same compressor, algorithm and chunks,
because the slicing and padding come from the same row layout (:mod:`jcoccl._src.compressors.layout`)
and the codecs are the same native kernels.

Lifecycle: :func:`init` creates communicators for every ordered tuple of the mesh's axes
(nothing is ever created inside a running collective) and registers the backend;
:func:`shutdown` destroys them. Communicators belong to the devices of that mesh in its
order: a shard_map over a mesh with other devices, or the same devices in another order,
cannot use them (its ranks would differ), even with the same axis names and sizes.

What the engine runs is decided by one predicate, :func:`unsupported`, at trace time:
``backend="auto"`` picks "fused" when it returns None and "xla" otherwise, and
``backend="fused"`` raises ValueError with its reason.

The backend in three modules: this one (communicators, and the one call over the
communicator of a shard_map's axes), :mod:`jcoccl._src.engine.fused_ffi` (the custom call, its
attributes, the codes and the timeout the engine reads) and :mod:`jcoccl._src.engine.fused_ops`
(what each collective lays out and calls).

Example:
  >>> import jax, jcoccl
  >>> mesh = jax.make_mesh((8,), ("data",))  # doctest: +SKIP
  >>> jcoccl.init(mesh)                      # doctest: +SKIP
  >>> # inside jax.shard_map over mesh:
  >>> # y = jcoccl.all_reduce(x, "data", compressor="int8", backend="fused", min_bytes=0)
  >>> jcoccl.shutdown()                      # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import threading
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jcoccl._src import _compat
from jcoccl._src.base.axes import canonical_axes, group_size
from jcoccl._src.engine import fused_ffi as F
from jcoccl._src.engine import fused_ops
from jcoccl._src.native import _backend, _ffi


@dataclasses.dataclass
class _State:
  mesh: Any
  key: tuple  # _mesh_key(mesh): names, shape, device ids in order
  platform: str  # "cpu" or "cuda"
  comms: dict[tuple[str, ...], int]  # axes tuple -> communicator id


_lock = threading.Lock()
_state: _State | None = None
_generation = itertools.count(1)


# ----------------------------------------------------------------------------------------
# Lifecycle.


def init(mesh: Any, *, axes: Sequence[Any] | None = None) -> None:
  """Creates jcoccl's communicators for ``mesh`` and enables backend="fused".

  One communicator per ordered tuple of distinct mesh axes (e.g. for axes (a, b): (a,),
  (b,), (a, b), (b, a)); a collective over ``axis_name`` uses the one for that tuple. On CPU
  they are in-process host groups; on GPU NCCL communicators (one process driving all GPUs,
  or one process per GPU under ``jax.distributed``, where the NCCL unique ids travel through
  jax.distributed's key-value store). Calling init again replaces the previous state.

  The communicators serve shard_maps over this mesh only: the same devices in the same
  order (a mesh with the same axis names and sizes over other devices, or a permutation of
  these, has other ranks and groups). There, backend="auto" runs "xla" and "fused" raises.

  Args:
    mesh: a ``jax.sharding.Mesh`` (the one the shard_map programs use).
    axes: optional list of axis tuples to create instead of all of them (names or tuples).

  Raises:
    RuntimeError: the native engine for the mesh's platform is missing, or NCCL failed.
    ValueError: ``axes`` names something that is not an axis of ``mesh``, or
      ``JCOCCL_TIMEOUT_S`` is invalid (see :func:`jcoccl._src.engine.fused_ffi.timeout_seconds`).

  Example:
    >>> jcoccl.init(jax.make_mesh((8,), ("data",)))  # doctest: +SKIP
  """
  global _state
  F.timeout_seconds()  # a bad JCOCCL_TIMEOUT_S fails here, not in the first collective
  names = tuple(mesh.axis_names)
  platform = _platform_of(mesh)
  tuples = _axis_tuples(names, axes)
  shutdown()
  generation = next(_generation)
  comms: dict[tuple[str, ...], int] = {}
  try:
    for t in tuples:
      cid = _comm_id(platform, mesh, t)
      comms[t] = cid
      groups = _groups(mesh, t)
      if platform == "cpu":
        _create_host(cid, groups)
      else:
        _create_nccl(cid, groups, generation)
  except Exception:
    for cid in comms.values():
      _destroy(platform, cid)
    raise
  with _lock:
    _state = _State(mesh, _mesh_key(mesh), platform, comms)
  impls = fused_ops.implementations(collective_call)
  for op in _backend.OPS:
    _backend.register("fused", op, impls[op])
  _backend.set_fused_check(unsupported)


def shutdown() -> None:
  """Destroys every communicator made by :func:`init`; backend="auto" goes back to "xla".

  Safe to call when not initialised. Programs compiled while initialised fail (with an
  error, never a hang) if run after shutdown; one still running when it is called fails at
  once if a rank is waiting for its peers (wait for results you need before shutting down).
  """
  global _state
  with _lock:
    st, _state = _state, None
  _backend.set_fused_check(None)
  for op in _backend.OPS:
    _backend.unregister("fused", op)
  if st is not None:
    for cid in st.comms.values():
      _destroy(st.platform, cid)


def is_initialized(axes: Sequence[str] | None = None) -> bool:
  """True if :func:`init` ran (and, given ``axes``, made a communicator for that tuple)."""
  st = _state
  if st is None:
    return False
  return axes is None or tuple(axes) in st.comms


def unsupported(
  op: str, axes: tuple[str, ...], *, compressor: Any, dtype: Any, algorithm: str | None = None
) -> str | None:
  """Why the fused engine cannot run this collective, or None when it can.

  The one predicate behind backend selection (called at trace time, inside shard_map):
  backend="auto" runs "xla" whenever it returns a reason, backend="fused" raises
  ValueError with it. The engine needs: :func:`init` with the mesh of the enclosing
  shard_map (same devices in the same order), communicators for the op's axes (for
  "hierarchical", for the inner and outer levels), a float32/bfloat16/float16 ``dtype``,
  and compressors with a native round-to-nearest kernel (no stochastic rounding, no
  hadamard around a hadamard).

  Args:
    op: one of all_reduce, all_gather, reduce_scatter, all_to_all, ppermute.
    axes: the op's tuple of mesh axis names.
    compressor: a Compressor, or the pair (outer, inner) of a hierarchical all_reduce
      (either may be None: the identity codec).
    dtype: the element type of the message.
    algorithm: all_reduce only: one_shot, two_shot or hierarchical.

  Returns:
    None, or a sentence naming the argument that rules the fused engine out.

  Example:
    >>> unsupported("all_gather", ("x",), compressor=jc.int8(), dtype=jnp.float32)  # doctest: +SKIP
  """
  del op
  return (
    _mesh_reason(axes)
    or _comms_reason(axes, algorithm)
    or F.dtype_reason(dtype)
    or F.compressor_reason(compressor)
  )


def _mesh_key(mesh: Any) -> tuple:
  """What identifies a mesh's communicators: axis names, shape, device ids in mesh order."""
  return (
    tuple(mesh.axis_names),
    tuple(mesh.devices.shape),
    tuple(int(d.id) for d in mesh.devices.flat),
  )


def _mesh_reason(axes: tuple[str, ...]) -> str | None:
  st = _state
  if st is None:
    return (
      "backend='fused' needs jcoccl.init(mesh) with the mesh of this shard_map first "
      "(or use backend='xla' / 'auto')"
    )
  mesh = _compat.shard_map_mesh()
  if mesh is None and not _compat.lowering_collective():
    # Under jit the devices are known only when the program is lowered, where this check
    # runs again (jcoccl._src.native._backend.at_lowering); the axis names and sizes match now.
    seen = _compat.context_abstract_mesh()
    if _compat.same_axes(st.mesh, seen):
      return None
    if seen is not None:
      return (
        f"backend='fused': this shard_map's mesh (axes {dict(zip(seen.axis_names, seen.axis_sizes))}) "
        f"is not the mesh given to jcoccl.init ({_describe(st.mesh)}); call jcoccl.init "
        "with this shard_map's mesh (or use backend='xla' / 'auto')"
      )
  if mesh is None:
    return (
      f"backend='fused' cannot tell which devices the collective over {axes} runs on: "
      "call it inside jax.shard_map with a concrete jax.sharding.Mesh (or one set with "
      "jax.set_mesh), or use backend='xla' / 'auto'"
    )
  if _mesh_key(mesh) != st.key:
    return (
      f"backend='fused': this shard_map's mesh ({_describe(mesh)}) is not the mesh "
      f"given to jcoccl.init ({_describe(st.mesh)}); communicators belong to the "
      "devices in mesh order, so call jcoccl.init with this shard_map's mesh (or use "
      "backend='xla' / 'auto')"
    )
  return None


def _lowered_mesh_reason(mesh: Any, key: tuple) -> str | None:
  """The compile-time check of :func:`_compat.mesh_guard` around every fused call: the
  program must run on the devices, in order, of the mesh whose communicators it names."""
  if mesh is not None and _mesh_key(mesh) == key:
    return None
  where = "no concrete mesh" if mesh is None else f"a mesh with {_describe(mesh)}"
  names, shape, ids = key
  return (
    f"backend='fused': this program was traced for the mesh given to jcoccl.init "
    f"(axes {dict(zip(names, shape))}, device ids {list(ids)}) but is compiled for "
    f"{where}, whose ranks differ. This happens when a traced function (an inner "
    "jax.jit, a scan body) is reused under a shard_map over other devices with the "
    "same axis names and sizes: call jcoccl.init with that mesh, or use "
    "backend='xla' for one of them"
  )


def _describe(mesh: Any) -> str:
  shape = dict(zip(mesh.axis_names, mesh.devices.shape))
  return f"axes {shape}, device ids {[int(d.id) for d in mesh.devices.flat]}"


def _comms_reason(axes: tuple[str, ...], algorithm: str | None) -> str | None:
  st = _state
  if st is None:
    return "the fused backend is not initialized: call jcoccl.init(mesh) first"
  need = [axes[-1:], axes[:-1]] if algorithm == "hierarchical" and len(axes) > 1 else [axes]
  missing = [t for t in need if t not in st.comms]
  if missing:
    return (
      f"backend='fused' has no communicator for axes {missing[0]}: jcoccl.init(mesh, "
      "axes=...) did not create it (or use backend='xla' / 'auto')"
    )
  return None


def _platform_of(mesh: Any) -> str:
  plats = {d.platform for d in mesh.devices.flat}
  if len(plats) != 1:
    raise ValueError(f"mesh must hold devices of one platform, got {sorted(plats)}")
  p = plats.pop()
  if p == "cpu":
    others = sorted({d.process_index for d in mesh.devices.flat} - {jax.process_index()})
    if others:
      # The CPU engine's host transport meets ranks inside one process's memory.
      raise ValueError(
        f"the fused engine on CPU runs within one process, but mesh holds devices of "
        f"processes {others} too; across CPU processes use backend='xla' (the default "
        f"'auto' does) or a mesh of this process's devices"
      )
    if _ffi.native_module("cpu") is None:
      raise RuntimeError(f"the fused engine needs jcoccl._cpu: {_ffi.unavailable_reason('cpu')}")
    return "cpu"
  if p in ("gpu", "cuda"):
    if _ffi.native_module("cuda") is None:
      raise RuntimeError(
        "the fused engine on GPU needs jcoccl._cuda (build with "
        f"JCOCCL_CUDA=ON): {_ffi.unavailable_reason('cuda')}"
      )
    return "cuda"
  raise ValueError(f"mesh platform must be cpu or gpu for the fused engine, got {p!r}")


def _axis_tuples(names: tuple[str, ...], axes: Sequence[Any] | None) -> list[tuple[str, ...]]:
  if axes is None:
    return [t for r in range(1, len(names) + 1) for t in itertools.permutations(names, r)]
  out = []
  for a in axes:
    t = canonical_axes(a)
    bad = [x for x in t if x not in names]
    if bad:
      raise ValueError(f"axes: {bad} are not axes of the mesh {names}")
    out.append(t)
  return out


def _comm_id(platform: str, mesh: Any, axes: tuple[str, ...]) -> int:
  """A communicator id fixed by (platform, mesh devices, axes): programs compiled before a
  shutdown() + init() of the same mesh keep finding their communicators."""
  ident = repr(
    (
      platform,
      tuple(mesh.axis_names),
      mesh.devices.shape,
      tuple(int(d.id) for d in mesh.devices.flat),
      axes,
    )
  )
  return int.from_bytes(hashlib.sha256(ident.encode()).digest()[:8], "little") >> 1


def _groups(mesh: Any, axes: tuple[str, ...]) -> list[list[Any]]:
  """Device groups of ``axes``: rank = linear index over ``axes`` (as lax.axis_index)."""
  names = list(mesh.axis_names)
  rest = [i for i, n in enumerate(names) if n not in axes]
  order = rest + [names.index(a) for a in axes]
  devs = np.transpose(mesh.devices, order)
  size = int(np.prod([mesh.devices.shape[names.index(a)] for a in axes]))
  return [list(row) for row in devs.reshape(-1, size)]


def _ordinal(d: Any) -> int:
  """The FFI DeviceOrdinal of device ``d`` (its index among this process's devices)."""
  hw = getattr(d, "local_hardware_id", None)
  return int(hw) if hw is not None else int(d.id)


def _create_host(cid: int, groups: list[list[Any]]) -> None:
  mod = _ffi.require_module("cpu")
  for g in groups:
    mod.fused_host_comm_create(cid, [_ordinal(d) for d in g])


def _create_nccl(cid: int, groups: list[list[Any]], generation: int) -> None:
  """One NCCL communicator per group; ids shared through jax.distributed when multi-process."""
  mod = _ffi.require_module("cuda")
  me = jax.process_index()
  multi = jax.process_count() > 1
  for gi, g in enumerate(groups):
    local = [(r, d) for r, d in enumerate(g) if d.process_index == me]
    if not local:
      continue
    key = f"jcoccl/nccl/{cid}/{gi}/{generation}"
    if not multi:
      uid = mod.nccl_unique_id()
    elif g[0].process_index == me:
      uid = mod.nccl_unique_id()
      _compat.kv_set(key, uid.hex())
    else:
      # The key-value store takes a 32-bit millisecond count.
      wait_ms = min(int(1000 * F.timeout_seconds()), 2**31 - 1)
      uid = bytes.fromhex(_compat.kv_get(key, timeout_ms=wait_ms))
    mod.nccl_comm_init(cid, uid, len(g), [(_ordinal(d), r) for r, d in local])


def _destroy(platform: str, cid: int) -> None:
  mod = _ffi.native_module(platform)
  if mod is not None:
    mod.fused_comm_destroy(cid)


# ----------------------------------------------------------------------------------------
# The call over a shard_map's communicator.


def _comm(axes: tuple[str, ...]) -> tuple[_State, int]:
  """The state and communicator id for ``axes`` of the shard_map being traced."""
  # While a collective primitive is lowered, the mesh check is the mesh guard's (with the
  # message for a trace reused on other devices); at trace time it is _mesh_reason's.
  mesh_reason = None if _compat.lowering_collective() else _mesh_reason(axes)
  reason = mesh_reason or _comms_reason(axes, None)
  if reason is not None or _state is None:
    raise ValueError(reason)
  return _state, _state.comms[axes]


def collective_call(
  op: str,
  algo: str,
  x: jax.Array,
  out_shape: tuple[int, ...],
  axes: tuple,
  compressor: Any,
  k: int,
  m: int,
  *,
  reduces: bool,
  outer: Any = None,
  perm: np.ndarray | None = None,
) -> jax.Array:
  """:func:`jcoccl._src.engine.fused_ffi.engine_call` over the communicator of mesh ``axes``
  inside shard_map (for "hierarchical", the inner and outer levels' communicators).

  Args:
    op, algo, x, out_shape, compressor, k, m: as for engine_call.
    axes: the collective's mesh axes.
    reduces: the result is invariant over ``axes`` (a sum), else varying.
    outer: hierarchical only: the outer level's compressor.
    perm: ppermute only: destination of each rank, or -1.

  Returns:
    The engine's output.
  """
  kw: dict[str, Any] = {}
  if algo == "hierarchical":  # the inner and outer levels' communicators, not axes'
    st, cid = _comm(axes[-1:])
    _, kw["outer_comm"] = _comm(axes[:-1])
    n, kw["outer_size"] = group_size(axes[-1:]), group_size(axes[:-1])
    kw["outer"] = outer
  else:
    st, cid = _comm(axes)
    n = group_size(axes)
  x = _compat.mesh_guard(x, st.key, _lowered_mesh_reason)
  vma = None
  if _compat.check_vma_enabled():
    vin = _compat.varying_axes(x)
    vma = (vin - set(axes)) if reduces else (vin | set(axes))
  return F.engine_call(
    op, algo, x, out_shape, cid, n, compressor, k, m, platform=st.platform, perm=perm, vma=vma, **kw
  )

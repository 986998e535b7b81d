"""The fused backend: each compressed collective is ONE XLA custom call run by jcoccl's engine.

The engine (cuda/engine/) runs the same algorithms as the "xla" backend (encode, move the
uint8 payloads, decode_sum as an f32 left fold over source ranks in rank order, cast once)
inside a single custom call, over jcoccl's own communicators:

  CPU  an in-process host transport: XLA runs each CPU device's program on its own thread,
       and the ranks of a group meet in a rendezvous keyed by the FFI RunId and a per-rank
       op counter (every device issues collectives in the same order).
  GPU  NCCL (libnccl.so.2 opened with dlopen), one communicator per mesh axis tuple, with
       encode / communicate / decode on three CUDA streams ordered by per-slice events.

Results are bit-identical to backend="xla" for the same compressor, algorithm and chunks,
because the slicing and padding come from the same row layout (:mod:`jcoccl._src.layout`)
and the codecs are the same native kernels.

Lifecycle: :func:`init` creates communicators for every ordered tuple of the mesh's axes
(nothing is ever created inside a running collective) and registers the backend;
:func:`shutdown` destroys them. Communicators belong to the devices of that mesh in its
order: a shard_map over a mesh with other devices, or the same devices in another order,
cannot use them (its ranks would differ), even with the same axis names and sizes.

What the engine runs is decided by one predicate, :func:`unsupported`, at trace time:
``backend="auto"`` picks "fused" when it returns None and "xla" otherwise, and
``backend="fused"`` raises ValueError with its reason.

Environment:
  JCOCCL_TIMEOUT_S  seconds a rank waits for its peers before the collective fails with an
                    exception: a positive number (default 300); "inf" or any value above
                    1e8 s (about 3 years) means no practical limit and is clamped to 1e8.
                    Anything else (0, negatives, nan, text) is rejected: by :func:`init` and
                    :func:`timeout_seconds` with ValueError, by a running fused call with an
                    error. On timeout the communicator is marked broken (NCCL: aborted);
                    call :func:`shutdown` and :func:`init` again.
  JCOCCL_NCCL_WAIT  GPU only. "1" (default): each fused call waits for its NCCL work while
                    polling ncclCommGetAsyncError, so a lost peer fails the call after
                    JCOCCL_TIMEOUT_S instead of hanging the stream. "0": return once the work
                    is enqueued (fully asynchronous; no hang protection).

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
import math
import os
import re
import threading
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jcoccl._src import _backend
from jcoccl._src import _common as C
from jcoccl._src import _compat
from jcoccl._src import _ffi
from jcoccl._src import layout as L

# algo -> engine::Op name (cuda/engine/engine.h; values from the native module).
_OP = {"one_shot": "all_reduce_one_shot", "two_shot": "all_reduce_two_shot",
       "hierarchical": "all_reduce_hierarchical", "reduce_scatter": "reduce_scatter",
       "all_gather": "all_gather", "all_to_all": "all_to_all", "ppermute": "ppermute"}
# algo="plain": the transport's own uncompressed collective (on GPU ncclAllReduce /
# ncclReduceScatter with ncclSum on float32, ncclAllGather), the baseline for benchmarks.
_PLAIN_OP = {"all_reduce": "plain_all_reduce", "reduce_scatter": "plain_reduce_scatter",
             "all_gather": "plain_all_gather"}
_TARGET = {"all_reduce": "jcoccl_fused_all_reduce", "reduce_scatter": "jcoccl_fused_reduce_scatter",
           "all_gather": "jcoccl_fused_all_gather", "all_to_all": "jcoccl_fused_all_to_all",
           "ppermute": "jcoccl_fused_ppermute"}
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_ENV_TIMEOUT = "JCOCCL_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0
MAX_TIMEOUT_S = 1e8  # "no limit": larger values (inf too) are clamped, as in the engine
# What the engine accepts (cuda/transport/transport.h, ParseTimeoutSeconds): a decimal
# number, or inf / infinity; blanks around it allowed.
_TIMEOUT_RE = re.compile(r"\s*\+?(?:(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|inf|infinity)\s*",
                         re.IGNORECASE | re.ASCII)
_NONE_ATTRS = {"kind": np.int32(0), "bits": np.int32(8), "block": np.int32(1),
               "symmetric": np.int32(1), "fp8": np.int32(0), "cast_dtype": np.int32(1),
               "hadamard": np.int32(0), "abs_error": np.float32(0.0)}


@dataclasses.dataclass
class _State:
  mesh: Any
  key: tuple                           # _mesh_key(mesh): names, shape, device ids in order
  platform: str                        # "cpu" or "cuda"
  comms: dict[tuple[str, ...], int]    # axes tuple -> communicator id


_lock = threading.Lock()
_state: _State | None = None
_generation = itertools.count(1)


# ----------------------------------------------------------------------------------------
# Lifecycle.

def timeout_seconds() -> float:
  """Seconds a fused collective waits for its peers: ``JCOCCL_TIMEOUT_S``, read now.

  Unset or empty means 300. Accepted: a positive decimal number of seconds, or ``inf``
  (no limit); values above 1e8 s (about 3 years) are clamped to 1e8. The native engine
  parses the variable the same way at the start of every fused call.

  Returns:
    The timeout in seconds, in (0, 1e8].

  Raises:
    ValueError: the variable holds anything else (0, a negative number, nan, text).

  Example:
    >>> import os; os.environ["JCOCCL_TIMEOUT_S"] = "inf"   # doctest: +SKIP
    >>> timeout_seconds()                                    # doctest: +SKIP
    100000000.0
  """
  text = os.environ.get(_ENV_TIMEOUT, "")
  if text == "":
    return DEFAULT_TIMEOUT_S
  value = float(text) if _TIMEOUT_RE.fullmatch(text) else math.nan
  if not value > 0:
    raise ValueError(f"{_ENV_TIMEOUT} must be a positive number of seconds, or inf for no "
                     f"limit (clamped to {MAX_TIMEOUT_S:g} s); got {text!r}")
  return min(value, MAX_TIMEOUT_S)


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
      ``JCOCCL_TIMEOUT_S`` is invalid (see :func:`timeout_seconds`).

  Example:
    >>> jcoccl.init(jax.make_mesh((8,), ("data",)))  # doctest: +SKIP
  """
  global _state
  timeout_seconds()  # a bad JCOCCL_TIMEOUT_S fails here, not in the first collective
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
  for op in _backend.OPS:
    _backend.register("fused", op, _IMPLS[op])
  _backend.set_fused_check(unsupported)


def shutdown() -> None:
  """Destroys every communicator made by :func:`init`; backend="auto" goes back to "xla".

  Safe to call when not initialised. Programs compiled while initialised fail (with an
  error, never a hang) if run after shutdown.
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


def unsupported(op: str, axes: tuple[str, ...], *, compressor: Any, dtype: Any,
                algorithm: str | None = None) -> str | None:
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
  return (_mesh_reason(axes) or _comms_reason(axes, algorithm) or _dtype_reason(dtype)
          or _compressor_reason(compressor))


def _mesh_key(mesh: Any) -> tuple:
  """What identifies a mesh's communicators: axis names, shape, device ids in mesh order."""
  return (tuple(mesh.axis_names), tuple(mesh.devices.shape),
          tuple(int(d.id) for d in mesh.devices.flat))


def _mesh_reason(axes: tuple[str, ...]) -> str | None:
  st = _state
  if st is None:
    return ("backend='fused' needs jcoccl.init(mesh) with the mesh of this shard_map first "
            "(or use backend='xla' / 'auto')")
  mesh = _compat.shard_map_mesh()
  if mesh is None:
    return (f"backend='fused' cannot tell which devices the collective over {axes} runs on: "
            "call it inside jax.shard_map with a concrete jax.sharding.Mesh (or one set with "
            "jax.set_mesh), or use backend='xla' / 'auto'")
  if _mesh_key(mesh) != st.key:
    return (f"backend='fused': this shard_map's mesh ({_describe(mesh)}) is not the mesh "
            f"given to jcoccl.init ({_describe(st.mesh)}); communicators belong to the "
            "devices in mesh order, so call jcoccl.init with this shard_map's mesh (or use "
            "backend='xla' / 'auto')")
  return None


def _lowered_mesh_reason(mesh: Any, key: tuple) -> str | None:
  """The compile-time check of :func:`_compat.mesh_guard` around every fused call: the
  program must run on the devices, in order, of the mesh whose communicators it names."""
  if mesh is not None and _mesh_key(mesh) == key:
    return None
  where = "no concrete mesh" if mesh is None else f"a mesh with {_describe(mesh)}"
  names, shape, ids = key
  return (f"backend='fused': this program was traced for the mesh given to jcoccl.init "
          f"(axes {dict(zip(names, shape))}, device ids {list(ids)}) but is compiled for "
          f"{where}, whose ranks differ. This happens when a traced function (an inner "
          "jax.jit, a scan body) is reused under a shard_map over other devices with the "
          "same axis names and sizes: call jcoccl.init with that mesh, or use "
          "backend='xla' for one of them")


def _describe(mesh: Any) -> str:
  shape = dict(zip(mesh.axis_names, mesh.devices.shape))
  return f"axes {shape}, device ids {[int(d.id) for d in mesh.devices.flat]}"


def _comms_reason(axes: tuple[str, ...], algorithm: str | None) -> str | None:
  st = _state
  need = [axes[-1:], axes[:-1]] if algorithm == "hierarchical" and len(axes) > 1 else [axes]
  missing = [t for t in need if t not in st.comms]
  if missing:
    return (f"backend='fused' has no communicator for axes {missing[0]}: jcoccl.init(mesh, "
            "axes=...) did not create it (or use backend='xla' / 'auto')")
  return None


def _dtype_reason(dtype: Any) -> str | None:
  if jnp.dtype(dtype) not in _DTYPES:
    return (f"backend='fused' accepts x of dtype float32, bfloat16 or float16, got "
            f"{jnp.dtype(dtype).name} (use backend='xla' / 'auto')")
  return None


def _compressor_reason(compressor: Any) -> str | None:
  from jcoccl._src.compressors import native
  for c in compressor if isinstance(compressor, tuple) else (compressor,):
    if c is None:
      continue
    parts = [c] + ([c.inner] if getattr(c, "kind", None) == "hadamard" else [])
    if any(getattr(p, "stochastic", False) or getattr(p, "rounding", "nearest") != "nearest"
           for p in parts):
      return (f"compressor {c}: the fused backend implements round-to-nearest only; use "
              "backend='xla' (or 'auto') for stochastic rounding")
    if not native._supported(c):
      return (f"compressor {c} has no native kernel for the fused backend (native: none, "
              "cast, int2/4/8 and fp8 and error_bounded with power-of-two blocks of 32 to "
              "4096, and one hadamard around one of those); use backend='xla' (or 'auto')")
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
          f"'auto' does) or a mesh of this process's devices")
    if _ffi.native_module("cpu") is None:
      raise RuntimeError(f"the fused engine needs jcoccl._cpu: {_ffi.native_import_error('cpu')}")
    return "cpu"
  if p in ("gpu", "cuda"):
    if _ffi.native_module("cuda") is None:
      raise RuntimeError("the fused engine on GPU needs jcoccl._cuda (build with "
                         f"JCOCCL_CUDA=ON): {_ffi.native_import_error('cuda')}")
    return "cuda"
  raise ValueError(f"mesh platform must be cpu or gpu for the fused engine, got {p!r}")


def _axis_tuples(names: tuple[str, ...], axes: Sequence[Any] | None) -> list[tuple[str, ...]]:
  if axes is None:
    return [t for r in range(1, len(names) + 1) for t in itertools.permutations(names, r)]
  out = []
  for a in axes:
    t = C.canonical_axes(a)
    bad = [x for x in t if x not in names]
    if bad:
      raise ValueError(f"axes: {bad} are not axes of the mesh {names}")
    out.append(t)
  return out


def _comm_id(platform: str, mesh: Any, axes: tuple[str, ...]) -> int:
  """A communicator id fixed by (platform, mesh devices, axes): programs compiled before a
  shutdown() + init() of the same mesh keep finding their communicators."""
  ident = repr((platform, tuple(mesh.axis_names), mesh.devices.shape,
                tuple(int(d.id) for d in mesh.devices.flat), axes))
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
  mod = _ffi.native_module("cpu")
  for g in groups:
    mod.fused_host_comm_create(cid, [_ordinal(d) for d in g])


def _create_nccl(cid: int, groups: list[list[Any]], generation: int) -> None:
  """One NCCL communicator per group; ids shared through jax.distributed when multi-process."""
  mod = _ffi.native_module("cuda")
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
      wait_ms = min(int(1000 * timeout_seconds()), 2**31 - 1)
      uid = bytes.fromhex(_compat.kv_get(key, timeout_ms=wait_ms))
    mod.nccl_comm_init(cid, uid, len(g), [(_ordinal(d), r) for r, d in local])


def _destroy(platform: str, cid: int) -> None:
  mod = _ffi.native_module(platform)
  if mod is not None:
    mod.fused_comm_destroy(cid)


# ----------------------------------------------------------------------------------------
# One custom call.

def _codec_attrs(c: Any, prefix: str = "") -> dict[str, Any]:
  from jcoccl._src.compressors import native
  if c is None:
    attrs = dict(_NONE_ATTRS)
  else:
    reason = _compressor_reason(c)
    if reason is not None:
      raise ValueError(reason)
    attrs = native.codec_attrs(c)
  return {prefix + k: v for k, v in attrs.items()}


def _comm(axes: tuple[str, ...]) -> tuple[_State, int]:
  """The state and communicator id for ``axes`` of the shard_map being traced."""
  # While a collective primitive is lowered, the mesh check is the mesh guard's (with the
  # message for a trace reused on other devices); at trace time it is _mesh_reason's.
  mesh_reason = None if _compat.lowering_collective() else _mesh_reason(axes)
  reason = mesh_reason or _comms_reason(axes, None)
  if reason is not None:
    raise ValueError(reason)
  return _state, _state.comms[axes]


def engine_call(op: str, algo: str, x: jax.Array, out_shape: tuple[int, ...], comm: int,
                n: int, compressor: Any, k: int, m: int, *, platform: str, outer: Any = None,
                outer_comm: int = -1, outer_size: int = 0, perm: np.ndarray | None = None,
                vma: frozenset | None = None) -> jax.Array:
  """Binds one fused custom call over communicator id ``comm`` (``n`` ranks here).

  The low-level entry point under the backend implementations; the GPU scripts use it to
  drive communicators they created themselves. Shapes follow cuda/engine/engine.h ("Call").

  Args:
    op: collective name (picks the target "jcoccl_fused_<op>").
    algo: engine algorithm: one_shot, two_shot, hierarchical, reduce_scatter, all_gather,
      all_to_all or ppermute; or "plain" (op all_reduce, reduce_scatter or all_gather): the
      transport's own uncompressed collective with ``compressor=None`` (NCCL's on GPU; on
      CPU the host transport's, whose sums are the float32 left fold in rank order).
      Plain all_reduce / reduce_scatter take float32 only.
    x: input laid out as the engine expects ([k, m] or [k, n, m]).
    out_shape: output shape.
    comm: communicator id (inner one for hierarchical).
    n: ranks of ``comm``.
    compressor: Compressor (or None for the identity codec).
    k: slices; m: row length of a slice (multiple of the granule).
    platform: "cpu" or "cuda".
    outer, outer_comm, outer_size: hierarchical only.
    perm: ppermute only: destination of each rank, or -1.
    vma: varying manual axes of the result (inside shard_map with check_vma), else None.

  Returns:
    The output array (the workspace output is dropped).

  Example:
    >>> y = engine_call("all_reduce", "one_shot", x2d, x2d.shape, cid, 2, jc.int8(),
    ...                 1, 256, platform="cuda")  # doctest: +SKIP
    >>> base = engine_call("all_reduce", "plain", x2d, x2d.shape, cid, 2, None,
    ...                    1, 256, platform="cuda")  # doctest: +SKIP
  """
  timeout_seconds()  # fail at trace time, not in the running collective
  dtype = jnp.dtype(x.dtype)
  if dtype not in _DTYPES:
    raise TypeError(f"the fused backend accepts float32, bfloat16 or float16, got {dtype.name}")
  code = _op_code(op, algo, compressor, dtype)
  attrs: dict[str, Any] = dict(op=np.int32(code), k=np.int64(k), m=np.int64(m),
                               comm=np.int64(comm), outer_comm=np.int64(outer_comm),
                               perm=np.full((n,), -1, np.int32) if perm is None else perm)
  attrs.update(_codec_attrs(compressor))
  if algo == "hierarchical":
    attrs.update(_codec_attrs(outer, "o_"))
  codec = {k_: v for k_, v in attrs.items() if k_ in _NONE_ATTRS}
  ocodec = {k_: v for k_, v in attrs.items() if k_.startswith("o_")}
  ws = int(_ffi.native_module("cpu").fused_workspace_bytes(
      code, k, m, n, outer_size, codec, ocodec, _ffi.codes("DTYPES")[dtype.name]))
  _ffi.register(platform)
  if vma is None:
    types = (jax.ShapeDtypeStruct(out_shape, dtype), jax.ShapeDtypeStruct((max(ws, 1),), jnp.uint8))
  else:
    types = (_compat.shape_dtype_with_vma(out_shape, dtype, vma),
             _compat.shape_dtype_with_vma((max(ws, 1),), jnp.uint8, vma))
  # Under vmap each batch element is its own collective, issued in the same order everywhere.
  out, _ = jax.ffi.ffi_call(_TARGET[op], types, vmap_method="sequential")(x, **attrs)
  return out


def _op_code(op: str, algo: str, compressor: Any, dtype: Any) -> int:
  """The engine::Op code of (op, algo); checks what the plain ops accept."""
  if op not in _TARGET:
    raise ValueError(f"op must be one of {sorted(_TARGET)}, got {op!r}")
  if algo != "plain":
    if algo not in _OP:
      raise ValueError(f"algo must be one of {sorted(_OP) + ['plain']}, got {algo!r}")
    return _ffi.codes("OPS")[_OP[algo]]
  if op not in _PLAIN_OP:
    raise ValueError(f"algo='plain' needs op all_reduce, reduce_scatter or all_gather, got {op!r}")
  if compressor is not None:
    raise ValueError("algo='plain' is the uncompressed collective: pass compressor=None")
  if op != "all_gather" and dtype != jnp.dtype(jnp.float32):
    raise TypeError(f"algo='plain' {op} sums float32 only, got x of dtype {dtype.name}")
  return _ffi.codes("OPS")[_PLAIN_OP[op]]


def _fused_call(op: str, algo: str, x: jax.Array, out_shape: tuple[int, ...], axes: tuple,
                compressor: Any, k: int, m: int, *, reduces: bool, outer: Any = None,
                perm: np.ndarray | None = None) -> jax.Array:
  """engine_call for a collective over mesh ``axes`` inside shard_map."""
  kw: dict[str, Any] = {}
  if algo == "hierarchical":  # the inner and outer levels' communicators, not axes'
    st, cid = _comm(axes[-1:])
    _, kw["outer_comm"] = _comm(axes[:-1])
    n, kw["outer_size"] = C.group_size(axes[-1:]), C.group_size(axes[:-1])
    kw["outer"] = outer
  else:
    st, cid = _comm(axes)
    n = C.group_size(axes)
  x = _compat.mesh_guard(x, st.key, _lowered_mesh_reason)
  vma = None
  if _compat.check_vma_enabled():
    vin = _compat.varying_axes(x)
    vma = (vin - set(axes)) if reduces else (vin | set(axes))
  return engine_call(op, algo, x, out_shape, cid, n, compressor, k, m, platform=st.platform,
                     perm=perm, vma=vma, **kw)


# ----------------------------------------------------------------------------------------
# Backend implementations (signatures: jcoccl/_src/_backend.py).

def _fused_all_reduce(x: jax.Array, *, axes: tuple, compressor: Any, algorithm: str,
                      chunks: int, key: Any) -> jax.Array:
  del key  # round-to-nearest only (checked in _codec_attrs)
  axes = tuple(axes)
  k = chunks
  xs = L.slice_major(x, k)  # [k, w]
  w = xs.shape[-1]
  if algorithm == "one_shot":
    out = _fused_call("all_reduce", "one_shot", xs, (k, w), axes, compressor, k, w,
                      reduces=True)
  elif algorithm == "two_shot":
    n = C.group_size(axes)
    xs = L.rank_rows(xs, n)  # [k, n, w / n]
    m = xs.shape[-1]
    out = _fused_call("all_reduce", "two_shot", xs, (k, n, m), axes, compressor, k, m,
                      reduces=True)
  elif algorithm == "hierarchical":
    if len(axes) < 2:
      raise ValueError("algorithm='hierarchical' needs a tuple of at least two axes")
    outer, inner = compressor
    n = C.group_size(axes[-1:])
    xs = L.rank_rows(xs, n)
    m = xs.shape[-1]
    out = _fused_call("all_reduce", "hierarchical", xs, (k, n, m), axes, inner, k, m,
                      reduces=True, outer=outer)
  else:
    raise ValueError(f"algorithm must be one_shot, two_shot or hierarchical, got {algorithm!r}")
  return L.from_slice_major(out.reshape(k, -1))


def _fused_reduce_scatter(x: jax.Array, *, axes: tuple, compressor: Any, chunks: int,
                          key: Any) -> jax.Array:
  del key
  k = chunks
  xs = L.slice_major(x, k)  # [k, n, m]
  m = xs.shape[-1]
  out = _fused_call("reduce_scatter", "reduce_scatter", xs, (k, m), tuple(axes), compressor,
                    k, m, reduces=False)
  return L.from_slice_major(out)


def _fused_all_gather(x: jax.Array, *, axes: tuple, compressor: Any, chunks: int,
                      key: Any) -> jax.Array:
  del key
  axes = tuple(axes)
  n = C.group_size(axes)
  k = chunks
  xs = L.slice_major(x, k)  # [k, m]
  m = xs.shape[-1]
  out = _fused_call("all_gather", "all_gather", xs, (k, n, m), axes, compressor, k, m,
                    reduces=False)
  return L.from_slice_major(out)  # [n, k * m]


def _fused_all_to_all(x: jax.Array, *, axes: tuple, compressor: Any, chunks: int,
                      key: Any) -> jax.Array:
  del key
  k = chunks
  xs = L.slice_major(x, k)  # [k, n, m]
  n, m = xs.shape[1:]
  out = _fused_call("all_to_all", "all_to_all", xs, (k, n, m), tuple(axes), compressor, k, m,
                    reduces=False)
  return L.from_slice_major(out)


def _fused_ppermute(x: jax.Array, *, axes: tuple, perm: Sequence[tuple[int, int]],
                    compressor: Any, chunks: int, key: Any) -> jax.Array:
  del key
  axes = tuple(axes)
  n = C.group_size(axes)
  dst = np.full((n,), -1, np.int32)
  for s, d in perm:
    dst[int(s)] = int(d)
  k = chunks
  xs = L.slice_major(x, k)  # [k, m]
  m = xs.shape[-1]
  out = _fused_call("ppermute", "ppermute", xs, (k, m), axes, compressor, k, m,
                    reduces=False, perm=dst)
  return L.from_slice_major(out)


_IMPLS = {"all_reduce": _fused_all_reduce, "reduce_scatter": _fused_reduce_scatter,
          "all_gather": _fused_all_gather, "all_to_all": _fused_all_to_all,
          "ppermute": _fused_ppermute}

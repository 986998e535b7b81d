"""The fused engine's FFI interface: one custom call, its attributes and workspace.

What Python tells the engine (cuda/engine/ffi_call.h, engine.h) and what the engine
accepts: the custom-call targets, the engine::Op and dtype codes (read from the native
module through :func:`jcoccl._src.native._ffi.codes`, never mirrored), a codec's kernel attributes,
the workspace size the engine asks for, and the timeout (the ``timeout_s`` attribute, from
:func:`jcoccl._src.base.config.current`).
:func:`engine_call` binds one call over a communicator id; communicators are
:mod:`jcoccl._src.engine.fused_comms`'s, and what each collective sends through it is
:mod:`jcoccl._src.engine.fused_ops`'s.

Timeout: ``jcoccl.config(timeout_s=...)``, default ``JCOCCL_TIMEOUT_S`` (parsed once, by
:mod:`jcoccl._src.base.config`): seconds a rank waits for its peers before the collective fails
with an exception: a positive number (default 300); "inf" or any value above 1e8 s (about 3
years) means no practical limit and is clamped to 1e8. Anything else (0, negatives, nan,
text) is rejected with ValueError naming the variable. The value travels to the engine as
the call's ``timeout_s`` attribute, captured when the program is traced. On timeout the
communicator is marked broken (NCCL: aborted); call shutdown and init again.

On GPU a fused call returns once its work is enqueued on XLA's stream; each communicator's
watchdog thread polls the calls' completion and ncclCommGetAsyncError, aborts the
communicator when a call waited longer than ``timeout_s`` (a lost peer) or NCCL reports an
error, and the next call on that communicator raises the reason (cuda/transport/nccl.h).

Example:
  >>> op_code("all_reduce", "one_shot", None, jnp.float32) in _ffi.codes("OPS").values()  # doctest: +SKIP
  True
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jcoccl._src import _compat, _env
from jcoccl._src.base import config as _config
from jcoccl._src.native import _ffi

# algo -> engine::Op name (cuda/engine/engine.h; values from the native module).
_OP = {
  "one_shot": "all_reduce_one_shot",
  "two_shot": "all_reduce_two_shot",
  "hierarchical": "all_reduce_hierarchical",
  "reduce_scatter": "reduce_scatter",
  "all_gather": "all_gather",
  "all_to_all": "all_to_all",
  "ppermute": "ppermute",
}
# algo="plain": the transport's own uncompressed collective (on GPU ncclAllReduce /
# ncclReduceScatter with ncclSum on float32, ncclAllGather), the baseline for benchmarks.
_PLAIN_OP = {
  "all_reduce": "plain_all_reduce",
  "reduce_scatter": "plain_reduce_scatter",
  "all_gather": "plain_all_gather",
}
_TARGET = {
  "all_reduce": "jcoccl_fused_all_reduce",
  "reduce_scatter": "jcoccl_fused_reduce_scatter",
  "all_gather": "jcoccl_fused_all_gather",
  "all_to_all": "jcoccl_fused_all_to_all",
  "ppermute": "jcoccl_fused_ppermute",
}
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
DEFAULT_TIMEOUT_S = _env.DEFAULT_TIMEOUT_S
MAX_TIMEOUT_S = _env.MAX_TIMEOUT_S  # "no limit": larger values (inf too) are clamped


def timeout_seconds() -> float:
  """Seconds a fused collective traced now waits for its peers (the current config's
  ``timeout_s``; default ``JCOCCL_TIMEOUT_S``, else 300).

  Raises:
    ValueError: ``JCOCCL_TIMEOUT_S`` holds anything but a positive number or inf.

  Example:
    >>> with jcoccl.config(timeout_s=float("inf")):  # doctest: +SKIP
    ...   timeout_seconds()
    100000000.0
  """
  return _config.current().timeout_s


def dtype_reason(dtype: Any) -> str | None:
  """Why the engine cannot take elements of ``dtype``, or None."""
  if jnp.dtype(dtype) not in DTYPES:
    return (
      f"backend='fused' accepts x of dtype float32, bfloat16 or float16, got "
      f"{jnp.dtype(dtype).name} (use backend='xla' / 'auto')"
    )
  return None


def compressor_reason(compressor: Any) -> str | None:
  """Why the engine cannot run ``compressor`` (a Compressor, None, or an (outer, inner)
  pair), or None."""
  from jcoccl._src.compressors import native

  for c in compressor if isinstance(compressor, tuple) else (compressor,):
    if c is None:
      continue
    parts = [c] + ([c.inner] if getattr(c, "kind", None) == "hadamard" else [])
    if any(
      getattr(p, "stochastic", False) or getattr(p, "rounding", "nearest") != "nearest"
      for p in parts
    ):
      return (
        f"compressor {c}: the fused backend implements round-to-nearest only; use "
        "backend='xla' (or 'auto') for stochastic rounding"
      )
    reason = native.no_kernel_reason(c)
    if reason is not None:
      return (
        f"{reason}; the fused backend runs native kernels only: use backend='xla' (or "
        "'auto'), which runs its jnp definition"
      )
  return None


def codec_attr(c: Any) -> dict[str, Any]:
  """The ``codec`` (or ``outer``) attribute of codec ``c`` (None: the identity codec): its
  descriptor (:func:`jcoccl._src.compressors.native.codec_attrs`).

  Raises:
    ValueError: the engine cannot run ``c`` (see :func:`compressor_reason`).
  """
  from jcoccl._src.compressors import native

  if c is not None:
    reason = compressor_reason(c)
    if reason is not None:
      raise ValueError(reason)
  return native.ffi_codec(c)


def engine_call(
  op: str,
  algo: str,
  x: jax.Array,
  out_shape: tuple[int, ...],
  comm: int,
  n: int,
  compressor: Any,
  k: int,
  m: int,
  *,
  platform: str,
  outer: Any = None,
  outer_comm: int = -1,
  outer_size: int = 0,
  perm: np.ndarray | None = None,
  vma: frozenset | None = None,
) -> jax.Array:
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
  dtype = jnp.dtype(x.dtype)
  if dtype not in DTYPES:
    raise TypeError(f"the fused backend accepts float32, bfloat16 or float16, got {dtype.name}")
  code = op_code(op, algo, compressor, dtype)
  attrs: dict[str, Any] = dict(
    op=np.int32(code),
    k=np.int64(k),
    m=np.int64(m),
    comm=np.int64(comm),
    outer_comm=np.int64(outer_comm),
    timeout_s=np.float64(timeout_seconds()),
    perm=np.full((n,), -1, np.int32) if perm is None else perm,
  )
  attrs["codec"] = codec_attr(compressor)
  if algo == "hierarchical":
    attrs["outer"] = codec_attr(outer)
  ws = workspace_bytes(code, k, m, n, outer_size, attrs["codec"], attrs.get("outer"), dtype)
  _ffi.register(platform)
  if vma is None:
    types = (jax.ShapeDtypeStruct(out_shape, dtype), jax.ShapeDtypeStruct((max(ws, 1),), jnp.uint8))
  else:
    types = (
      _compat.shape_dtype_with_vma(out_shape, dtype, vma),
      _compat.shape_dtype_with_vma((max(ws, 1),), jnp.uint8, vma),
    )
  # Under vmap each batch element is its own collective, issued in the same order everywhere.
  out, _ = jax.ffi.ffi_call(_TARGET[op], types, vmap_method="sequential")(x, **attrs)
  return out


def workspace_bytes(
  code: int,
  k: int,
  m: int,
  n: int,
  outer_size: int,
  codec: dict[str, Any],
  outer: dict[str, Any] | None,
  dtype: Any,
) -> int:
  """Bytes of the workspace the engine needs for one call: the engine's own dry run
  (cuda/engine/ffi_call.h ``FusedWorkspaceBytes``, the sizing the handler checks against),
  asked of the CPU module with the same descriptors the call carries.

  Example:
    >>> workspace_bytes(op_code("all_reduce", "one_shot", None, jnp.float32), 1, 256, 2, 0,
    ...                 codec_attr(jc.int8()), None, jnp.float32) > 0  # doctest: +SKIP
    True
  """
  return int(
    _ffi.require_module("cpu").fused_workspace_bytes(
      code, k, m, n, outer_size, codec, outer, _ffi.codes("DTYPES")[jnp.dtype(dtype).name]
    )
  )


def op_code(op: str, algo: str, compressor: Any, dtype: Any) -> int:
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

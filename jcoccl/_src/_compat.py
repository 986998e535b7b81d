"""Every use of JAX internals (anything outside jax's public API) lives in this module.

When JAX moves an internal, this is the one file to change. Import from here, never
from ``jax._src`` elsewhere in jcoccl.
"""

from __future__ import annotations


# --- collectives: shard_map varying-axes (vma) introspection -------------------------------

import jax as _jax
from jax._src import config as _jax_config


def check_vma_enabled() -> bool:
  """True while tracing inside a ``jax.shard_map(..., check_vma=True)`` body."""
  return bool(_jax_config._check_vma.value)


def varying_axes(x) -> frozenset:
  """The manual mesh axes over which ``x``'s value varies (empty outside check_vma)."""
  aval = _jax.typeof(x)
  mat = getattr(aval, "manual_axis_type", None)
  if mat is None:
    return frozenset(getattr(aval, "vma", frozenset()))
  return frozenset(mat.varying)


# --- fused engine: result types with varying axes; jax.distributed key-value store --------

def shape_dtype_with_vma(shape, dtype, vma) -> "_jax.ShapeDtypeStruct":
  """A ShapeDtypeStruct whose value varies over the manual axes ``vma`` (for ffi_call
  results inside ``shard_map(check_vma=True)``, which do not inherit the inputs' axes)."""
  from jax._src import core as _core
  sharding = _core.get_cur_mesh_sharding(_jax.P(*([None] * len(shape))))
  return _jax.ShapeDtypeStruct(shape, dtype, sharding=sharding,
                               manual_axis_type=_core.ManualAxisType(varying=frozenset(vma)))


def _kv_client():
  from jax._src import distributed as _dist
  client = _dist.global_state.client
  if client is None:
    raise RuntimeError("jax.distributed is not initialised: call jax.distributed.initialize() "
                       "in every process before jcoccl.init(mesh)")
  return client


def kv_set(key: str, value: str) -> None:
  """Stores ``value`` under ``key`` in jax.distributed's key-value store."""
  _kv_client().key_value_set(key, value)


def kv_get(key: str, timeout_ms: int) -> str:
  """Waits (at most ``timeout_ms``) for ``key`` in jax.distributed's key-value store."""
  return _kv_client().blocking_key_value_get(key, timeout_ms)


# --- wire bytes: the device assignment of a compiled program --------------------------------

def executable_device_ids(compiled) -> list[int] | None:
  """Device ids of a ``jax.stages.Compiled`` in logical (partition) order, or None.

  HLO replica groups name logical ids; this maps them to ``jax.Device.id``. Only the
  devices of this process are listed, so multi-process programs return None.
  """
  try:
    devices = compiled.runtime_executable().local_devices()
  except Exception:  # noqa: BLE001 - a backend without the method: caller falls back
    return None
  return [d.id for d in devices]

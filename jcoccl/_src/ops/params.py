"""The collectives' primitive parameters: compressors as spec strings, PRNG keys as raw
operands, and the operands' own values where the operands of one call differ.

Example:
  >>> spec_of(None), leaf_params({"chunks": 1, "axis": PerLeaf((2, 1))}, 1)
  ('none', {'chunks': 1, 'axis': 1})
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jcoccl._src.compressors import registry
from jcoccl._src.compressors.compressor_args import resolve_compressor

# ----------------------------------------------------------------------------------------
# Compressor parameters: spec strings (hashable, readable), "none" for the exact path.


def spec_of(c: Any) -> Any:
  """A compressor (or None, or a per-level pair) as its spec string(s)."""
  if isinstance(c, tuple):
    return tuple(spec_of(x) for x in c)
  return "none" if c is None else str(c)


def load(spec: Any) -> Any:
  """Inverse of :func:`spec_of`: the compressor a spec string names now.

  Cached per spec string until the codec registry changes (a name registered again may
  build another class: the old instance must not be served for it).

  Example:
    >>> load("int8") == load("int8:block=256")
    True
  """
  gen = registry.generation()
  if _LOADED_AT[0] != gen:
    _load.cache_clear()
    _LOADED_AT[0] = gen
  return _load(spec)


_LOADED_AT = [-1]  # the registry generation _load's cache belongs to


@functools.cache
def _load(spec: Any) -> Any:
  if isinstance(spec, tuple):
    return tuple(_load(s) for s in spec)
  return resolve_compressor(spec)


def grad_args(params: dict, **op_args: Any) -> dict:
  """Leaf arguments of the collective a tangent or cotangent goes through.

  Both run with the call's ``grad_compressor`` (for the compressed path too) and the
  backend, chunks and threshold the call was given; ``op_args`` are what the op itself
  needs (its axis arguments, possibly swapped for the dual).

  Args:
    params: the primitive's parameters.
    **op_args: op-specific leaf arguments, added as they are.

  Returns:
    Keyword arguments for the dual's or the op's own ``leaf`` function.

  Example:
    >>> p = dict(axes=("d",), grad_compressor="none", backend_arg="auto", chunks=1,
    ...          min_bytes=None)
    >>> grad_args(p, tiled=True)["compressor"] is None
    True
  """
  gc = load(params["grad_compressor"])
  return dict(
    axes=params["axes"],
    compressor=gc,
    grad_compressor=gc,
    backend=params["backend_arg"],
    chunks=params["chunks"],
    min_bytes=params["min_bytes"],
    **op_args,
  )


# ----------------------------------------------------------------------------------------
# PRNG keys travel as raw key data (primitive operands of a plain dtype).


def key_operand(key: Any) -> tuple[tuple, Any]:
  """(operands, key_type param) for ``key``: None, a raw uint32 key or a typed key."""
  if key is None:
    return (), None
  key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    return (jax.random.key_data(key),), str(jax.random.key_impl(key))
  return (key,), "raw"


def unwrap_key(keys: tuple, key_type: Any) -> Any:
  if key_type is None:
    return None
  if key_type == "raw":
    return keys[0]
  return jax.random.wrap_key_data(keys[0], impl=key_type)


# ----------------------------------------------------------------------------------------
# Parameters of a call's operands: one value where they agree, a PerLeaf where they differ.


@dataclasses.dataclass(frozen=True)
class PerLeaf:
  """A parameter's values operand by operand, where the operands of one call differ in it
  (e.g. a small leaf left uncompressed next to a compressed one). Prints as
  ``per_leaf(int8, none)``; never equal to a plain tuple (a hierarchical compressor pair
  is one).

  Example:
    >>> str(merge_params([dict(chunks=1, compressor="int8"), dict(chunks=1, compressor="none")]))
    "{'chunks': 1, 'compressor': per_leaf(int8, none)}"
  """

  values: tuple

  def __str__(self) -> str:
    return "per_leaf(" + ", ".join(str(v) for v in self.values) + ")"

  __repr__ = __str__


def merge_params(leaves: Sequence[dict]) -> dict:
  """One primitive's parameters from its operands' (all with the same keys)."""
  out = {}
  for k in leaves[0]:
    vals = tuple(p[k] for p in leaves)
    same = all(type(v) is type(vals[0]) and v == vals[0] for v in vals)
    out[k] = vals[0] if same else PerLeaf(vals)
  return out


def leaf_params(params: dict, i: int) -> dict:
  """Operand ``i``'s parameters (inverse of :func:`merge_params`)."""
  return {k: v.values[i] if isinstance(v, PerLeaf) else v for k, v in params.items()}

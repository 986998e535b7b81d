"""Shared helpers for tests/test_collectives*.py: meshes, per-rank inputs, error bounds."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jcoccl import compressors as jc

P = jax.P

# The compressor matrix of the brief, with small blocks so that small arrays span blocks.
LOSSY = {
  "bf16": jc.cast("bfloat16"),
  "int8": jc.int8(block_size=64),
  "int4a": jc.int4(block_size=32, symmetric=False),
  "fp8": jc.fp8("e4m3", block_size=32),
  "had_int4": jc.hadamard(jc.int4(block_size=64)),
  "eb": jc.error_bounded(1e-2, block_size=32),
}
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
# Relative half-ulp of the output dtype (the one final cast of decode_sum).
HALF_ULP = {
  jnp.dtype(jnp.float32): 2.0**-24,
  jnp.dtype(jnp.bfloat16): 2.0**-8,
  jnp.dtype(jnp.float16): 2.0**-11,
}
F32_EPS = 2.0**-24


def mesh(shape: tuple, names: tuple) -> Mesh:
  devs = np.array(jax.devices()[: math.prod(shape)]).reshape(shape)
  return Mesh(devs, names)


def per_rank(m: Mesh, body, x, out_rank: bool = True):
  """Runs ``body(x_local)`` with x's dim 0 (size = #devices) split over every mesh axis.

  The body sees x[r] (leading dim dropped); results come back stacked per rank.
  """
  axes = tuple(m.axis_names)
  spec = P(axes)

  def wrapped(v):
    out = body(jax.tree_util.tree_map(lambda a: a[0], v))
    return jax.tree_util.tree_map(lambda o: o[None], out)

  f = jax.jit(jax.shard_map(wrapped, mesh=m, in_specs=spec, out_specs=spec))
  return f(x)


def rand(shape, dtype, seed=0, scale=1.0):
  x = jax.random.normal(jax.random.key(seed), shape, jnp.float32) * scale
  return x.astype(dtype)


def host_rand(shape, dtype, seed=0, scale=1.0) -> np.ndarray:
  """Normal values in ``dtype`` drawn by numpy, on the host: nothing compiles, whereas rand
  compiles its draw for every new shape, and a device array given to a sharded jit is split
  by a compiled slice (a host array is split by numpy)."""
  x = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32) * np.float32(scale)
  return x.astype(jnp.dtype(dtype))


def f64(x) -> np.ndarray:
  return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def eb(c, x) -> np.ndarray:
  """The compressor's documented per-element bound for x (float64)."""
  return np.asarray(c.error_bound(jnp.asarray(x)), np.float64)


def sum_bound(c, xs, dtype) -> np.ndarray:
  """Bound on |decode_sum(encode(x_r) for r) - sum_r x_r| (inputs stacked on axis 0).

  Sum of each rank's encode bound, plus float32 left-fold rounding (n-1 roundings of
  partial sums bounded by sum |x_r| + eb_r), plus the final cast to ``dtype``.
  """
  n = xs.shape[0]
  per = np.stack([eb(c, xs[r]) for r in range(n)])
  mags = np.abs(f64(xs)) + per
  total = per.sum(0) + (n - 1) * F32_EPS * mags.sum(0)
  exact = np.abs(f64(xs).sum(0))
  tiny = 2.0**-25 if jnp.dtype(dtype) == jnp.dtype(jnp.float16) else 0.0
  return total + HALF_ULP[jnp.dtype(dtype)] * (exact + total) + tiny


def assert_within(got, want, bound, what=""):
  err = np.abs(f64(got) - np.asarray(want, np.float64))
  bad = err > bound
  assert not bad.any(), (
    f"{what}: {bad.sum()} elements out of bound; worst err {err[bad].max()} vs bound "
    f"{np.asarray(bound)[bad].min()}"
  )


def bits(x) -> np.ndarray:
  x = np.asarray(x)
  return x.view(np.uint8)

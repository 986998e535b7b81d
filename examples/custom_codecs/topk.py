"""Top-k sparsification per block (DGC-style), written only in jnp with jcoccl's public API.

Each block of ``block_size`` values keeps its ``k`` largest magnitudes, as float32 values and
uint16 in-block indices; the rest are sent as zero. With error feedback the dropped values
are not lost: each rank adds them to its next step's gradients (Deep Gradient Compression).

Wire format of a row of n values (nb = n / block_size blocks):
  values: float32[nb, k] (little endian), then indices: uint16[nb, k].
An index >= block_size, or one that repeats within its block, marks the block as
non-finite: it decodes to NaN (the encoder writes 0xFFFF when a block holds NaN or Inf, so
NaN/Inf survive; any other bytes decode to something, never an error).

Error bound: a kept value is exact; a dropped value decodes to 0, so its error is |x| exactly.
The bound is therefore |x_i| for the values the encoder drops and 0 for the ones it keeps,
plus 2**-126 everywhere (XLA:CPU flushes subnormals), inf in blocks with NaN/Inf; ties
between equal magnitudes go to the lower index.

Run the demo (8 CPU devices, data-parallel all_reduce with error feedback):
  python -m examples.custom_codecs.topk
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jcoccl import compressors as jc

NONFINITE = 0xFFFF  # an index no block has: the block decodes to NaN


@jc.register("topk")
class TopK(jc.Compressor):
  """Keeps the ``k`` largest magnitudes of each ``block_size`` block (spec ``topk:k=8``)."""

  k: int = 8
  block_size: int = 256

  def __post_init__(self):
    b = self.block_size
    if isinstance(b, bool) or not isinstance(b, int) or b < 2 or b > 32768 or b & (b - 1):
      raise ValueError(f"block_size must be a power of two in 2..32768, got {b!r}")
    if isinstance(self.k, bool) or not isinstance(self.k, int) or not 1 <= self.k <= b:
      raise ValueError(f"k must be an int in 1..block_size ({b}), got {self.k!r}")

  @property
  def granule(self) -> int:
    return self.block_size

  def row_nbytes(self, n: int, dtype) -> int:
    return n // self.block_size * self.k * 6

  def _select(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(blocks [rows, nb, B], top-k indices [rows, nb, k], block finite [rows, nb, 1])."""
    xb = x.reshape(x.shape[0], -1, self.block_size)
    finite = jnp.all(jnp.isfinite(xb), axis=-1, keepdims=True)
    _, idx = lax.top_k(jnp.where(finite, jnp.abs(xb), 0.0), self.k)
    return xb, idx, finite

  def encode_f32(self, x: jax.Array, key) -> jax.Array:
    xb, idx, finite = self._select(x)
    vals = jnp.take_along_axis(xb, idx, axis=-1)
    idx = jnp.where(finite, idx, NONFINITE).astype(jnp.uint16)
    rows = x.shape[0]
    vbytes = lax.bitcast_convert_type(vals, jnp.uint8).reshape(rows, -1)
    ibytes = lax.bitcast_convert_type(idx, jnp.uint8).reshape(rows, -1)
    return jnp.concatenate([vbytes, ibytes], axis=1)

  def decode_f32(self, buf: jax.Array, n: int) -> jax.Array:
    rows, nb, k, b = buf.shape[0], n // self.block_size, self.k, self.block_size
    vals = lax.bitcast_convert_type(buf[:, : nb * k * 4].reshape(rows, nb, k, 4), jnp.float32)
    idx = lax.bitcast_convert_type(buf[:, nb * k * 4 :].reshape(rows, nb, k, 2), jnp.uint16)
    idx = idx.astype(jnp.int32)
    srt = jnp.sort(idx, axis=-1)
    valid = jnp.all(srt < b, axis=-1, keepdims=True) & jnp.all(
      srt[..., 1:] != srt[..., :-1], axis=-1, keepdims=True
    )
    safe = jnp.where(valid, idx, jnp.arange(k, dtype=jnp.int32))
    out = jnp.zeros((rows, nb, b), jnp.float32)
    r = jnp.arange(rows)[:, None, None]
    c = jnp.arange(nb)[None, :, None]
    # Indices are distinct within a valid block, so the scatter's order cannot matter.
    out = out.at[r, c, safe].set(vals, unique_indices=True)
    return jnp.where(valid, out, jnp.float32(np.nan)).reshape(rows, n)

  def bound_f32(self, x: jax.Array) -> jax.Array:
    xb, idx, finite = self._select(x)
    kept = jnp.zeros(xb.shape, bool)
    r = jnp.arange(xb.shape[0])[:, None, None]
    c = jnp.arange(xb.shape[1])[None, :, None]
    kept = kept.at[r, c, idx].set(True, unique_indices=True)
    # XLA:CPU flushes float32 subnormals in arithmetic (|x| of one reads 0 and a kept one
    # may decode to 0): an absolute 2**-126 covers them, as in the built-ins' bounds.
    b = jnp.where(kept, 0.0, jnp.abs(xb)) + np.float32(2.0**-126)
    return jnp.where(finite, b, jnp.inf).reshape(x.shape)


def demo(steps: int = 20, n: int = 1 << 16, k: int = 8) -> dict[str, float]:
  """Data-parallel gradient all_reduce with top-k + error feedback vs the exact psum.

  Returns:
    ``{"ratio": ..., "err_plain": ..., "err_ef": ...}``: the bytes each device sends
    against ``lax.psum`` (read from the compiled programs), and the relative error of the
    summed gradients over ``steps`` steps, without and with error feedback.

  Example:
    >>> demo(steps=2)["ratio"] < 0.1  # doctest: +SKIP
    True
  """
  import jcoccl

  mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  codec = TopK(k=k)
  ef = jcoccl.error_feedback(codec)

  def step(g, state):
    plain = jcoccl.all_reduce(g, "data", compressor=codec, min_bytes=0)
    fed, state = ef.all_reduce(g, state, "data", min_bytes=0)
    return plain, fed, state

  spec = jax.P("data")
  run = jax.jit(
    jax.shard_map(step, mesh=mesh, in_specs=(spec, spec), out_specs=(jax.P(), jax.P(), spec))
  )
  ndev = jax.device_count()
  state = jnp.zeros((ndev, n), jnp.float32)
  tot_exact = tot_plain = tot_ef = 0.0
  for s in range(steps):
    g = jax.random.normal(jax.random.key(s), (ndev, n)) * jnp.linspace(0.01, 1, n)
    plain, fed, state = run(g, state)
    tot_exact, tot_plain, tot_ef = tot_exact + g.sum(0), tot_plain + plain, tot_ef + fed
  norm = float(jnp.linalg.norm(tot_exact))
  sync = jax.jit(
    jax.shard_map(
      lambda g: jcoccl.all_reduce(g, "data", compressor=codec, min_bytes=0),
      mesh=mesh,
      in_specs=spec,
      out_specs=jax.P(),
    )
  )
  exact = jax.jit(
    jax.shard_map(lambda g: lax.psum(g, "data"), mesh=mesh, in_specs=spec, out_specs=jax.P())
  )
  return {
    "ratio": jcoccl.wire_bytes(sync, state, reference=exact)["ratio"],
    "err_plain": float(jnp.linalg.norm(tot_plain - tot_exact)) / norm,
    "err_ef": float(jnp.linalg.norm(tot_ef - tot_exact)) / norm,
  }


if __name__ == "__main__":
  import os

  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  r = demo()
  print(
    f"topk:k=8 all_reduce sends {r['ratio']:.4f} of lax.psum's bytes; relative error of the summed "
    f"gradients over 20 steps: {r['err_plain']:.3f} without error feedback, "
    f"{r['err_ef']:.3f} with it"
  )

"""Spike reserving on data with outliers: max and RMS error against bytes on the wire.

Three float32 rows of 2^20 values (normal with 0.1% of the values 100x larger, Student-t
with 2 degrees of freedom, plain normal) through int4, spike(int4) with k = 1 and 2, and
neighbours for scale (int8, int4 with a quarter of the block size, int3, spike(int3)).
Native codecs where built (bit-identical to jnp). Runs in seconds on a CPU.

  python benchmarks/spike_outliers.py
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jcoccl import compressors as jc

N = 1 << 20
SPECS = (
  "int4",
  "spike(int4):k=1",
  "spike(int4):k=2",
  "int4:block=64",
  "int8",
  "int3",
  "spike(int3):k=2",
)


def rows(seed: int = 0) -> dict[str, np.ndarray]:
  """The three test rows, by name."""
  rng = np.random.default_rng(seed)
  normal = rng.standard_normal(N).astype(np.float32)
  spiky = normal.copy()
  spiky[rng.random(N) < 1e-3] *= np.float32(100.0)
  return {
    "normal, 0.1% outliers x100": spiky,
    "student-t, df=2": rng.standard_t(2, N).astype(np.float32),
    "normal, no outliers": normal,
  }


def main() -> None:
  for name, x in rows().items():
    print(name)
    xa = jnp.asarray(x[None])
    for spec in SPECS:
      c = jc.parse(spec)
      buf = c.encode_rows(xa)
      err = np.abs(np.asarray(c.decode_rows(buf, N, jnp.float32))[0] - x)
      print(
        f"  {spec:16s} {buf.shape[1] / (4 * N):.4f} of f32 bytes  "
        f"max err {err.max():9.4g}  rms err {np.sqrt(np.mean(err**2)):8.4g}"
      )


if __name__ == "__main__":
  main()

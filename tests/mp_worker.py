"""One process of the multi-process tests (run by tests/test_multiprocess.py through
``python -m jcoccl.launch``): jcoccl's ops across processes vs lax's, on JAX's own runtime.

    python -m jcoccl.launch -n 4 -- python tests/mp_worker.py ops

Every process builds the same global inputs, runs each op on a mesh over all processes'
devices, gathers the global result and checks it: exact compressors bit for bit against the
lax op, lossy ones within the bounds of tests/collectives_util.py, all_reduce identical on
every rank. Prints one ``ok <case>`` line per check; any failure raises (non-zero exit).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jcoccl

assert jcoccl.distributed.initialize(), "expected to run under jcoccl.launch with -n >= 2"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from collectives_util import assert_within, bits, eb, f64, sum_bound  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402

from jcoccl import compressors as jc  # noqa: E402

P = jax.P


def global_mesh() -> Mesh:
  """('proc', 'local'): processes on the outer axis, each process's devices inside."""
  devs = np.array(jax.devices()).reshape(jax.process_count(), jax.local_device_count())
  return Mesh(devs, ("proc", "local"))


def per_rank(m: Mesh, body, x: np.ndarray) -> np.ndarray:
  """``body(x[r])`` on every rank r of ``m`` (row-major), stacked into a host array."""
  axes = tuple(m.axis_names)
  sharding = NamedSharding(m, P(axes))
  xg = jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

  def wrapped(v):
    return body(v[0])[None]

  f = jax.jit(jax.shard_map(wrapped, mesh=m, in_specs=P(axes), out_specs=P(axes)))
  return np.asarray(multihost_utils.process_allgather(f(xg), tiled=True))


def rand(shape, seed) -> np.ndarray:
  return np.asarray(jax.random.normal(jax.random.key(seed), shape, jnp.float32))


def check_ops(m: Mesh) -> None:
  axes = tuple(m.axis_names)
  n = m.devices.size
  x = rand((n, 1000), 0)  # 1000: not a multiple of the blocks (padding)
  xs = rand((n, n, 96), 1)  # one row per destination
  perm = tuple((i, (i + 1) % n) for i in range(n))
  c = jc.int8(block_size=64)
  # lax's results, computed once: both compressors are checked against them.
  lax_psum = per_rank(m, lambda v: lax.psum(v, axes), x)
  lax_all_gather = per_rank(m, lambda v: lax.all_gather(v, axes), x)
  lax_all_to_all = per_rank(m, lambda v: lax.all_to_all(v, axes, 0, 0), xs)
  lax_ppermute = per_rank(m, lambda v: lax.ppermute(v, axes, perm), x)
  for name, comp in (("none", None), ("int8", c)):
    kw = dict(compressor=comp, min_bytes=0)
    for algo in ("one_shot", "two_shot"):
      got = per_rank(m, lambda v: jcoccl.all_reduce(v, axes, algorithm=algo, **kw), x)
      for r in range(1, n):
        np.testing.assert_array_equal(bits(got[r]), bits(got[0]))
      if comp is None:
        np.testing.assert_array_equal(bits(got), bits(lax_psum))
      elif algo == "one_shot":
        assert_within(got[0], f64(x).sum(0), sum_bound(c, x, jnp.float32), "all_reduce")
      print(f"ok all_reduce {name} {algo}", flush=True)
    got = per_rank(m, lambda v: jcoccl.all_gather(v, axes, **kw), x)
    check(got, lax_all_gather, comp, lambda r: x, "all_gather")
    got = per_rank(m, lambda v: jcoccl.reduce_scatter(v, axes, **kw), xs)
    want = per_rank(m, lambda v: lax.psum_scatter(v, axes), xs)
    if comp is None:
      np.testing.assert_array_equal(bits(got), bits(want))
    else:
      for r in range(n):
        assert_within(got[r], f64(xs[:, r]).sum(0), sum_bound(c, xs[:, r], jnp.float32))
    print(f"ok reduce_scatter {name}", flush=True)
    got = per_rank(m, lambda v: jcoccl.all_to_all(v, axes, 0, 0, **kw), xs)
    check(got, lax_all_to_all, comp, lambda r: xs[:, r], "all_to_all")
    got = per_rank(m, lambda v: jcoccl.ppermute(v, axes, perm, **kw), x)
    check(got, lax_ppermute, comp, lambda r: x[(r - 1) % n], "ppermute")


def check_fused_refuses(m: Mesh) -> None:
  """The CPU engine cannot span processes: init says so; auto stays on xla."""
  try:
    jcoccl.init(m)
  except ValueError as e:
    assert "within one process" in str(e), e
  else:
    raise AssertionError("jcoccl.init accepted a mesh across CPU processes")
  print("ok fused init refused across processes", flush=True)


def check(got, want, comp, source, what) -> None:
  """Exact: bitwise vs lax. Lossy: rank r's result within the bound of what it received."""
  if comp is None:
    np.testing.assert_array_equal(bits(got), bits(want))
  else:
    for r in range(got.shape[0]):
      src = source(r)  # each row was encoded on its own: bound row by row
      bound = np.stack([eb(comp, row) for row in src]) if src.ndim == 2 else eb(comp, src)
      assert_within(got[r], f64(want[r]), bound, f"{what} rank {r}")
  print(f"ok {what} {'none' if comp is None else 'int8'}", flush=True)


def loop_until_killed(m: Mesh) -> None:
  """All-reduces forever; the test kills one process and expects the others to stop."""
  axes = tuple(m.axis_names)
  x = rand((m.devices.size, 1024), 0)
  step = 0
  while True:
    per_rank(m, lambda v: jcoccl.all_reduce(v, axes, compressor="int8", min_bytes=0), x)
    step += 1
    if step in (1, 2, 4) or step % 50 == 0:
      print(f"step {step}", flush=True)


def main(case: str) -> None:
  m = global_mesh()
  print(
    f"process {jax.process_index()}/{jax.process_count()} pid {os.getpid()}: "
    f"{jax.local_device_count()} local devices, mesh {dict(m.shape)}",
    flush=True,
  )
  if case == "ops":
    check_ops(m)
    check_fused_refuses(m)
  elif case == "loop":
    loop_until_killed(m)
  else:
    raise SystemExit(f"unknown case {case!r}")
  print("done", flush=True)


if __name__ == "__main__":
  main(sys.argv[1])

"""The fused backend (one custom call per collective, jcoccl's engine over the in-process host
transport) against the XLA backend: outputs must be bit-identical for the same compressor,
algorithm and chunks; the compiled HLO must hold one jcoccl custom call and no XLA
collective; lifecycle, errors and timeouts must fail cleanly."""

from __future__ import annotations

import functools
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jcoccl
from jcoccl import compressors as jc
from jcoccl._src.base.axes import canonical_axes
from jcoccl._src.engine import fused_comms, fused_ffi
from jcoccl._src.native import _backend, _ffi

pytestmark = pytest.mark.skipif(
  _ffi.native_module("cpu") is None, reason="jcoccl._cpu (the fused engine) is not built"
)

_COLLECTIVE_OPS = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")


@pytest.fixture(autouse=True)
def _clean():
  fused_comms.shutdown()
  yield
  fused_comms.shutdown()


def _mesh(shape, names):
  return jax.make_mesh(shape, names, devices=jax.devices()[: int(np.prod(shape))])


def _data(mesh, dtype, rows=8, cols=44, nonfinite=False, seed=0):
  """A global [n_devices * rows, cols] array with outliers, sharded over every mesh axis."""
  n = mesh.devices.size
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((n * rows, cols)).astype(np.float32)
  x[rng.random(x.shape) < 0.01] *= 300.0
  if nonfinite:
    x[3, 5], x[rows + 1, 7], x[2 * rows - 1, 40] = np.nan, np.inf, -np.inf
  spec = jax.P(tuple(mesh.axis_names))
  return jax.device_put(jnp.asarray(x, dtype), jax.NamedSharding(mesh, spec))


def _perm(n):
  """A shift that leaves rank 0 receiving nothing (lax.ppermute gives it zeros)."""
  return [(i, i + 1) for i in range(n - 1)]


def _program(mesh, axes, comp, backend, chunks, ops):
  n = int(np.prod([mesh.shape[a] for a in (axes if isinstance(axes, tuple) else (axes,))]))
  kw = dict(compressor=comp, backend=backend, chunks=chunks, min_bytes=0)

  def body(x):
    out = []
    for op in ops:
      if op in ("one_shot", "two_shot"):
        out.append(jcoccl.all_reduce(x, axes, algorithm=op, **kw))
      elif op == "reduce_scatter":
        out.append(jcoccl.reduce_scatter(x, axes, scatter_dimension=0, tiled=True, **kw))
      elif op == "all_gather":
        out.append(jcoccl.all_gather(x, axes, axis=0, tiled=True, **kw))
      elif op == "all_to_all":
        out.append(jcoccl.all_to_all(x, axes, 0, 0, tiled=True, **kw))
      elif op == "ppermute":
        out.append(jcoccl.ppermute(x, axes, _perm(n), **kw))
    return tuple(out)

  spec = jax.P(tuple(mesh.axis_names))
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))


def _bits(a):
  a = np.asarray(a)
  return a.view(np.uint8).reshape(-1)


def _assert_identical(mesh, axes, comp, chunks, ops, x):
  ref = _program(mesh, axes, comp, "xla", chunks, ops)(x)
  got = _program(mesh, axes, comp, "fused", chunks, ops)(x)
  for op, r, g in zip(ops, ref, got):
    assert r.shape == g.shape and r.dtype == g.dtype, op
    np.testing.assert_array_equal(_bits(g), _bits(r), err_msg=f"{op}: fused != xla bits")


ALL_OPS = ("one_shot", "two_shot", "reduce_scatter", "all_gather", "all_to_all", "ppermute")

_CASES = [
  (jc.int8(block_size=32), jnp.float32, 1, True),
  (jc.int8(block_size=64), jnp.bfloat16, 2, False),
  (jc.int4(block_size=32, symmetric=False), jnp.float32, 2, False),
  (jc.fp8("e4m3", block_size=32), jnp.float16, 1, True),
  (jc.fp8("e5m2", block_size=32), jnp.float32, 2, False),
  (jc.hadamard(jc.int4(block_size=32)), jnp.float32, 1, False),
  (jc.cast("bfloat16"), jnp.float32, 3, True),
  (jc.error_bounded(1e-2, block_size=32), jnp.float32, 1, False),
  (jc.spike(jc.int4(block_size=32), k=2), jnp.float32, 1, True),
  (jc.spike(jc.fp8("e4m3", block_size=32), k=3), jnp.bfloat16, 2, False),
]


@pytest.mark.parametrize("comp,dtype,chunks,nonfinite", _CASES, ids=lambda v: str(v))
def test_bit_identical_8_ranks(comp, dtype, chunks, nonfinite):
  mesh = _mesh((8,), ("x",))
  jcoccl.init(mesh)
  x = _data(mesh, dtype, nonfinite=nonfinite)
  _assert_identical(mesh, "x", comp, chunks, ALL_OPS, x)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_bit_identical_small_meshes(n):
  mesh = _mesh((n,), ("x",))
  jcoccl.init(mesh)
  x = _data(mesh, jnp.float32, seed=n)
  _assert_identical(mesh, "x", jc.int8(block_size=32), 2, ALL_OPS, x)


@pytest.mark.parametrize("axes", ["b", "a", ("a", "b"), ("b", "a")], ids=str)
def test_bit_identical_two_axis_mesh(axes):
  mesh = _mesh((2, 4), ("a", "b"))
  jcoccl.init(mesh)
  x = _data(mesh, jnp.float32, seed=3)
  # lax.ppermute (the XLA backend's) rejects axis tuples out of mesh order.
  ops = ALL_OPS if axes != ("b", "a") else ALL_OPS[:-1]
  _assert_identical(mesh, axes, jc.int4(block_size=32), 1, ops, x)


@pytest.mark.parametrize(
  "levels",
  [
    (jc.int4(block_size=32), jc.int8(block_size=32)),
    (jc.fp8("e4m3", block_size=64), jc.int8(block_size=32)),
  ],
  ids=str,
)
def test_hierarchical_bit_identical(levels):
  mesh = _mesh((2, 4), ("node", "gpu"))
  jcoccl.init(mesh)
  x = _data(mesh, jnp.float32, seed=5)
  axes = ("node", "gpu")

  def prog(backend):
    def body(v):
      return jcoccl.all_reduce(
        v, axes, compressor=levels, algorithm="hierarchical", backend=backend, chunks=2, min_bytes=0
      )

    spec = jax.P(axes)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))

  ref, got = prog("xla")(x), prog("fused")(x)
  np.testing.assert_array_equal(_bits(got), _bits(ref))


def _hlo(fn, x):
  return fn.lower(x).compile().as_text()


def _count_collectives(text):
  return {
    op: sum(1 for line in text.splitlines() if f" {op}(" in line or f" {op}-start(" in line)
    for op in _COLLECTIVE_OPS
  }


@pytest.mark.parametrize("op", ALL_OPS)
def test_hlo_one_custom_call_no_collective(op):
  mesh = _mesh((8,), ("x",))
  jcoccl.init(mesh)
  x = _data(mesh, jnp.float32)
  text = _hlo(_program(mesh, "x", jc.int8(block_size=32), "fused", 2, (op,)), x)
  calls = [l for l in text.splitlines() if "custom-call" in l and "jcoccl_fused_" in l]
  assert len(calls) == 1, calls
  assert sum(_count_collectives(text).values()) == 0, _count_collectives(text)
  assert "jcoccl_encode_rows" not in text  # the codec runs inside the fused call


def test_auto_uses_fused_after_init_and_xla_after_shutdown():
  mesh = _mesh((8,), ("x",))
  x = _data(mesh, jnp.float32)
  prog = lambda: _program(mesh, "x", jc.int8(block_size=32), "auto", 1, ("one_shot",))
  text = _hlo(prog(), x)
  assert "jcoccl_fused_" not in text and _count_collectives(text)["all-gather"] >= 1
  jcoccl.init(mesh)
  text = _hlo(prog(), x)
  assert "jcoccl_fused_all_reduce" in text and sum(_count_collectives(text).values()) == 0
  jcoccl.shutdown()
  text = _hlo(prog(), x)
  assert "jcoccl_fused_" not in text


def test_fused_without_init_raises():
  mesh = _mesh((8,), ("x",))
  x = _data(mesh, jnp.float32)
  with pytest.raises(ValueError, match=r"jcoccl\.init\(mesh\)"):
    _program(mesh, "x", jc.int8(block_size=32), "fused", 1, ("one_shot",))(x)


def test_fused_axes_not_initialised_raises():
  mesh = _mesh((2, 4), ("a", "b"))
  jcoccl.init(mesh, axes=["a"])
  x = _data(mesh, jnp.float32)
  with pytest.raises(ValueError, match=r"jcoccl\.init"):
    _program(mesh, "b", jc.int8(block_size=32), "fused", 1, ("one_shot",))(x)


def test_grad_through_fused_matches_xla():
  mesh = _mesh((4,), ("x",))
  jcoccl.init(mesh)
  x = _data(mesh, jnp.float32)
  spec = jax.P("x")

  def loss(backend, v):
    def body(u):
      y = jcoccl.all_gather(
        u, "x", axis=0, tiled=True, compressor=jc.int8(block_size=32), backend=backend, min_bytes=0
      )
      return jnp.sum(y * y)[None]

    return jnp.sum(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)(v))

  g_ref = jax.jit(jax.grad(functools.partial(loss, "xla")))(x)
  g_fused = jax.jit(jax.grad(functools.partial(loss, "fused")))(x)
  np.testing.assert_array_equal(_bits(g_fused), _bits(g_ref))


def _lonely_rank(cid: int):
  """A 2-rank host communicator ``cid`` over devices 0 and 1, and a jitted one-shot
  all_reduce that only device 0 runs: its rank 0 waits for a rank 1 that never comes.

  Returns:
    (native module, cid, jitted function, its input on device 0).
  """
  mod = _ffi.native_module("cpu")
  _ffi.register("cpu")
  devs = jax.devices()[:2]
  mod.fused_host_comm_create(cid, [d.id for d in devs])
  f = jax.jit(
    lambda v: fused_ffi.engine_call(
      "all_reduce", "one_shot", v, v.shape, cid, 2, jc.int8(block_size=32), 1, 32, platform="cpu"
    )
  )
  return mod, cid, f, jax.device_put(jnp.ones((1, 32), jnp.float32), devs[0])


def test_rendezvous_timeout_fails_instead_of_hanging():
  """A 2-rank group whose second rank never arrives: the call must raise after the timeout
  the config gave when the call was traced (the engine reads no environment variable)."""
  mod, cid, f, x = _lonely_rank(10**12 + 7)
  try:
    with jcoccl.config(timeout_s=0.3), pytest.raises(Exception, match=r"timed out after 0\.3"):
      jax.block_until_ready(f(x))
    # The group is now broken: later calls fail at once, also without hanging.
    with pytest.raises(Exception, match="timed out"):
      jax.block_until_ready(f(x + 1))
  finally:
    mod.fused_comm_destroy(cid)


def test_destroying_a_communicator_fails_a_waiting_collective_at_once():
  """Rank 0 of a 2-rank group waits for a rank that never comes; destroying the
  communicator (as jcoccl.shutdown does) must end that wait with an error, not the timeout."""
  mod, cid, f, x = _lonely_rank(10**12 + 11)
  # A one-device CPU program may run on the calling thread: destroy from another one.
  destroyed = []
  timer = threading.Timer(1.0, lambda: destroyed.append(mod.fused_comm_destroy(cid)))
  start = time.monotonic()
  timer.start()
  try:
    # Destroyed while waiting: "was destroyed"; if the call had not yet looked up its
    # communicator: "no communicator". Either way, no 120 s timeout.
    with (
      pytest.raises(Exception, match="was destroyed|has no communicator"),
      jcoccl.config(timeout_s=120),
    ):
      jax.block_until_ready(f(x))
  finally:
    timer.join()
    mod.fused_comm_destroy(cid)
  assert destroyed == [2]
  assert time.monotonic() - start < 30


def test_init_shutdown_registry():
  mesh = _mesh((2, 4), ("a", "b"))
  mod = _ffi.native_module("cpu")
  jcoccl.init(mesh)
  assert fused_comms.is_initialized(("a", "b")) and fused_comms.is_initialized(("b",))
  # 4 axis tuples: (a), (b), (a, b), (b, a); every device is in one group of each.
  assert len(mod.fused_comm_keys()) == 4 * 8
  jcoccl.shutdown()
  assert not fused_comms.is_initialized() and mod.fused_comm_keys() == []


def test_vmap_and_scan_match_xla():
  mesh = _mesh((4,), ("x",))
  jcoccl.init(mesh)
  x = _data(mesh, jnp.float32, rows=3, cols=64)
  comp = jc.int8(block_size=32)
  spec = jax.P("x")

  def run(backend, kind):
    ar = lambda v: jcoccl.all_reduce(v, "x", compressor=comp, backend=backend, min_bytes=0)
    if kind == "vmap":
      body = jax.vmap(ar)
    else:
      body = lambda v: jax.lax.scan(lambda c, _: (0.25 * ar(c) + 0.5 * c, None), v, None, length=3)[
        0
      ]
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))(x)

  for kind in ("vmap", "scan"):
    np.testing.assert_array_equal(_bits(run("fused", kind)), _bits(run("xla", kind)), err_msg=kind)


def test_auto_falls_back_to_xla_on_a_mesh_of_another_size():
  jcoccl.init(_mesh((4,), ("x",)))
  mesh2 = _mesh((2,), ("x",))
  x = _data(mesh2, jnp.float32)
  text = _hlo(_program(mesh2, "x", jc.int8(block_size=32), "auto", 1, ("one_shot",)), x)
  assert "jcoccl_fused_" not in text
  with pytest.raises(ValueError, match="jcoccl.init"):
    _program(mesh2, "x", jc.int8(block_size=32), "fused", 1, ("one_shot",))(x)


def test_programs_survive_shutdown_and_reinit_of_the_same_mesh():
  mesh = _mesh((4,), ("x",))
  jcoccl.init(mesh)
  x = _data(mesh, jnp.float32)
  f = _program(mesh, "x", jc.int8(block_size=32), "fused", 1, ("one_shot",))
  compiled = f.lower(x).compile()
  # Finished before shutdown: a program still in flight then fails (see the next test).
  first = jax.block_until_ready(f(x))
  jcoccl.shutdown()
  # The jitted function traces again (the backend registry is part of jit's key) and is
  # refused; the compiled program, communicators gone, fails cleanly on every device.
  # Each device's shard is waited for, so that no device is still running the failed
  # program when the communicators come back (the first error alone returns while others
  # may still run).
  with pytest.raises(ValueError, match=r"jcoccl\.init"):
    f(x)
  y = compiled(x)
  for shard in (s for out in jax.tree.leaves(y) for s in out.addressable_shards):
    with pytest.raises(Exception, match=r"jcoccl\.init"):
      jax.block_until_ready(shard.data)
  jcoccl.init(mesh)
  np.testing.assert_array_equal(_bits(f(x)[0]), _bits(first[0]))
  np.testing.assert_array_equal(_bits(compiled(x)[0]), _bits(first[0]))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=str)
def test_identity_codec_engine_matches_lax(dtype):
  """The engine with the identity codec ("none", the uncompressed baseline of the GPU
  benchmark): data movement equals lax's exactly; the sum is the f32 left fold, cast once."""
  n, m = 8, 64
  mesh = _mesh((n,), ("x",))
  jcoccl.init(mesh)
  cid = fused_comms._state.comms[("x",)]
  x = _data(mesh, dtype, rows=n, cols=m, nonfinite=True)
  call = lambda algo, v, shape: fused_ffi.engine_call(
    "all_reduce" if algo == "one_shot" else algo, algo, v, shape, cid, n, None, 1, m, platform="cpu"
  )

  def body(v):
    ag = call("all_gather", v[:1], (1, n, m))[0]
    a2a = call("all_to_all", v[None], (1, n, m))[0]
    ar = call("one_shot", v[:1], (1, m))
    return (
      ag,
      jax.lax.all_gather(v[0], "x"),
      a2a,
      jax.lax.all_to_all(v, "x", 0, 0, tiled=True),
      ar,
    )

  spec = jax.P("x")
  outs = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))(x)
  np.testing.assert_array_equal(_bits(outs[0]), _bits(outs[1]))
  np.testing.assert_array_equal(_bits(outs[2]), _bits(outs[3]))
  rows = np.asarray(x, np.float32).reshape(n, n, m)[:, 0]  # row 0 of every rank
  acc = rows[0].copy()
  for r in range(1, n):
    acc = acc + rows[r]
  want = np.asarray(jnp.asarray(acc).astype(dtype))
  got = np.asarray(outs[4]).reshape(n, m)
  for r in range(n):
    np.testing.assert_array_equal(_bits(got[r]), _bits(want))


# ----------------------------------------------------------------------------------------
# Plain (uncompressed) collectives: the transport's own ops, the GPU benchmark's baseline.


def _fold_bound(n):
  """Float32 summation error: any order of n-term addition lands within gamma_{n-1} * sum|x|
  of the exact sum (gamma_j = j u / (1 - j u), u = eps32 / 2), so two orders differ by at
  most 2 gamma_{n-1} sum|x| ~ (n - 1) eps32 sum|x|."""
  u = float(np.finfo(np.float32).eps) / 2
  return 2 * (n - 1) * u / (1 - (n - 1) * u)


def _plain_data(n, k, m, seed):
  """Per rank [k, n, m] float32 with outliers and a few NaN/Inf (one NaN per element)."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((n, k, n, m)).astype(np.float32)
  x[rng.random(x.shape) < 0.02] *= 1e4
  x[0, 0, :, 3] = np.nan  # NaN from rank 0 only
  x[0, 0, :, 5] = np.inf
  x[n - 1, 0, :, 5] = -np.inf  # Inf + -Inf: NaN
  x[1, 0, :, 7] = np.inf
  return x


def _assert_sum_close(got, want, x_abs_sum, n, what):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  fin = np.isfinite(want)
  np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=what)
  np.testing.assert_array_equal(
    got[~fin & ~np.isnan(want)], want[~fin & ~np.isnan(want)], err_msg=what
  )
  err = np.abs(got[fin] - want[fin])
  bound = _fold_bound(n) * x_abs_sum[fin]
  assert np.all(err <= bound), (what, float(np.max(err - bound)))


@pytest.mark.parametrize("n,k", [(2, 1), (4, 2), (8, 1)])
def test_plain_ops_host_transport(n, k):
  """algo="plain": all_gather moves bytes exactly as lax.all_gather; all_reduce and
  reduce_scatter are the float32 left fold in rank order, bit for bit on every rank, and
  agree with lax.psum / lax.psum_scatter within float32 summation rounding."""
  m = 48
  mesh = _mesh((n,), ("x",))
  jcoccl.init(mesh)
  cid = fused_comms._state.comms[("x",)]
  xh = _plain_data(n, k, m, seed=n)
  x = jax.device_put(jnp.asarray(xh.reshape(n * k, n, m)), jax.NamedSharding(mesh, jax.P("x")))
  call = lambda op, v, shape: fused_ffi.engine_call(
    op, "plain", v, shape, cid, n, None, k, m, platform="cpu"
  )

  def body(v):
    row, half = v[:, 0], v[:, 0].astype(jnp.bfloat16)
    return (
      call("all_reduce", row, (k, m)),
      jax.lax.psum(row, "x"),
      call("reduce_scatter", v, (k, m)),
      jax.lax.psum_scatter(v, "x", scatter_dimension=1, tiled=False),
      call("all_gather", row, (k, n, m)),
      jax.lax.all_gather(row, "x", axis=1),
      call("all_gather", half, (k, n, m)),
      jax.lax.all_gather(half, "x", axis=1),
    )

  spec = jax.P("x")
  outs = [
    np.asarray(o)
    for o in jax.jit(
      jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
    )(x)
  ]
  ar, ar_lax, rs, rs_lax = (o.reshape(n, k, m) for o in outs[:4])
  np.testing.assert_array_equal(_bits(outs[4]), _bits(outs[5]))
  np.testing.assert_array_equal(_bits(outs[6]), _bits(outs[7]))
  with np.errstate(invalid="ignore"):
    fold = xh[0].copy()  # [k, n, m]: slot j of every rank, summed in rank order
    for r in range(1, n):
      fold = fold + xh[r]
  abs_sum = np.abs(xh.astype(np.float64)).sum(axis=0)
  for r in range(n):
    np.testing.assert_array_equal(_bits(ar[r]), _bits(fold[:, 0]), err_msg=f"all_reduce rank {r}")
    np.testing.assert_array_equal(
      _bits(rs[r]), _bits(fold[:, r]), err_msg=f"reduce_scatter rank {r}"
    )
    _assert_sum_close(ar_lax[r], ar[r], abs_sum[:, 0], n, f"psum rank {r}")
    _assert_sum_close(rs_lax[r], rs[r], abs_sum[:, r], n, f"psum_scatter rank {r}")


def test_plain_ops_reject_bad_arguments():
  x = jnp.ones((1, 32), jnp.float32)
  kw = dict(platform="cpu")
  with pytest.raises(ValueError, match="compressor=None"):
    fused_ffi.engine_call(
      "all_reduce", "plain", x, x.shape, 1, 2, jc.int8(block_size=32), 1, 32, **kw
    )
  with pytest.raises(TypeError, match="float32"):
    fused_ffi.engine_call(
      "all_reduce", "plain", x.astype(jnp.bfloat16), x.shape, 1, 2, None, 1, 32, **kw
    )
  with pytest.raises(ValueError, match="all_reduce, reduce_scatter or all_gather"):
    fused_ffi.engine_call("all_to_all", "plain", x, x.shape, 1, 2, None, 1, 32, **kw)
  with pytest.raises(ValueError, match="algo must be"):
    fused_ffi.engine_call("all_reduce", "ring", x, x.shape, 1, 2, None, 1, 32, **kw)


# ----------------------------------------------------------------------------------------
# Communicators belong to devices in mesh order: meshes with the same axis names and sizes
# but other devices (or another order) must never use them.


def _mesh_of(device_ids, shape, names):
  devs = np.asarray([jax.devices()[i] for i in device_ids], dtype=object).reshape(shape)
  return jax.sharding.Mesh(devs, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))


def _exact_data(mesh, seed=0):
  """Per device [8, 64] integers in [-127, 127] with 127 opening every 32-block: int8 with
  32-blocks has scale 1 on them, so every compressed op below is exact and equals lax
  whatever the summation order."""
  n = mesh.devices.size
  rng = np.random.default_rng(seed)
  x = rng.integers(-127, 128, size=(n * 8, 64)).astype(np.float32)
  x[:, ::32] = 127.0
  return jax.device_put(jnp.asarray(x), jax.NamedSharding(mesh, jax.P(tuple(mesh.axis_names))))


_EXACT_OPS = ("one_shot", "reduce_scatter", "all_gather", "all_to_all", "ppermute")


def _vs_lax(mesh, axes, backend):
  """jit(shard_map) returning, per op of _EXACT_OPS, (jcoccl result, lax result)."""
  n = int(np.prod([mesh.shape[a] for a in axes]))
  kw = dict(compressor=jc.int8(block_size=32), backend=backend, min_bytes=0)
  perm = [(i, (i + 3) % n) for i in range(n)]

  def body(x):
    return (
      jcoccl.all_reduce(x, axes, algorithm="one_shot", **kw),
      jax.lax.psum(x, axes),
      jcoccl.reduce_scatter(x, axes, scatter_dimension=0, tiled=True, **kw),
      jax.lax.psum_scatter(x, axes, scatter_dimension=0, tiled=True),
      jcoccl.all_gather(x, axes, axis=0, tiled=True, **kw),
      jax.lax.all_gather(x, axes, axis=0, tiled=True),
      jcoccl.all_to_all(x, axes, 0, 0, tiled=True, **kw),
      jax.lax.all_to_all(x, axes, 0, 0, tiled=True),
      jcoccl.ppermute(x, axes, perm, **kw),
      jax.lax.ppermute(x, axes, perm),
    )

  spec = jax.P(tuple(mesh.axis_names))
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))


def _assert_equals_lax(fn, x):
  outs = fn(x)
  for i, op in enumerate(_EXACT_OPS):
    np.testing.assert_array_equal(
      np.asarray(outs[2 * i]), np.asarray(outs[2 * i + 1]), err_msg=f"{op} != lax"
    )


# (init device order, shard_map device order, shape, names, axes of the ops)
_ORDERS = {
  "1d_reversed": (range(8), range(7, -1, -1), (8,), ("x",), [("x",)]),
  "1d_shuffled": (range(8), (3, 6, 0, 5, 7, 1, 4, 2), (8,), ("x",), [("x",)]),
  "1d_rotated_4": (range(4), (1, 2, 3, 0), (4,), ("x",), [("x",)]),
  # Transposed order keeps every rank over "b" the same but changes the groups.
  "2d_transposed": (
    range(8),
    (0, 2, 4, 6, 1, 3, 5, 7),
    (2, 4),
    ("a", "b"),
    [("a",), ("b",), ("a", "b")],
  ),
  "2d_swapped_rows": (
    range(8),
    (4, 5, 6, 7, 0, 1, 2, 3),
    (2, 4),
    ("a", "b"),
    [("a",), ("b",), ("a", "b")],
  ),
  "other_devices": (range(4), range(4, 8), (2, 2), ("a", "b"), [("a",), ("b",), ("a", "b")]),
}


@pytest.mark.parametrize("case", sorted(_ORDERS))
def test_mesh_with_other_device_order(case):
  """init(mesh) then a shard_map over a mesh with the same axis names and sizes but other
  devices or order: auto runs xla and equals lax; fused raises a clear error when lowered
  (under jit the devices are known only then); after init with that mesh, fused equals
  lax too."""
  init_ids, ids, shape, names, axes_list = _ORDERS[case]
  seen, mesh = _mesh_of(init_ids, shape, names), _mesh_of(ids, shape, names)
  x = _exact_data(mesh, seed=len(case))
  jcoccl.init(seen)
  for axes in axes_list:
    fn = _vs_lax(mesh, axes, "auto")
    assert "jcoccl_fused_" not in _hlo(fn, x), axes
    _assert_equals_lax(fn, x)
    with pytest.raises(ValueError, match=r"not the mesh given to jcoccl\.init"):
      _vs_lax(mesh, axes, "fused").trace(x).lower()
  jcoccl.init(mesh)
  for axes in axes_list:
    for backend in ("fused", "auto"):
      fn = _vs_lax(mesh, axes, backend)
      assert "jcoccl_fused_" in _hlo(fn, x), (axes, backend)
      _assert_equals_lax(fn, x)


@pytest.mark.parametrize("backend", ["auto", "fused"])
def test_reused_trace_under_another_device_order(backend):
  """JAX reuses an inner jit's trace between shard_maps whose meshes differ only in their
  devices; the fused call it holds must then never run on the wrong communicator: auto
  lowers it as xla (equal to lax), fused fails to compile."""
  seen, other = _mesh_of(range(8), (8,), ("x",)), _mesh_of(range(7, -1, -1), (8,), ("x",))
  comp = jc.int8(block_size=32)
  inner = jax.jit(
    lambda v: jcoccl.all_gather(
      v, "x", axis=0, tiled=True, compressor=comp, backend=backend, min_bytes=0
    )
  )
  jcoccl.init(seen)

  def run(mesh):
    x = _exact_data(mesh)
    return jax.jit(jax.shard_map(inner, mesh=mesh, in_specs=jax.P("x"), out_specs=jax.P("x")))(x)

  run(seen)
  if backend == "fused":
    with pytest.raises(ValueError, match=r"not the mesh given to jcoccl\.init"):
      run(other)
    return
  x = _exact_data(other)
  lax_gather = lambda v: jax.lax.all_gather(v, "x", axis=0, tiled=True)
  ref = jax.jit(jax.shard_map(lax_gather, mesh=other, in_specs=jax.P("x"), out_specs=jax.P("x")))
  np.testing.assert_array_equal(np.asarray(run(other)), np.asarray(ref(x)))


def test_fused_needs_a_concrete_mesh():
  """shard_map over an abstract mesh (devices unknown when lowered too): fused refuses,
  auto runs xla; with jax.set_mesh the devices are known and fused runs."""
  mesh = _mesh_of(range(8), (8,), ("x",))
  jcoccl.init(mesh)
  x = _exact_data(mesh)

  def prog(backend):
    body = lambda v: jcoccl.all_gather(
      v, "x", axis=0, tiled=True, compressor=jc.int8(block_size=32), backend=backend, min_bytes=0
    )
    return jax.jit(
      jax.shard_map(body, mesh=mesh.abstract_mesh, in_specs=jax.P("x"), out_specs=jax.P("x"))
    )

  ref = prog("xla")(x)
  with pytest.raises(ValueError, match="cannot tell which devices"):
    prog("fused").trace(x).lower()
  assert "jcoccl_fused_" not in _hlo(prog("auto"), x)
  with jax.set_mesh(mesh):
    fn = prog("fused")
    assert "jcoccl_fused_" in _hlo(fn, x)
    np.testing.assert_array_equal(np.asarray(fn(x)), np.asarray(ref))


# ----------------------------------------------------------------------------------------
# What the fused engine cannot run: auto falls back to xla, fused names the reason.

_KEY = jax.random.key(7)
_CANNOT = {
  "stochastic": (jc.int8(block_size=32, rounding="stochastic"), "round-to-nearest"),
  "stochastic_in_hadamard": (
    jc.hadamard(jc.int4(block_size=32, rounding="stochastic")),
    "round-to-nearest",
  ),
  "nested_hadamard": (jc.hadamard(jc.hadamard(jc.int8(block_size=32))), "no native kernel"),
  "spike_around_hadamard": (
    jc.spike(jc.hadamard(jc.int4(block_size=32), size=32), k=2),
    "no native kernel",
  ),
}


def _one_op(mesh, op, comp, backend, axes="x", algorithm="one_shot"):
  n = int(np.prod([mesh.shape[a] for a in canonical_axes(axes)]))
  kw = dict(compressor=comp, backend=backend, min_bytes=0, key=_KEY)

  def body(x):
    if op == "all_reduce":
      return jcoccl.all_reduce(x, axes, algorithm=algorithm, **kw)
    if op == "reduce_scatter":
      return jcoccl.reduce_scatter(x, axes, scatter_dimension=0, tiled=True, **kw)
    if op == "all_gather":
      return jcoccl.all_gather(x, axes, axis=0, tiled=True, **kw)
    if op == "all_to_all":
      return jcoccl.all_to_all(x, axes, 0, 0, tiled=True, **kw)
    return jcoccl.ppermute(x, axes, _perm(n), **kw)

  spec = jax.P(tuple(mesh.axis_names))
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))


_OPS5 = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "ppermute")


def _assert_auto_is_xla(prog, x):
  """``prog("auto")`` lowers to the very program of ``prog("xla")`` (so it computes the same
  bits, without compiling either), which calls no engine."""
  auto, xla = (prog(b).lower(x).as_text() for b in ("auto", "xla"))
  assert "jcoccl_fused_" not in auto
  assert auto == xla


@pytest.mark.parametrize("case", sorted(_CANNOT))
@pytest.mark.parametrize("op", _OPS5)
def test_auto_falls_back_for_compressors_fused_cannot_run(case, op):
  comp, why = _CANNOT[case]
  mesh = _mesh((4,), ("x",))
  jcoccl.init(mesh)
  x = _data(mesh, jnp.float32, cols=64)
  _assert_auto_is_xla(lambda b: _one_op(mesh, op, comp, b), x)
  with pytest.raises(ValueError, match=f"compressor .*{why}"):
    _one_op(mesh, op, comp, "fused").trace(x)


def test_auto_falls_back_for_a_stochastic_hierarchical_level():
  mesh = _mesh((2, 4), ("a", "b"))
  jcoccl.init(mesh)
  x = _data(mesh, jnp.float32, cols=64)
  levels = (jc.int4(block_size=32, rounding="stochastic"), jc.int8(block_size=32))
  prog = lambda b: _one_op(mesh, "all_reduce", levels, b, ("a", "b"), "hierarchical")
  _assert_auto_is_xla(prog, x)
  with pytest.raises(ValueError, match="round-to-nearest"):
    prog("fused").trace(x)


def test_auto_falls_back_for_axes_without_communicator():
  mesh = _mesh((2, 4), ("a", "b"))
  jcoccl.init(mesh, axes=["a"])
  x = _data(mesh, jnp.float32, cols=64)
  prog = lambda b: _one_op(mesh, "all_gather", jc.int8(block_size=32), b, "b")
  _assert_auto_is_xla(prog, x)
  with pytest.raises(ValueError, match=r"no communicator for axes \('b',\)"):
    prog("fused").trace(x)


def test_hierarchical_runs_on_its_level_communicators():
  """A hierarchical all_reduce needs the inner and outer levels' communicators only."""
  mesh = _mesh((2, 4), ("a", "b"))
  jcoccl.init(mesh, axes=["a", "b"])
  x = _data(mesh, jnp.float32, cols=64)
  levels = (jc.int4(block_size=32), jc.int8(block_size=32))
  prog = lambda b: _one_op(mesh, "all_reduce", levels, b, ("a", "b"), "hierarchical")
  assert "jcoccl_fused_all_reduce" in _hlo(prog("auto"), x)
  np.testing.assert_array_equal(_bits(prog("fused")(x)), _bits(prog("xla")(x)))


def test_unsupported_is_the_one_predicate():
  """auto and fused consult the same function: its reasons are what fused raises."""
  mesh = _mesh((4,), ("x",))
  assert (
    _backend.resolve("all_gather", "auto", ("x",), compressor=jc.int8(), dtype=jnp.float32)[0]
    == "xla"
  )
  jcoccl.init(mesh)
  seen = []

  def spy(op, axes, **call):
    seen.append((op, axes, call["compressor"]))
    return fused_comms.unsupported(op, axes, **call)

  _backend.set_fused_check(spy)
  x = _data(mesh, jnp.float32, cols=64)
  comp = _CANNOT["stochastic"][0]
  _one_op(mesh, "all_gather", comp, "auto").trace(x)
  assert seen == [("all_gather", ("x",), comp)]


@pytest.mark.parametrize(
  "op", ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "ppermute"]
)
def test_vmap_is_one_fused_call_bitwise_a_loop(op):
  """The batching rule maps a vmapped batch to more rows of one engine call (no sequential
  loop of calls), with each element's bits as on its own."""
  mesh = _mesh((4,), ("x",))
  jcoccl.init(mesh)
  comp = jc.int8(block_size=32)
  kw = dict(compressor=comp, backend="fused", min_bytes=0, chunks=2)
  call = {
    "all_reduce": lambda v: jcoccl.all_reduce(v, "x", algorithm="two_shot", **kw),
    "all_gather": lambda v: jcoccl.all_gather(v, "x", tiled=True, **kw),
    "reduce_scatter": lambda v: jcoccl.reduce_scatter(v, "x", tiled=True, **kw),
    "all_to_all": lambda v: jcoccl.all_to_all(v, "x", 0, 0, tiled=True, **kw),
    "ppermute": lambda v: jcoccl.ppermute(v, "x", _perm(4), **kw),
  }[op]
  x = jax.device_put(
    jax.random.normal(jax.random.key(3), (4, 3, 8, 40), jnp.float32),
    jax.NamedSharding(mesh, jax.P("x")),
  )
  smap = lambda body: jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=jax.P("x"), out_specs=jax.P("x"))
  )
  batched = smap(lambda v: jax.vmap(call)(v[0])[None])
  hlo = batched.lower(x).compile().as_text()
  assert hlo.count(f'custom_call_target="jcoccl_fused_{op}"') == 1
  got = batched(x)
  single = smap(lambda v: call(v[0])[None])
  for i in range(3):
    np.testing.assert_array_equal(
      np.asarray(got[:, i]).view(np.uint32), np.asarray(single(x[:, i])).view(np.uint32)
    )

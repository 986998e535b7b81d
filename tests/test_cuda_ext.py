"""The CUDA extension's host side on the CPU (tools/cuda_ext.py): cuda/gpu/*.cu, the NCCL
transport and the fused engine compiled unchanged against the host shim (streams with
worker threads, events) and an NCCL emulation over threads; the CUDA FFI handlers run as
XLA:CPU targets behind an adaptor that models XLA's stream and device memory.

Every op x algorithm x codec family runs through the CUDA codec handlers (backend "xla")
and through the CUDA fused engine over emulated NCCL (backend "fused"), bit-identical to
jcoccl's CPU paths; seeded host-side bugs (mutant builds) must each be caught."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jcoccl
from jcoccl import compressors as jc
from jcoccl._src.engine import fused_comms, fused_ffi
from jcoccl._src.native import _ffi

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import cuda_ext  # noqa: E402
import cuda_ext_check  # noqa: E402
import gpu_shim  # noqa: E402
from test_fused import ALL_OPS, _bits, _data, _mesh, _program  # noqa: E402

pytestmark = pytest.mark.skipif(
  gpu_shim.compiler() is None or _ffi.native_module("cpu") is None,
  reason="needs a C++ compiler and jcoccl._cpu",
)

_mutants: dict[str, object] = {}


def _build_mutants() -> None:
  try:
    _mutants["lib"] = cuda_ext.build(mutants=True)
  except Exception as e:  # reported by the test that needs it
    _mutants["error"] = e


@pytest.fixture(scope="module")
def ext():
  # The mutant library builds alongside the clean one (one compile per core).
  t = threading.Thread(target=_build_mutants)
  t.start()
  _mutants["thread"] = t
  # A real libnccl.so.2 (the nvidia-nccl wheel, where installed) loaded globally first, as
  # jcoccl does for jcoccl._cuda: the transport must still find the emulation.
  _ffi._preload_nccl()
  lib = cuda_ext.CudaExt(cuda_ext.build())
  yield lib
  t.join()


@pytest.fixture(autouse=True)
def _clean():
  fused_comms.shutdown()
  yield
  fused_comms.shutdown()


def _cpu_path(mesh, backend, run):
  """run() through jcoccl's CPU paths, then through the CUDA extension; both results."""
  if backend == "fused":
    jcoccl.init(mesh)
  want = jax.block_until_ready(run())
  fused_comms.shutdown()
  return want


def _compare(ext, mesh, backend, make):
  """make() builds a fresh program (jit caches must not mix the two target sets)."""
  want = _cpu_path(mesh, backend, lambda: make())
  with cuda_ext.use(ext):
    if backend == "fused":
      jcoccl.init(mesh)
    got = jax.block_until_ready(make())
  for i, (g, w) in enumerate(zip(got, want)):
    assert g.shape == w.shape and g.dtype == w.dtype, i
    np.testing.assert_array_equal(_bits(g), _bits(w), err_msg=f"output {i}: CUDA path != CPU path")


_CODECS = {
  "int8": (jc.int8(block_size=32), jnp.float32, 2),
  "int4": (jc.int4(block_size=32, symmetric=False), jnp.bfloat16, 2),
  "fp8": (jc.fp8("e4m3", block_size=32), jnp.float16, 1),
  "hadamard": (jc.hadamard(jc.int4(block_size=32)), jnp.float32, 1),
  "error_bounded": (jc.error_bounded(1e-2, block_size=32), jnp.float32, 2),
  "spike": (jc.spike(jc.int4(block_size=32), k=2), jnp.bfloat16, 2),
}


def test_cuda_ext_loads_the_nccl_emulation_and_every_cuda_handler(ext):
  assert ext.nccl_version() == 99999  # nccl.cc's dlopen found the emulation, not a real NCCL
  names = set(ext.handlers())
  assert {
    "jcoccl_encode_rows",
    "jcoccl_decode_rows",
    "jcoccl_decode_sum",
    "jcoccl_decode_sum_encode",
    "jcoccl_fused_all_reduce",
    "jcoccl_fused_reduce_scatter",
    "jcoccl_fused_all_gather",
    "jcoccl_fused_all_to_all",
    "jcoccl_fused_ppermute",
  } <= names


@pytest.mark.parametrize("backend", ["xla", "fused"])
@pytest.mark.parametrize("codec", sorted(_CODECS))
def test_cuda_ext_op_matrix_matches_cpu(ext, codec, backend):
  # Every algorithm of the five ops, on 4 ranks: one_shot, two_shot, reduce_scatter,
  # all_gather, all_to_all, ppermute.
  comp, dtype, chunks = _CODECS[codec]
  mesh = _mesh((4,), ("x",))
  x = _data(mesh, dtype, seed=11)
  _compare(ext, mesh, backend, lambda: _program(mesh, "x", comp, backend, chunks, ALL_OPS)(x))


@pytest.mark.parametrize("backend", ["xla", "fused"])
def test_cuda_ext_eight_ranks_with_nan_and_inf(ext, backend):
  mesh = _mesh((8,), ("x",))
  x = _data(mesh, jnp.float32, nonfinite=True, seed=2)
  comp = jc.int8(block_size=64)
  _compare(ext, mesh, backend, lambda: _program(mesh, "x", comp, backend, 2, ALL_OPS)(x))


@pytest.mark.parametrize("backend", ["xla", "fused"])
def test_cuda_ext_hierarchical_two_codecs(ext, backend):
  mesh = _mesh((2, 2), ("node", "gpu"))
  x = _data(mesh, jnp.float32, seed=5)
  axes = ("node", "gpu")
  levels = (jc.int4(block_size=32), jc.int8(block_size=32))

  def make():
    def body(v):
      return (
        jcoccl.all_reduce(
          v,
          axes,
          compressor=levels,
          algorithm="hierarchical",
          backend=backend,
          chunks=2,
          min_bytes=0,
        ),
      )

    spec = jax.P(axes)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))(x)

  _compare(ext, mesh, backend, make)


@pytest.mark.parametrize(
  "kinds",
  [cuda_ext.KERNELS, cuda_ext.COPIES | cuda_ext.XLA_INPUTS, cuda_ext.COLLECTIVES],
  ids=["kernels", "copies_and_inputs", "collectives"],
)
def test_cuda_ext_delay_mode_keeps_results(ext, kinds):
  # Stretched queued work reorders what runs when across the lanes; the events must keep
  # every result the same.
  mesh = _mesh((2,), ("x",))
  x = _data(mesh, jnp.float32, seed=4)
  comp = jc.fp8("e5m2", block_size=32)
  want = _cpu_path(mesh, "fused", lambda: _program(mesh, "x", comp, "fused", 2, ALL_OPS)(x))
  with cuda_ext.use(ext):
    jcoccl.init(mesh)
    ext.set_delay(kinds, 3000)
    got = jax.block_until_ready(_program(mesh, "x", comp, "fused", 2, ALL_OPS)(x))
  for g, w in zip(got, want):
    np.testing.assert_array_equal(_bits(g), _bits(w))


def test_cuda_ext_two_axis_mesh_under_every_delay(ext):
  # Hierarchical all_reduce (two communicators on one comm lane, the outer level fed from
  # the decode lane), two_shot on one axis and a partial ppermute on the other, bfloat16,
  # 3 slices, with every kind of queued work stretched.
  mesh = _mesh((2, 2), ("node", "gpu"))
  axes = ("node", "gpu")
  x = _data(mesh, jnp.bfloat16, seed=5)
  levels = (jc.int4(block_size=32), jc.fp8("e5m2", block_size=32))
  kw = dict(backend="fused", chunks=3, min_bytes=0)

  def make():
    def body(v):
      return (
        jcoccl.all_reduce(v, axes, compressor=levels, algorithm="hierarchical", **kw),
        jcoccl.all_reduce(v, "gpu", compressor=levels[0], algorithm="two_shot", **kw),
        jcoccl.ppermute(v, "node", [(0, 1)], compressor=levels[1], **kw),
      )

    spec = jax.P(axes)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))(x)

  want = _cpu_path(mesh, "fused", make)
  with cuda_ext.use(ext):
    jcoccl.init(mesh)
    ext.set_delay(
      cuda_ext.KERNELS | cuda_ext.COPIES | cuda_ext.COLLECTIVES | cuda_ext.XLA_INPUTS, 2000
    )
    got = jax.block_until_ready(make())
  for g, w in zip(got, want):
    np.testing.assert_array_equal(_bits(g), _bits(w))


def test_cuda_ext_handlers_return_before_their_collectives_run(ext):
  # The return gate holds every NCCL operation a fused handler queues until that handler has
  # returned: a handler that waited on the host for its collective would be reported (the
  # seeded host_wait bug below is). int8 and the identity codec (NCCL's own collectives),
  # bit-identical to the CPU path.
  cuda_ext_check.scenario_no_host_wait(ext)


def test_cuda_ext_capturing_stream_is_refused_clearly(ext):
  # The fused handlers are not CUDA-graph safe and XLA is told so; a stream found capturing
  # anyway gets an error that says so, not a hang or a broken graph.
  mesh = _mesh((2,), ("x",))
  x = _data(mesh, jnp.float32, seed=6)
  comp = jc.int8(block_size=32)
  with cuda_ext.use(ext):
    jcoccl.init(mesh)
    ext.set_capturing(0, True)
    ext.set_capturing(1, True)
    try:
      with pytest.raises(Exception, match="not capture-safe"):
        jax.block_until_ready(_program(mesh, "x", comp, "fused", 1, ("one_shot",))(x))
    finally:
      ext.set_capturing(0, False)
      ext.set_capturing(1, False)


def test_cuda_ext_plain_nccl_ops_match_the_host_transport(ext):
  # ncclAllReduce / ncclReduceScatter (float32 sums; the emulation folds in rank order, as
  # the host transport does) and ncclAllGather of bfloat16 bytes, with NaN and Inf.
  n, k, m = 4, 2, 48
  mesh = _mesh((n,), ("x",))
  rng = np.random.default_rng(8)
  xh = rng.standard_normal((n * k, n, m)).astype(np.float32)
  xh[0, :, 3], xh[1, :, 5] = np.nan, np.inf
  x = jax.device_put(jnp.asarray(xh), jax.NamedSharding(mesh, jax.P("x")))

  def make():
    cid = fused_comms._state.comms[("x",)]

    def call(op, v, shape):
      return fused_ffi.engine_call(op, "plain", v, shape, cid, n, None, k, m, platform="cpu")

    def body(v):
      row = v[:, 0]
      return (
        call("all_reduce", row, (k, m)),
        call("reduce_scatter", v, (k, m)),
        call("all_gather", row.astype(jnp.bfloat16), (k, n, m)),
      )

    spec = jax.P("x")
    f = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
    return jax.jit(f)(x)

  _compare(ext, mesh, "fused", make)


def _lonely_call(ext, cid):
  """A one_shot all_reduce on rank 0 of a 2-rank emulated NCCL communicator whose rank 1
  never comes."""
  ext.nccl_comm_init(cid, ext.nccl_unique_id(), 2, [(0, 0), (1, 1)])
  f = jax.jit(
    lambda v: fused_ffi.engine_call(
      "all_reduce", "one_shot", v, v.shape, cid, 2, jc.int8(block_size=32), 1, 32, platform="cpu"
    )
  )
  return f, jax.device_put(jnp.ones((1, 32), jnp.float32), jax.devices()[0])


def test_cuda_ext_lost_peer_is_aborted_by_the_watchdog_and_reported_next(ext):
  # The handler returns at once; the communicator's watchdog aborts it after the traced
  # timeout_s (which frees the blocked stream, so nothing hangs), and the next call on the
  # communicator fails with the reason, before it queues anything.
  cid = 10**12 + 99
  with cuda_ext.use(ext):
    f, x = _lonely_call(ext, cid)
    try:
      with jcoccl.config(timeout_s=0.5):
        start = time.monotonic()
        jax.block_until_ready(f(x))  # outputs undefined: the collective was aborted
        assert time.monotonic() - start < 30
        with pytest.raises(Exception, match="did not finish within") as e:
          jax.block_until_ready(f(x + 1))
      assert "was aborted" in str(e.value) and "shim found" not in str(e.value)
      with pytest.raises(Exception, match="did not finish within"):
        jax.block_until_ready(f(x + 2))
    finally:
      ext.fused_comm_destroy(cid)


def test_cuda_ext_destroying_a_communicator_aborts_its_work_in_flight(ext):
  # As on the host transport (tests/test_fused.py): jcoccl.shutdown while a collective waits
  # for a peer aborts it at once, not after the timeout (300 s by default).
  cid = 10**12 + 98
  with cuda_ext.use(ext):
    f, x = _lonely_call(ext, cid)
    destroyed = []
    timer = threading.Timer(1.0, lambda: destroyed.append(ext.fused_comm_destroy(cid)))
    start = time.monotonic()
    timer.start()
    try:
      jax.block_until_ready(f(x))  # returns once the destroy aborted the blocked stream
      with pytest.raises(Exception, match="has no communicator"):
        jax.block_until_ready(f(x + 1))
    finally:
      timer.join()
      ext.fused_comm_destroy(cid)
  assert destroyed == [2]
  assert time.monotonic() - start < 30


SEEDED = [
  ("stream_wait", "no_stream_wait"),
  ("event_reuse", "event_reuse"),
  ("join_on_error", "no_join_on_error"),
  ("workspace", "workspace_short"),
  ("group", "group_unbalanced"),
  ("no_host_wait", "host_wait"),
]


@pytest.fixture(scope="module")
def seeded_run(ext) -> subprocess.CompletedProcess:
  """Every scenario without, then with its seeded bug, in one process with the mutant build
  (its handlers cannot be registered beside the clean ones in this one)."""
  _mutants["thread"].join()
  assert "error" not in _mutants, _mutants.get("error")
  return subprocess.run(
    [sys.executable, "tools/cuda_ext_check.py", "seeded", *[f"{s}={m}" for s, m in SEEDED]],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )


@pytest.mark.parametrize("scenario, mutation", SEEDED)
def test_cuda_ext_seeded_host_bug_is_caught(ext, seeded_run, scenario, mutation):
  # The scenario holds for the shipped sources (here, in this process) and fails for a
  # copy with the bug (the mutant build, after it held there with the bug switched off).
  cuda_ext_check.SCENARIOS[scenario](ext)
  r = seeded_run
  assert f"CAUGHT {scenario}:" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
  assert "CLEAN FAILED" not in r.stdout and "MISSED" not in r.stdout and r.returncode == 0, (
    r.stdout[-3000:] + r.stderr[-3000:]
  )

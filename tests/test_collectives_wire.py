"""Wire bytes from compiled HLO, and bad calls raising clear errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from collectives_util import P, mesh, per_rank, rand
from jax import lax
from jax.sharding import Mesh

import jcoccl
from jcoccl import compressors as jc
from jcoccl._src import _compat


def _prog(m, body):
  return jax.jit(jax.shard_map(body, mesh=m, in_specs=P("x"), out_specs=P()))


def test_wire_bytes_ratios_8_ranks():
  m = mesh((8,), ("x",))
  x = jax.ShapeDtypeStruct((8, 1 << 20), jnp.float32)  # 8 ranks x 1M f32 (4 MiB) each
  ref = _prog(m, lambda v: lax.psum(v[0], "x"))
  lax_wb = jcoccl.wire_bytes(ref, x)
  assert lax_wb["total"] == pytest.approx(2 * 7 / 8 * 4 * (1 << 20))

  def ar(c, algorithm):
    return _prog(
      m, lambda v: jcoccl.all_reduce(v[0], "x", compressor=c, algorithm=algorithm, min_bytes=0)
    )

  int8_two = jcoccl.wire_bytes(ar(jc.int8(block_size=256), "two_shot"), x, reference=ref)
  int8_one = jcoccl.wire_bytes(ar(jc.int8(block_size=256), "one_shot"), x, reference=ref)
  int4_two = jcoccl.wire_bytes(ar(jc.int4(block_size=128), "two_shot"), x, reference=ref)
  auto = jcoccl.wire_bytes(ar(jc.int8(block_size=256), "auto"), x, reference=ref)
  assert int8_two["ratio"] <= 0.27, int8_two
  assert int4_two["ratio"] <= 0.14, int4_two
  assert int8_two["total"] < int8_one["total"]
  assert auto["total"] == int8_two["total"]  # 4 MiB on 8 ranks: the model picks two_shot
  assert set(int8_two["by_op"]) == {"all-to-all", "all-gather"}
  assert set(int8_one["by_op"]) == {"all-gather"}


def test_wire_bytes_other_ops():
  m = mesh((4,), ("x",))
  x = jax.ShapeDtypeStruct((4, 4096), jnp.float32)
  c = jc.int8(block_size=256)
  spec = dict(mesh=m, in_specs=P("x"), out_specs=P("x"))
  ag = jax.jit(
    jax.shard_map(
      lambda v: jcoccl.all_gather(v, "x", tiled=True, compressor=c, min_bytes=0), **spec
    )
  )
  ag_ref = jax.jit(jax.shard_map(lambda v: lax.all_gather(v, "x", tiled=True), **spec))
  wb = jcoccl.wire_bytes(ag, x, reference=ag_ref)
  assert wb["reference_total"] == 3 * 4096 * 4
  assert wb["ratio"] == pytest.approx((1 + 4 / 256) / 4)
  pp = jax.jit(
    jax.shard_map(
      lambda v: jcoccl.ppermute(v, "x", [(0, 1), (1, 0)], compressor=c, min_bytes=0), **spec
    )
  )
  wb = jcoccl.wire_bytes(pp, x)
  assert wb["by_op"]["collective-permute"] == pytest.approx(4096 * (1 + 4 / 256) * 2 / 4)


AXES3 = ("data", "tensor", "pipe")


def _mesh_2x2x2_permuted() -> Mesh:
  # Device ids differ from the logical ids in the HLO: the matching must go through the
  # executable's device assignment.
  devs = np.array(jax.devices()[:8])[[3, 1, 7, 5, 2, 0, 6, 4]].reshape(2, 2, 2)
  return Mesh(devs, AXES3)


def _axes_program(m, k, c):
  """One collective on each axis of the mesh and one on ('data', 'tensor')."""
  kw = {} if c is None else {"compressor": c, "min_bytes": 0}
  ar = {} if c is None else {"algorithm": "one_shot"}

  def body(v):
    v = v[0]
    a = jcoccl.all_reduce(v, "data", **kw, **ar)
    g = jcoccl.all_gather(v * 2, "tensor", tiled=True, **kw)
    p = jcoccl.ppermute(v * 3, "pipe", [(0, 1), (1, 0)], **kw)
    t = jcoccl.all_reduce(v * 4, ("data", "tensor"), **kw, **ar)
    return (a + g[:k] + p + t)[None]

  return jax.jit(jax.shard_map(body, mesh=m, in_specs=P(AXES3), out_specs=P(AXES3)))


@pytest.mark.parametrize("program", ["compiled", "lowered"])
def test_wire_bytes_by_axis_2x2x2(program):
  # "lowered" reads the device assignment from the lowering instead of compiling: the same
  # axes must come out on a mesh whose device ids are not the logical ids.
  m, k = _mesh_2x2x2_permuted(), 4096
  x = jax.ShapeDtypeStruct((8, k), jnp.float32)
  c = jc.int8(block_size=256)
  wb = jcoccl.wire_bytes(
    _axes_program(m, k, c), x, reference=_axes_program(m, k, None), mesh=m, program=program
  )
  s = 4 * k  # f32 bytes per device
  # nccl-tests formulas, exactly: psum 2(n-1)/n S, all_gather (n-1)/n S (gathered), ppermute S
  # (every device sends), psum over the 4 devices of ('data', 'tensor').
  assert wb["reference_by_axis"] == {
    "data": s,
    "tensor": s,
    "pipe": s,
    "data,tensor": 2 * 3 / 4 * s,
  }
  # Compressed: one_shot all_reduce = all_gather of payloads, (n-1) payloads per device.
  pay = c.payload_nbytes(k, jnp.float32)
  assert wb["by_axis"] == {"data": pay, "tensor": pay, "pipe": pay, "data,tensor": 3 * pay}
  assert wb["total"] == sum(wb["by_axis"].values())
  assert {c["axes"] for c in wb["collectives"]} == {
    ("data",),
    ("tensor",),
    ("pipe",),
    ("data", "tensor"),
  }


def test_lowered_device_ids_are_the_executables():
  m = _mesh_2x2x2_permuted()
  lowered = _axes_program(m, 256, None).lower(jax.ShapeDtypeStruct((8, 256), jnp.float32))
  ids = _compat.lowered_device_ids(lowered)
  assert ids == _compat.executable_device_ids(lowered.compile())
  assert ids == [3, 1, 7, 5, 2, 0, 6, 4]


def test_wire_bytes_mesh_on_other_axis_orders():
  # The same program on a mesh whose axes are listed in another order: keys follow mesh order.
  devs = np.array(jax.devices()[:8]).reshape(2, 2, 2)
  m = Mesh(devs, ("pipe", "data", "tensor"))
  f = jax.jit(
    jax.shard_map(
      lambda v: lax.psum(v, ("tensor", "pipe")),
      mesh=m,
      in_specs=P(m.axis_names),
      out_specs=P(m.axis_names),
    )
  )
  wb = jcoccl.wire_bytes(f, jax.ShapeDtypeStruct((8, 256), jnp.float32), mesh=m)
  assert wb["by_axis"] == {"pipe,tensor": 2 * 3 / 4 * 1024}
  with pytest.raises(TypeError, match="mesh"):
    jcoccl.wire_bytes(f, jax.ShapeDtypeStruct((8, 256), jnp.float32), mesh="data")


_HLO = """HloModule m, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (p: (s32[], f32[256])) -> (s32[], f32[256]) {
  %p = (s32[], f32[256]{0}) parameter(0)
  %v = f32[256]{0} get-tuple-element(%p), index=1
  %i = s32[] get-tuple-element(%p), index=0
  %r = f32[256]{0} all-reduce(%v), channel_id=1, replica_groups=[4,2]<=[2,2,2]T(1,2,0), use_global_device_ids=true, to_apply=%add
  ROOT %t = (s32[], f32[256]{0}) tuple(%i, %r)
}

%cond (q: (s32[], f32[256])) -> pred[] {
  %q = (s32[], f32[256]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x: f32[256]) -> f32[256] {
  %x = f32[256]{0} parameter(0)
  %e = f32[256]{0} all-reduce(%x), channel_id=2, replica_groups={{0,1},{2,3},{4,5},{6,7}}, use_global_device_ids=true, to_apply=%add
  %o = f32[256]{0} all-reduce(%e), channel_id=3, replica_groups={{0,3},{1,2},{4,7},{5,6}}, use_global_device_ids=true, to_apply=%add
  %g = f32[1024]{0} all-gather(%o), channel_id=4, replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true
  %cs = (f32[256]{0}, f32[256]{0}) collective-permute-start(%o), channel_id=5, source_target_pairs={{0,4},{4,0},{1,5},{5,1}}
  %cd = f32[256]{0} collective-permute-done(%cs)
  %z = s32[] constant(0)
  %t0 = (s32[], f32[256]{0}) tuple(%z, %cd)
  %w = (s32[], f32[256]{0}) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %out = f32[256]{0} get-tuple-element(%w), index=1
}
"""


def test_parse_hlo_group_forms_loops_and_unmatched():
  from jcoccl._src.observability import wire_bytes as wb_mod

  m = mesh((2, 2, 2), AXES3)  # logical id i = row-major mesh position i
  colls = wb_mod.parse_hlo(_HLO, 8, mesh=m, device_ids=[d.id for d in m.devices.flat])
  got = [(c["op"], c["axes"], c["executions"], c["sent_bytes"]) for c in colls]
  s = 1024
  assert sorted(got, key=str) == sorted(
    [
      # iota groups [2,2,2]T(1,2,0) -> [4,2]: ids varying along 'data', in a loop of 3
      ("all-reduce", ("data",), 3, 3 * s),
      ("all-reduce", ("pipe",), 1, s),  # explicit {{0,1},...}: 'pipe'
      ("all-reduce", "?", 1, s),  # {{0,3},...} is no set of mesh axes
      ("all-gather", ("tensor", "pipe"), 1, 3 / 4 * 4 * s),  # [2,4]<=[8]
      ("collective-permute", ("data",), 1, s * 4 / 8),  # async pair, counted once
    ],
    key=str,
  )
  assert wb_mod.by_axis(colls) == {"data": 3 * s + s / 2, "pipe": s, "?": s, "tensor,pipe": 3 * s}
  with pytest.raises(ValueError, match="replica groups"):
    wb_mod.parse_hlo(_HLO.replace("replica_groups=[2,4]<=[8]", "replica_groups=<bad>"), 8)


def _run1(body, n=4, shape=(4, 64)):
  m = mesh((n,), ("x",))
  return per_rank(m, body, rand((n, *shape), jnp.float32))


@pytest.mark.parametrize(
  "body,exc,match",
  [
    (lambda v: jcoccl.all_reduce(v, "nope", compressor="int8"), ValueError, "nope"),
    (
      lambda v: jcoccl.all_reduce(v, "x", compressor="int8", algorithm="ring"),
      ValueError,
      "algorithm",
    ),
    (lambda v: jcoccl.all_reduce(v, "x", compressor="int8", backend="mpi"), ValueError, "backend"),
    (lambda v: jcoccl.all_reduce(v, "x", compressor="int8", chunks=0), ValueError, "chunks"),
    (lambda v: jcoccl.all_reduce(v, "x", compressor="zip"), ValueError, "compressor"),
    (lambda v: jcoccl.all_reduce(v, "x", compressor=3), TypeError, "compressor"),
    (
      lambda v: jcoccl.all_reduce(v, "x", compressor="int8", algorithm="hierarchical"),
      ValueError,
      "hierarchical",
    ),
    (lambda v: jcoccl.all_reduce(v, "x", compressor="int8", min_bytes=-1), ValueError, "min_bytes"),
    (
      lambda v: jcoccl.reduce_scatter(v, "x", scatter_dimension=1, tiled=True, compressor="int8"),
      ValueError,
      "scatter_dimension",
    ),
    (
      lambda v: jcoccl.reduce_scatter(v, "x", scatter_dimension=1, compressor="int8"),
      ValueError,
      "tiled=False",
    ),
    (lambda v: jcoccl.reduce_scatter(v, "x", scatter_dimension=5), ValueError, "scatter_dimension"),
    (lambda v: jcoccl.all_gather(v, "x", axis=3, compressor="int8"), ValueError, "axis"),
    (
      lambda v: jcoccl.all_to_all(v, "x", 1, 0, tiled=True, compressor="int8"),
      ValueError,
      "split_axis",
    ),
    (lambda v: jcoccl.ppermute(v, "x", [(0, 1), (0, 2)]), ValueError, "duplicate source"),
    (lambda v: jcoccl.ppermute(v, "x", [(0, 1), (2, 1)]), ValueError, "duplicate destination"),
    (lambda v: jcoccl.ppermute(v, "x", [(0, 4)]), ValueError, "out of range"),
    (
      lambda v: jcoccl.all_gather(v.astype(jnp.int32), "x", compressor="int4", min_bytes=0),
      TypeError,
      "int32",
    ),
  ],
)
def test_bad_calls(body, exc, match):
  with pytest.raises(exc, match=match):
    _run1(body, shape=(6, 63))


def test_fused_backend_without_init():
  from jcoccl._src.native import _backend

  if "fused" in _backend.registered("all_reduce"):
    pytest.skip("fused engine initialised in this process")
  with pytest.raises(ValueError, match="init"):
    _run1(lambda v: jcoccl.all_reduce(v, "x", compressor="int8", backend="fused"))


def test_wire_bytes_of_a_traced_program_reads_its_executable(caplog):
  """A program traced once (``jit(f).trace(x)``), compiled and run, then measured: no second
  compile of it, and the same counts as from the function and its arguments."""
  m = mesh((4,), ("x",))
  x = rand((4, 4096), jnp.float32)
  c = jc.int8(block_size=256)
  body = lambda v: jcoccl.all_reduce(v[0], "x", compressor=c, min_bytes=0)
  traced = _prog(m, body).trace(x)
  traced.lower().compile()(x)
  ref = _prog(m, lambda v: lax.psum(v[0], "x"))
  with jax.log_compiles(True), caplog.at_level("WARNING"):
    got = jcoccl.wire_bytes(traced, reference=ref.trace(x), mesh=m)
  compiles = [
    r.getMessage() for r in caplog.records if "Finished XLA compilation" in r.getMessage()
  ]
  assert len(compiles) == 1, compiles  # the reference's, compiled here for the first time
  want = jcoccl.wire_bytes(_prog(m, body), x, reference=ref, mesh=m)
  assert got["total"] == want["total"] and got["by_axis"] == want["by_axis"]
  assert got["ratio"] == want["ratio"] < 1 and got["choices"] == want["choices"]
  with pytest.raises(TypeError, match="a jax.stages.Traced, which holds its arguments"):
    jcoccl.wire_bytes(traced, x)
  with pytest.raises(TypeError, match="reference must be a jax.stages.Traced when fn is one"):
    jcoccl.wire_bytes(traced, reference=ref)

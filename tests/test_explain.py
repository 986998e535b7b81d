"""jcoccl.explain (every collective of a program and why), its command line, and the
SkippedCompression warning for a named codec dropped by the default min_bytes."""

import warnings

import jax
import jax.numpy as jnp
import pytest
from collectives_util import mesh

import jcoccl
from jcoccl import __main__ as cli
from jcoccl._src.base import cost_model as cm
from jcoccl._src.compressors import threshold

# A calibrated model where the exact op is much faster than compressing (one process).
IN_PROCESS = cm.CostModel(5e-5, 10e9, 2e9, "test", 1e-4, exact_alpha_s=5e-5, exact_beta_Bps=10e9)


@pytest.fixture(scope="module")
def m8():
  return mesh((8,), ("x",))


def _body(v):
  a = jax.lax.psum(v, "x")
  b = jcoccl.all_reduce({"i": v.astype(jnp.int32), "w": v}, "x", compressor="int8", min_bytes=0)
  c = jcoccl.all_reduce(v, "x", compressor="auto:int8", min_bytes=0)
  d = jcoccl.all_reduce(v, "x", compressor="int8", min_bytes=1 << 20)
  return a + b["w"] + c + d


def _program(m):
  return jax.jit(jax.shard_map(_body, mesh=m, in_specs=jax.P("x"), out_specs=jax.P("x")))


def test_explain_lists_each_leaf_and_why(m8):
  f, x = _program(m8), jnp.ones((8, 256), jnp.float32)
  before = str(jax.make_jaxpr(f)(x))  # traced already: explain must trace again
  rows = jcoccl.explain(f, x)
  assert [(r.kind, r.op) for r in rows] == [("jcoccl", "all_reduce")] * 4 + [("lax", "psum")]
  ints, floats, opted, small, lax_row = rows
  assert (ints.used, ints.algorithm, ints.dtype) == ("none", "exact", "int32")
  assert "dtype int32" in ints.why
  # int8 on 8 ranks, uncalibrated: two_shot, one_shot would send more than psum.
  assert (floats.named, floats.used, floats.algorithm) == ("int8", "int8", "two_shot")
  assert "never sends more bytes" in floats.why and "not calibrated" in floats.cost_model
  assert [name for name, _ in floats.predicted_s] == ["one_shot", "two_shot"]
  assert opted.named == "auto:int8" and "requested auto_exact" in opted.why
  assert small.used == "none" and "min_bytes" in small.why and "(given)" in small.why
  assert small.nbytes == 1024 and small.shape == (1, 256)
  assert "jcoccl.compress" in lax_row.why
  assert "two_shot" in str(rows) and "psum" in str(rows)
  assert str(jax.make_jaxpr(f)(x)) == before  # normal programs are unchanged


def test_explain_reports_a_calibrated_decision_and_vmap_axes(m8):
  f, x = _program(m8), jnp.ones((8, 256), jnp.float32)
  with jcoccl.config(cost_model=IN_PROCESS):
    rows = jcoccl.explain(f, x)
  opted = rows[2]
  assert (opted.used, opted.algorithm) == ("none", "exact")
  assert "calibrated" in opted.cost_model and "not calibrated" not in opted.cost_model
  times = dict(opted.predicted_s)
  assert times["exact"] * cm.EXACT_MARGIN <= min(t for k, t in times.items() if k != "exact")
  assert rows[1].used == "int8"  # named without the opt-in: used, calibration or not
  g = jax.vmap(lambda v: jcoccl.all_reduce(v, "b", compressor="int8", min_bytes=0), axis_name="b")
  (row,) = jcoccl.explain(g, jnp.ones((2, 16)))
  assert row.used == "none" and "jax.vmap axis" in row.why


def test_explain_lists_compiler_inserted_collectives(m8):
  sh = jax.NamedSharding
  a = jax.device_put(jnp.ones((64, 64)), sh(m8, jax.P(None, "x")))
  b = jax.device_put(jnp.ones((64, 64)), sh(m8, jax.P("x", None)))
  g = jax.jit(lambda a, b: a @ b, out_shardings=sh(m8, jax.P()))
  (row,) = jcoccl.explain(g, a, b, mesh=m8)
  assert (row.kind, row.axes) == ("compiler", "x") and row.nbytes > 0
  assert "inserted by the compiler" in row.why
  with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
    jcoccl.explain(g, a, b, mesh="x")


def _cli_target():
  m = mesh((8,), ("x",))
  return _program(m), (jnp.ones((8, 256), jnp.float32),)


def test_explain_command_line(capsys):
  assert cli.main(["explain", "test_explain:_cli_target"]) == 0
  out = capsys.readouterr().out
  assert out.splitlines()[0].split()[:3] == ["kind", "op", "axes"] and "two_shot" in out
  with pytest.raises(SystemExit):
    cli.main(["explain", "test_explain"])


def test_default_min_bytes_warns_once_per_op_and_axes(m8):
  threshold._SKIP_WARNED.clear()

  def body(v):
    tree = {"a": v, "b": v * 2, "c": v * 3}  # three small leaves: one warning
    out = jcoccl.all_reduce(tree, "x", compressor="int8")
    given = jcoccl.all_reduce(v, ("x",), compressor="int8", min_bytes=1 << 20)  # asked for
    return out["a"] + given

  f = jax.jit(jax.shard_map(body, mesh=m8, in_specs=jax.P("x"), out_specs=jax.P("x")))
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    jax.make_jaxpr(f)(jnp.ones((8, 64), jnp.float32))
    jax.make_jaxpr(f)(jnp.ones((8, 32), jnp.float32))  # a second trace: said already
    threshold._SKIP_WARNED.clear()
    with jcoccl.config(min_bytes=1 << 20):  # a threshold the user set: no warning
      jax.make_jaxpr(f)(jnp.ones((8, 16), jnp.float32))
  got = [w for w in seen if issubclass(w.category, jcoccl.SkippedCompression)]
  assert len(got) == 1, [str(w.message) for w in got]
  msg = str(got[0].message)
  assert "all_reduce over ('x',)" in msg and "int8" in msg and "256 B" in msg
  assert "4194304 B" in msg and "min_bytes=0" in msg and "jcoccl.config(min_bytes" in msg
  # The one documented process default (the README's): not a second spelling of it.
  assert "jcoccl.set_config_defaults(min_bytes=...)" in msg and "set_default_min" not in msg
  assert got[0].filename == __file__  # points at the caller's line

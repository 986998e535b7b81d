"""Error feedback as an output of the compressed collectives (``residual=``): the residual
the op returns is bit for bit the separate round trip error feedback used to compute,
without a second encode, and a leaf that goes exactly carries its residual forward."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from collectives_util import LOSSY, P, bits, mesh, rand
from jax import lax

import jcoccl
from jcoccl._src.base import cost_model as cm
from jcoccl._src.compressors import layout as L

N = 4


def _old_residual(g, e, comp, rows_of, layout_unit, chunks):
  """The residual as jcoccl.error_feedback computed it before the ops returned it (its
  code written out): y = g + e; y's rows padded as the collective pads them, encoded and
  decoded again; e' = (y - decode(encode(y))) + ((g + e) - y), non-finite as 0."""
  e = jnp.where(jnp.isfinite(e), e, jnp.zeros_like(e))
  y = (g.astype(jnp.float32) + e).astype(g.dtype)
  rows, back = rows_of(y)
  lay = L.RowLayout.of(rows.shape[1], layout_unit, chunks)
  padded = lay.pad(rows)
  sent = back(lay.unpad(comp.decode_rows(comp.encode_rows(padded), lay.padded, rows.dtype)))
  new = (y.astype(jnp.float32) - sent.astype(jnp.float32)) + (
    (g.astype(jnp.float32) + e) - y.astype(jnp.float32)
  )
  return y, jnp.where(jnp.isfinite(new), new, jnp.zeros_like(new))


def _flat(y):
  return L.flat_row(y)[None], lambda r: r[0].reshape(y.shape)


def _scatter(y):
  rows, block = L.to_rows(y, 0, N)
  return rows, lambda r: r.reshape((N * block[0],) + tuple(block[1:]))


# (op, algorithm, codec, dtype, chunks, leaf shapes): pytrees of several leaves are packed
# into one chain by the op, so the residual is cut back out of the packed rows.
CASES = {
  "one_shot-int8-f32": ("all_reduce", "one_shot", "int8", jnp.float32, 1, [(1000,)]),
  "two_shot-had4-bf16-k2": ("all_reduce", "two_shot", "had_int4", jnp.bfloat16, 2, [(40, 33)]),
  "two_shot-fp8-packed": ("all_reduce", "two_shot", "fp8", jnp.float32, 1, [(300,), (7, 9), (64,)]),
  "scatter-int4a-packed": ("reduce_scatter", None, "int4a", jnp.float32, 1, [(8, 50), (4, 3)]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_residual_is_the_old_round_trip_bit_for_bit(case):
  op, algo, codec, dtype, chunks, shapes = CASES[case]
  comp = LOSSY[codec]
  m = mesh((N,), ("x",))
  ef = jcoccl.error_feedback(comp)
  gs = [rand((N,) + s, dtype, seed=i) for i, s in enumerate(shapes)]
  es = [rand((N,) + s, jnp.float32, seed=10 + i, scale=0.01) for i, s in enumerate(shapes)]
  es[0] = es[0].at[1, 3].set(jnp.nan)  # read as 0

  def body(gs, es):
    gs, es = [g[0] for g in gs], [e[0] for e in es]
    if op == "all_reduce":
      kw = dict(algorithm=algo, chunks=chunks, min_bytes=0)
      out, new = ef.all_reduce(gs, es, "x", **kw)
      unit = comp.granule * (N if algo == "two_shot" else 1)
      old = [_old_residual(g, e, comp, _flat, unit, chunks) for g, e in zip(gs, es)]
      plain = jcoccl.all_reduce([y for y, _ in old], "x", compressor=comp, **kw)
    else:
      out, new = ef.reduce_scatter(gs, es, "x", tiled=True, min_bytes=0)
      old = [_old_residual(g, e, comp, _scatter, comp.granule, chunks) for g, e in zip(gs, es)]
      ys = [y for y, _ in old]
      plain = jcoccl.reduce_scatter(ys, "x", tiled=True, compressor=comp, min_bytes=0)
    lift = lambda vs: [v[None] for v in vs]
    return lift(out), lift(new), lift(plain), lift([r for _, r in old])

  spec = P("x")
  f = jax.jit(jax.shard_map(body, mesh=m, in_specs=spec, out_specs=spec))
  out, new, plain, old = f(gs, es)
  for a, b in zip(out, plain):  # what was sent is g + e, as before
    np.testing.assert_array_equal(bits(a), bits(b))
  for a, b in zip(new, old):
    assert a.dtype == jnp.float32 and np.any(np.asarray(a))
    np.testing.assert_array_equal(bits(a), bits(b))


def _model(link_Bps, exact_Bps, codec_Bps=2e9):
  """A calibrated model (as tests/test_calibrate.py's): compressed link, exact op, codec."""
  return cm.CostModel(
    5e-5, link_Bps, codec_Bps, "test", 1e-4, exact_alpha_s=5e-5, exact_beta_Bps=exact_Bps
  )


def test_an_exact_leaf_carries_its_residual_forward():
  """A leaf under min_bytes, and every leaf where calibrated auto_exact keeps the lax op,
  is sent as it is (the lax op's bits) and hands back the residual it was given, the same
  array (no operation on it, not even the non-finite check); the compressed leaf keeps
  what its encoder lost."""
  m = mesh((N,), ("x",))
  ef = jcoccl.error_feedback("int8")
  seen = {}

  def body(g, e, algorithm):
    grads = {"big": g[0], "small": g[0, :8]}
    state = {"big": e[0], "small": e[0, :8]}
    out, new = ef.all_reduce(grads, state, "x", min_bytes=64, algorithm=algorithm)
    seen[algorithm] = {k: new[k] is state[k] for k in new}
    exact = lax.psum(grads, "x")
    return jax.tree.map(lambda v: v[None], (out, new, exact))

  g = rand((N, 1024), jnp.float32, seed=3)
  e = rand((N, 1024), jnp.float32, seed=4, scale=0.01).at[2, 5].set(jnp.nan)
  for algorithm, model in (("auto", None), ("auto_exact", _model(10e9, 10e9))):
    f = jax.jit(
      jax.shard_map(lambda g, e: body(g, e, algorithm), mesh=m, in_specs=P("x"), out_specs=P("x"))
    )
    with jcoccl.config(cost_model=model):
      out, new, exact = f(g, e)
    carried = ["small"] if algorithm == "auto" else ["big", "small"]
    assert [k for k, same in seen[algorithm].items() if same] == sorted(carried)
    for k in carried:
      np.testing.assert_array_equal(bits(out[k]), bits(exact[k]))
      np.testing.assert_array_equal(bits(new[k]), bits(e[:, : new[k].shape[1]]))
    if algorithm == "auto":
      assert np.isfinite(np.asarray(new["big"])).all() and np.any(np.asarray(new["big"]))


def test_the_residual_costs_one_decode_not_a_second_encode():
  """Codec passes in the program: the plain op's, plus one decode of the payload sent."""
  m = mesh((N,), ("x",))
  ef = jcoccl.error_feedback("int4")

  def passes(fn):
    f = jax.jit(jax.shard_map(fn, mesh=m, in_specs=P("x"), out_specs=P("x")))
    text = f.lower(jnp.ones((N, 4096)), jnp.zeros((N, 4096))).as_text()
    return re.findall(r"custom_call @jcoccl_(\w+)", text)  # the native codec calls

  kw = dict(algorithm="two_shot", min_bytes=0)
  fed = passes(lambda g, e: jnp.stack(ef.all_reduce(g[0], e[0], "x", **kw))[None])
  plain = passes(lambda g, e: jcoccl.all_reduce(g[0], "x", compressor="int4", **kw)[None] + e)
  if not plain:  # jnp codecs (no native module): no custom calls to count
    pytest.skip("the codecs lower to jnp here")
  assert fed.count("encode_rows") == plain.count("encode_rows") == 1
  assert fed.count("decode_rows") == plain.count("decode_rows") + 1


def test_the_sent_value_is_computed_once():
  """In the compiled program the residual owed is read by one instruction: ``g + e`` is
  computed once and read by both the encode and the new residual. XLA otherwise fuses it
  into each, so a gradient assembled from per-layer pieces is written out piece by piece
  (this doubled the error-feedback step's memory traffic in benchmarks/train_e2e.py)."""
  m = mesh((N,), ("x",))
  ef = jcoccl.error_feedback("int8")

  def body(w, a, e):
    g = jnp.stack([a[0, i] * w[0, i] for i in range(4)])[None]  # a stacked leaf's gradient
    return ef.all_reduce(g, e, "x", algorithm="one_shot", min_bytes=0)

  spec = (P("x"),) * 3
  f = jax.jit(jax.shard_map(body, mesh=m, in_specs=spec, out_specs=(P("x"), P("x"))))
  s = jax.ShapeDtypeStruct((N, 4, 256, 64), jnp.float32)
  text = f.lower(s, s, s).compile().as_text()
  entry = re.search(r"^ENTRY .*?\n(.*?)^}", text, re.S | re.M).group(1)
  owed = re.search(r"%(\S+) = \S+ parameter\(2\)", entry).group(1)
  readers = [l for l in entry.splitlines() if re.search(rf"%{re.escape(owed)}[,)]", l)]
  assert len(readers) == 1, readers


def test_residual_argument_errors():
  m = mesh((N,), ("x",))

  def run(fn):
    return jax.jit(jax.shard_map(fn, mesh=m, in_specs=P("x"), out_specs=P("x")))(jnp.ones((N, 256)))

  with pytest.raises(ValueError, match="residual must have the structure of x"):
    run(lambda g: jcoccl.all_reduce([g], "x", compressor="int8", residual=(g, g))[0][0])
  with pytest.raises(ValueError, match=r"residual: leaf 0 has shape \(128,\), x's has \(256,\)"):
    run(
      lambda g: jcoccl.reduce_scatter(
        g[0], "x", tiled=True, compressor="int8", residual=g[0, :128]
      )[0]
    )
  with pytest.raises(ValueError, match="backend='fused' returns no encoder residual"):
    run(
      lambda g: jcoccl.all_reduce(
        g, "x", compressor="int8", min_bytes=0, backend="fused", residual=g
      )[0]
    )


def test_residuals_state_across_steps():
  """jcoccl.residuals: the stacked state, placed on a data x model mesh, carried between
  jitted steps, reproduces bit for bit the residuals a loop inside one shard_map keeps
  (error_feedback().init), and each device's block is what its spec says."""
  m = mesh((2, 2), ("data", "model"))
  grads = {"w": rand((8, 6), jnp.float32, seed=5), "b": rand((6,), jnp.float32, seed=6)}
  specs = {"w": P(None, "model"), "b": P()}
  state = jcoccl.residuals.init(grads, m, "data", specs)
  assert state["w"].shape == (2, 8, 6) and state["b"].shape == (2, 6)
  assert state["w"].sharding.spec == P(("data",), None, "model")
  # Over every axis (each device its own residual), a dimension the axes split is divided.
  every = jcoccl.residuals.init(grads, m, ("data", "model"), specs)
  assert every["w"].shape == (4, 8, 3) and every["b"].shape == (4, 6)
  ef = jcoccl.error_feedback("int4")
  kw = dict(algorithm="two_shot", min_bytes=0)
  g_specs = {"w": P(None, "model"), "b": P()}
  e_specs = jax.tree.map(lambda e: e.sharding.spec, state)  # P(('data',), None, 'model'), ...

  def step(g, s):
    out, new = ef.all_reduce(g, jcoccl.residuals.local(s), "data", **kw)
    return out, jcoccl.residuals.stacked(new)

  f = jax.jit(
    jax.shard_map(step, mesh=m, in_specs=(g_specs, e_specs), out_specs=(g_specs, e_specs))
  )

  def loop(g):
    e = ef.init(g)
    outs = []
    for _ in range(3):
      out, e = ef.all_reduce(g, e, "data", **kw)
      outs.append(out)
    return outs, jcoccl.residuals.stacked(e)

  want_outs, want_e = jax.jit(
    jax.shard_map(loop, mesh=m, in_specs=(g_specs,), out_specs=([g_specs] * 3, e_specs))
  )(grads)
  for want in want_outs:
    out, state = f(grads, state)
    for k in grads:
      np.testing.assert_array_equal(bits(out[k]), bits(want[k]))
  for k in grads:
    assert np.any(np.asarray(state[k]))
    np.testing.assert_array_equal(bits(state[k]), bits(want_e[k]))


def test_residuals_errors():
  m = mesh((2, 2), ("data", "model"))
  x = {"w": jnp.zeros((6, 4))}
  with pytest.raises(ValueError, match=r"axes: \('pod',\) are not axes of the mesh"):
    jcoccl.residuals.init(x, m, "pod")
  with pytest.raises(ValueError, match=r"specs\['w'\]: .* more entries than the leaf's rank 2"):
    jcoccl.residuals.init(x, m, "data", {"w": P(None, None, "model")})
  with pytest.raises(ValueError, match=r"specs\['w'\]: \('tp',\) are not axes of the mesh"):
    jcoccl.residuals.init(x, m, "data", {"w": P("tp")})
  with pytest.raises(ValueError, match=r"specs\['w'\]: dimension 0 \(6\) does not split over"):
    jcoccl.residuals.init({"w": jnp.zeros((6, 4))}, mesh((4,), ("data",)), "data", {"w": P("data")})
  with pytest.raises(ValueError, match="specs: not one PartitionSpec per leaf"):
    jcoccl.residuals.init(x, m, "data", {"v": P()})
  with pytest.raises(ValueError, match=r"not one device's slice \(1, \.\.\.\)"):
    jcoccl.residuals.local({"w": jnp.zeros((2, 4))})

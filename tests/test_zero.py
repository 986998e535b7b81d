"""ZeRO data parallelism (recipe ``[data] zero = true``) in the 3D-parallel trainer: the same
training steps as plain data parallelism with compression off, an optimizer state sharded
over 'data', and a compressed reduce_scatter (jcoccl's one-shot all-to-all) on the wire."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tiny_models import batch as _batch
from tiny_models import tiny_gpt as _gpt
from tiny_models import tiny_qwen as _qwen

import jcoccl
from jcoccl.policy import Policy
from models.parallel import Parallel3D, make_mesh
from models.recipe import Recipe

LR = 1e-2


def _tx():
  return optax.adamw(LR, b1=0.9, b2=0.95, weight_decay=0.1)


def _train(make, mesh, table, micro, steps=2, clip_norm=1.0):
  """``steps`` AdamW steps (clipped to ``clip_norm``) from the model's weights:
  (par, params, opt_state, error-feedback residuals, last metrics)."""
  model = make()  # fresh per run: the step donates the parameters, which alias the model's
  par = Parallel3D(model, mesh, Recipe.from_dict(table), n_micro=micro)
  params = par.placement.shard(model)
  opt, ef, tx = par.init_opt(_tx(), params), par.grad_sync.init_ef(params), _tx()
  step = par.train_step(tx, params, clip_norm=clip_norm)
  for i in range(steps):
    params, opt, ef, m = step(params, opt, ef, *_batch(seed=i))
    assert np.isfinite(float(m["loss"])) and np.isfinite(float(m["grad_norm"]))
  return par, params, opt, ef, m


def _ids(cases):
  return [f"{c[0]}-{'x'.join(map(str, c[2]))}" for c in cases]


# Two data ranks: the only arithmetic in which the two modes differ is the data-axis sum of
# the gradients (psum vs psum_scatter), and a sum of two float32 terms is the same in either
# order (IEEE addition commutes). Everything else (each rank's gradients, AdamW's elementwise
# update) is the same computation on the same values, so the steps are equal bit for bit on
# any CPU. Clipping is off: its scale comes from the global norm, a sum of squares that the
# two modes associate differently.
EXACT_CASES = [("gpt", _gpt, (2, 2, 2), 2), ("qwen", lambda: _qwen(layers=4), (2, 1, 4), 1)]


@pytest.mark.parametrize("name,make,mesh,micro", EXACT_CASES, ids=_ids(EXACT_CASES))
def test_zero_steps_equal_plain_data_parallel(name, make, mesh, micro):
  mesh = make_mesh(*mesh)
  plain, want, opt_plain, _, m_plain = _train(make, mesh, {}, micro, clip_norm=None)
  zero, got, opt_zero, _, m_zero = _train(
    make, mesh, {"data": {"zero": True}}, micro, clip_norm=None
  )
  assert zero.zero and not plain.zero
  assert float(m_zero["loss"]) == float(m_plain["loss"])
  # The norm: a float32 sum of K non-negative squares, associated differently; relative
  # difference at most 2 (K - 1) 2^-24 for the sum, half of it for the square root.
  k = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(want))
  np.testing.assert_allclose(
    float(m_zero["grad_norm"]), float(m_plain["grad_norm"]), rtol=k * 2.0**-24
  )
  for (path, w), g in zip(jax.tree_util.tree_flatten_with_path(want)[0], jax.tree.leaves(got)):
    assert g.shape == w.shape and g.sharding == w.sharding, jax.tree_util.keystr(path)
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=jax.tree_util.keystr(path))
  _assert_state_sharded(zero, plain, opt_zero, opt_plain)


# More data ranks: psum and psum_scatter may associate a sum of D > 2 terms differently, and
# AdamW divides by sqrt(v) + eps, which turns a last-bit difference in a gradient near zero
# into any difference up to the step size, so the runs are compared by what holds on any CPU.
# One such mesh: 8 data ranks (the most padding per shard). ZeRO across pipe stages runs in
# the cases above (pipe 2 and 4) and over 2 nodes x 2 data ranks in tests/test_zeropp.py.
SHARD_CASES = [("qwen", _qwen, (8, 1, 1), 1)]


@pytest.mark.parametrize("name,make,mesh,micro", SHARD_CASES, ids=_ids(SHARD_CASES))
def test_zero_state_sharded_over_more_data_ranks(name, make, mesh, micro):
  mesh = make_mesh(*mesh)
  plain, want, opt_plain, _, m_plain = _train(make, mesh, {}, micro, steps=1)
  zero, got, opt_zero, _, m_zero = _train(make, mesh, {"data": {"zero": True}}, micro, steps=1)
  assert zero.zero and not plain.zero
  # The loss comes before the update, from the same weights, summed over 'data' by the same
  # exact all_reduce in both modes: D float32 terms, association aside.
  d = mesh.shape["data"]
  np.testing.assert_allclose(
    float(m_zero["loss"]), float(m_plain["loss"]), rtol=2 * (d - 1) * 2.0**-24
  )
  # One AdamW step from w0 moves a weight by lr * (g / (|g| + eps) + wd * w0), at most
  # lr * (1 + wd |w0|), plus the float32 roundings of the update and of w0 - update: a shard
  # written to the wrong rank or offset lands a weight far outside that.
  model = make()
  start = Parallel3D(model, mesh, Policy()).placement.shard(model)
  for (path, w0), w, g in zip(
    jax.tree_util.tree_flatten_with_path(start)[0], jax.tree.leaves(want), jax.tree.leaves(got)
  ):
    assert g.shape == w.shape and g.sharding == w.sharding, jax.tree_util.keystr(path)
    w0, w, g = (np.asarray(a, np.float64) for a in (w0, w, g))
    reach = (
      LR * (1 + 0.1 * np.abs(w0))
      + 4 * np.spacing(np.float32(LR))
      + np.spacing(np.abs(w0).astype(np.float32))
    )
    for run in (w, g):
      assert np.all(np.abs(run - w0) <= reach), jax.tree_util.keystr(path)
  _assert_state_sharded(zero, plain, opt_zero, opt_plain)


def _assert_state_sharded(zero, plain, opt_zero, opt_plain):
  """Each moment leaf, and each float32 master shard, holds ceil(n/data) values per device
  where plain DP holds n (the parameter)."""
  d = zero.n_data
  per_device = lambda t: sum(a.addressable_shards[0].data.size for a in jax.tree.leaves(t))
  assert set(opt_zero) == {"master", "tx"}
  for zs, ps in [
    (getattr(opt_zero["tx"][0], m), getattr(opt_plain[0], m)) for m in ("mu", "nu")
  ] + [(opt_zero["master"], opt_plain[0].mu)]:
    for (path, p), z in zip(jax.tree_util.tree_flatten_with_path(ps)[0], jax.tree.leaves(zs)):
      n = p.addressable_shards[0].data.size
      assert z.ndim == 1 and "data" in z.sharding.spec[0], jax.tree_util.keystr(path)
      assert {s.data.shape for s in z.addressable_shards} == {(-(-n // d),)}
    # Padding adds under one element per leaf and rank.
    n_leaves = len(jax.tree.leaves(ps))
    assert per_device(ps) / d <= per_device(zs) < per_device(ps) / d + n_leaves


COMPRESSED = {
  "data": {"zero": True, "reduce_scatter": "int8", "error_feedback": True, "min_bytes": 0}
}


def test_compressed_reduce_scatter_all_to_all_and_fewer_bytes():
  mesh, tx, (x, y) = make_mesh(2, 2, 2), _tx(), _batch()

  def compile_step(table):
    model = _gpt()
    par = Parallel3D(model, mesh, Recipe.from_dict(table), n_micro=2)
    params = par.placement.shard(model)
    args = (params, par.init_opt(tx, params), par.grad_sync.init_ef(params), x, y)
    # Unclipped, so that the exact step is the ZeRO program of the gpt-2x2x2 equality test
    # above and the compressed one that of the next test: each compiles once.
    return par, par.train_step(tx, params, clip_norm=None), args

  _, step, args = compile_step(COMPRESSED)
  hlo = step.lower(*args).compile().as_text()
  assert re.search(r"\ball-to-all\b", hlo)  # jcoccl's one-shot reduce_scatter
  rows = [r for r in jcoccl.explain(step, *args) if r.kind == "jcoccl" and r.axes == ("data",)]
  assert {r.op for r in rows} == {"reduce_scatter", "all_gather", "all_reduce"}
  # The only all_reduces left on 'data' are the exact scalar loss and norm.
  assert all(r.shape == () and r.named == "none" for r in rows if r.op == "all_reduce")
  _, exact_step, exact_args = compile_step({"data": {"zero": True}})
  got, ref = _data_bytes(step, args, mesh), _data_bytes(exact_step, exact_args, mesh)
  assert set(got) == {"all-to-all", "all-gather", "all-reduce"}
  assert set(ref) == {"reduce-scatter", "all-gather", "all-reduce"}
  # Parameters are gathered exactly in both; the gradients go as int8 (1/4 of float32, plus
  # a scale per block and the block padding of this tiny model's small leaves).
  assert got["all-gather"] == ref["all-gather"] > 0
  assert 0 < got["all-to-all"] < 0.5 * ref["reduce-scatter"], (got, ref)
  total = jcoccl.wire_bytes(step, *args, mesh=mesh)["by_axis"]["data"]
  assert (
    total
    == sum(got.values())
    < jcoccl.wire_bytes(exact_step, *exact_args, mesh=mesh)["by_axis"]["data"]
  )


def _data_bytes(step, args, mesh):
  """Bytes each device sends on 'data' per step, by HLO op."""
  out = {}
  for c in jcoccl.wire_bytes(step, *args, mesh=mesh)["collectives"]:
    if c["axes"] == ("data",):
      out[c["op"]] = out.get(c["op"], 0) + c["sent_bytes"]
  return out


def test_compressed_zero_with_error_feedback_trains():
  _, params, _, ef, _ = _train(_gpt, make_mesh(2, 2, 2), COMPRESSED, 2, clip_norm=None)
  # One residual per device of the flat, padded gradient that is reduce-scattered.
  for e, p in zip(jax.tree.leaves(ef), jax.tree.leaves(params)):
    local = p.addressable_shards[0].data.size
    assert e.shape == (8, local + local % 2), (e.shape, p.shape)
  assert any(float(jnp.abs(e).max()) > 0 for e in jax.tree.leaves(ef))


def test_recipe_zero_option(tmp_path):
  r = Recipe.from_dict({"data": {"zero": True, "reduce_scatter": "int4"}})
  assert r.zero and not Recipe.from_dict({"data": {"reduce_scatter": "int4"}}).zero
  assert "zero" in r.describe()
  assert Recipe.from_specs(["data.zero=true"]).zero
  f = tmp_path / "p.toml"
  f.write_text("[data]\nzero = true\n")
  assert Recipe.from_toml(str(f)).zero
  with pytest.raises(TypeError, match="'zero'.*must be a bool"):
    Recipe.from_dict({"data": {"zero": "yes"}})
  with pytest.raises(ValueError, match="zero must be true or false"):
    Recipe.from_specs(["data.zero=maybe"])
  # One data rank: nothing to shard, plain data parallelism.
  assert not Parallel3D(_gpt(), make_mesh(1, 2, 2), Recipe.from_dict({"data": {"zero": True}})).zero

"""ZeRO++ in models.parallel: qwZ (weights all-gathered through a lossy compressor, float32
master shards updated by AdamW), hpZ (``[data] nodes``: parameters gathered across nodes once
per step into each node's secondary shard, then inside the node) and qgZ (gradients
reduce-scattered inside the node, then across nodes, each level with its own compressor)."""

import functools
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P
from test_train import TINY, _restore
from test_zero import _batch, _gpt, _train, _tx

import jcoccl
from models import train
from models.parallel import NODE, Parallel3D, make_mesh
from models.recipe import Recipe

U = 2.0**-24  # float32 unit roundoff


def _master_full(par, master, params, fn):
  """``fn(shard) -> (values, bounds)`` on each rank's master shard, both gathered in shard
  order into every parameter's local shape (inside shard_map; lax, exact)."""

  def local(master, params):
    def leaf(s, x):
      vals, bound = fn(s)
      for axis in (NODE, "data"):  # shard index = data * nodes + node: node is minor
        vals = lax.all_gather(vals, axis, tiled=True)
        bound = lax.all_gather(bound, axis, tiled=True)
      cut = lambda a: a[: x.size].reshape(x.shape)
      return cut(vals), cut(bound)

    pairs = jax.tree.map(leaf, master, params)
    is_pair = lambda t: isinstance(t, tuple)
    return (
      jax.tree.map(lambda t: t[0], pairs, is_leaf=is_pair),
      jax.tree.map(lambda t: t[1], pairs, is_leaf=is_pair),
    )

  f = par.placement.shard_map(local, (par.shards.specs(), par.specs), (par.specs, par.specs))
  return jax.jit(f)(master, params)


# ---- qwZ ---------------------------------------------------------------------------------

# Lossless all_gather: the policy's "none" (jcoccl's lax path) and the none() compressor
# (raw bytes through the payload path).
EXACT_GATHER = ["none", jcoccl.compressors.none()]


@functools.cache
def _zero_run():
  """The ZeRO run that qwZ with either exact gather must reproduce, trained once."""
  return _train(_gpt, make_mesh(2, 1, 2), {"data": {"zero": True}}, 2, clip_norm=None)


@pytest.mark.slow
@pytest.mark.parametrize("gather", EXACT_GATHER, ids=["none", "none()"])
def test_qwz_exact_equals_zero_step(gather):
  # Two data ranks as two nodes: every sum is of two float32 terms, the same in any order,
  # so the ZeRO++ layout (master shards, node level) must reproduce the ZeRO step bit for
  # bit (which equals plain data parallelism: tests/test_zero.py; clipping off for the same
  # reason).
  mesh = make_mesh(2, 1, 2)
  table = {"data": {"zero": True, "nodes": 2, "all_gather": gather, "min_bytes": 0}}
  pp, got, opt, _, m = _train(_gpt, mesh, table, 2, clip_norm=None)
  assert pp.data_axes == (NODE, "data") and pp.sizes[NODE] == 2
  _, want, opt_ref, _, m_ref = _zero_run()
  assert float(m["loss"]) == float(m_ref["loss"])
  for (path, w), g in zip(
    jax.tree_util.tree_flatten_with_path((want, opt_ref))[0], jax.tree.leaves((got, opt))
  ):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=jax.tree_util.keystr(path))
  # The parameters are exactly the gathered master shards.
  full, _ = _master_full(pp, opt["master"], got, lambda s: (s, jnp.zeros_like(s)))
  for g, f in zip(jax.tree.leaves(got), jax.tree.leaves(full)):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(f))


# 2 nodes x 2 data ranks (x 2 pipe stages): int8 weights (qwZ, hpZ), int4 gradients (qgZ).
ZEROPP = {
  "data": {
    "zero": True,
    "nodes": 2,
    "all_gather": "int8",
    "reduce_scatter": "int4",
    "error_feedback": True,
    "min_bytes": 0,
  }
}


def test_qwz_int8_weights_within_the_compressor_bound():
  """After each step the model's weights are the master shards through the int8 all_gather
  (whatever the gradients went through: the step is test_hpz_...'s, compiled once for both).

  Bound: the across-node gather quantizes each master shard s once, |Q1(s) - s| <=
  eb(s) (jcoccl's error_bound, per element, from the compressor's blocks of s); a second
  level (inside the node, when it has more than one rank) quantizes the gathered secondary
  shard y = Q1(...) again, |Q2(y) - y| <= eb(y). So |w - master| <= eb(s) + eb(y).
  """
  par, params, opt, _, _ = _train(_gpt, make_mesh(4, 1, 2), ZEROPP, 2)
  c = par.coll.compressor(NODE, "all_gather")
  two_levels = par.sizes["data"] > 1
  assert two_levels

  def q(s):
    return c.decode(c.encode(s))

  def bounds(s):
    b = c.error_bound(s)
    if two_levels:
      # The secondary shard is node-gathered: rank k's part of it is Q1 of shard k, and it
      # is re-quantized inside the node in the compressor's blocks of the whole secondary.
      y, by = lax.all_gather(q(s), NODE, tiled=True), lax.all_gather(b, NODE, tiled=True)
      b2 = c.error_bound(y)
      k = s.size
      mine = lambda a: lax.dynamic_slice_in_dim(a, lax.axis_index(NODE) * k, k)
      b = mine(by) + mine(b2)
    return s, b

  master, bound = _master_full(par, opt["master"], params, bounds)
  moved = False
  for (path, w), m, b in zip(
    jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(master), jax.tree.leaves(bound)
  ):
    w, m, b = (np.asarray(a, np.float64) for a in (w, m, b))
    assert np.all(np.abs(w - m) <= b), jax.tree_util.keystr(path)
    assert np.all(b < 0.05 * np.abs(m).max() + 1e-30), jax.tree_util.keystr(path)
    moved |= bool(np.any(w != m))
  assert moved  # the weights are quantized, the master shards are not


# ---- hpZ ---------------------------------------------------------------------------------


def _by_axis_op(step, args, mesh):
  out = {}
  for c in jcoccl.wire_bytes(step, *args, mesh=mesh)["collectives"]:
    key = (",".join(c["axes"]), c["op"])
    out[key] = out.get(key, 0) + c["sent_bytes"]
  return out


def _chain_payload(c, lens: list[int]) -> int:
  """Payload bytes of one all_gather chain of float32 rows ``lens`` under ``c``: rows
  shorter than a block in blocks fitted to the longest of them (``Compressor.fit``, as
  the lowering sends them beside the others), the rest in ``c``'s."""
  short = [n for n in lens if c.fit(n) != c]
  small = c.fit(max(short)) if short else c
  return sum((small if c.fit(n) != c else c).payload_nbytes(n, jnp.float32) for n in lens)


@pytest.mark.slow
def test_hpz_gathers_across_nodes_once_per_step():
  mesh = make_mesh(4, 1, 2)
  model = _gpt()
  par = Parallel3D(model, mesh, Recipe.from_dict(ZEROPP), n_micro=2)
  tx = _tx()
  params = par.placement.shard(model)
  args = (params, par.init_opt(tx, params), par.grad_sync.init_ef(params), *_batch())
  step = par.train_step(tx, params)
  got = _by_axis_op(step, args, par.mesh)
  k, l = par.sizes[NODE], par.sizes["data"]
  assert (k, l) == (2, 2)
  c = par.coll.compressor(NODE, "all_gather")
  specs = jax.tree.leaves(par.specs, is_leaf=lambda x: isinstance(x, P))
  lens = [par.shards.shard_len(p.shape, s) for p, s in zip(jax.tree.leaves(params), specs)]
  # One gather of each master shard's int8 payload across nodes (to k - 1 peers), and one
  # of each secondary shard (k master shards) inside the node (to l - 1 peers): per step.
  across = (k - 1) * _chain_payload(c, lens)
  inside = (l - 1) * _chain_payload(c, [k * n for n in lens])
  assert got[(NODE, "all-gather")] == across
  assert got[("data", "all-gather")] == inside
  # Nothing else moves over both levels at once; across nodes, the gradients travel as the
  # node's partial sums of 1/l of each leaf, so less than inside the node.
  assert not any("," in axes and ("data" in axes or NODE in axes) for axes, _ in got)
  assert 0 < got[(NODE, "all-to-all")] < got[("data", "all-to-all")]
  # qgZ's error feedback: a residual per level and device, of what that level scatters.
  params, _, ef, _ = step(*args)  # the executable wire_bytes compiled
  assert set(ef) == {"data", NODE}
  for e_in, e_out, p in zip(
    jax.tree.leaves(ef["data"]), jax.tree.leaves(ef[NODE]), jax.tree.leaves(params)
  ):
    n = -(-p.addressable_shards[0].data.size // 4) * 4
    assert e_in.shape == (8, n) and e_out.shape == (8, n // 2)
  for level in ef.values():
    assert any(float(jnp.abs(e).max()) > 0 for e in jax.tree.leaves(level))


# ---- qgZ ---------------------------------------------------------------------------------


def _scatter(table, x):
  """Parallel3D's hierarchical gradient reduce_scatter of ``x`` [ranks, m] over a 2 x 2
  (node x data) mesh: rank r = node * 2 + data holds x[r]; returns [ranks, m / 4] in shard
  order (data * 2 + node)."""
  par = Parallel3D(_gpt(), make_mesh(4, 1, 1), Recipe.from_dict(table))
  assert par.data_axes == (NODE, "data") and par.sizes[NODE] == par.sizes["data"] == 2
  f = par.placement.shard_map(
    lambda v: par.grad_sync.scatter({"g": v[0]}, None)[0]["g"][None],
    (P((NODE, "data")),),
    P(("data", NODE)),
  )
  return par, np.asarray(jax.jit(f)(jnp.asarray(x)))


def test_qgz_exact_levels_equal_plain_reduce_scatter():
  # Integer-valued float32 inputs: every partial sum is exact, so any association gives the
  # same bits as lax.psum_scatter over both axes.
  x = np.random.default_rng(0).integers(-1000, 1000, (4, 512)).astype(np.float32)
  par, got = _scatter({"data": {"zero": True, "nodes": 2}}, x)
  f = par.placement.shard_map(
    lambda v: lax.psum_scatter(v[0], ("data", NODE), tiled=True)[None],
    (P((NODE, "data")),),
    P(("data", NODE)),
  )
  want = np.asarray(jax.jit(f)(jnp.asarray(x)))
  np.testing.assert_array_equal(got, want)
  # ... which is the sum's slice data * 2 + node.
  np.testing.assert_array_equal(got.reshape(-1), x.sum(0))


@pytest.mark.parametrize("spec", ["int4", "int8"])
def test_qgz_quantizes_once_per_level_within_bound(spec):
  """Level 1 (inside node n): rank (n, d) quantizes its gradient x once, |Q(x) - x| <=
  eb(x); the node's partial sum of slice d, s, is quantized once at level 2, |Q(s) - s| <=
  eb(s). Float32 sums of j terms add at most (j - 1) u sum |terms|. So each element of the
  result is within sum eb(x) + sum eb(s) + (rounding) of the exact sum."""
  rng = np.random.default_rng(1)
  m = 2 * 2 * 256 * 2  # two int blocks per destination row at both levels
  x = (rng.standard_normal((4, m)) * rng.uniform(0.1, 10, (4, 1))).astype(np.float32)
  table = {"data": {"zero": True, "nodes": 2, "reduce_scatter": spec, "min_bytes": 0}}
  par, got = _scatter(table, x)
  c = par.coll.compressor("data", "reduce_scatter")
  q = lambda a: np.asarray(c.decode(c.encode(jnp.asarray(a))), np.float64)
  eb = lambda a: np.asarray(c.error_bound(jnp.asarray(a)), np.float64)
  x64 = x.astype(np.float64)
  exact = x64.sum(0).reshape(2, 2, -1)  # [data slice d, node sub-slice n, ...]
  chunk = lambda a: a.reshape(2, -1)  # the two destinations of one level
  bound = np.zeros_like(exact)
  for n in range(2):
    ranks = (2 * n, 2 * n + 1)
    # Level 1: every rank's own quantization of its gradient, and the float32 sum of two.
    b1 = sum(chunk(eb(x[r])) for r in ranks)
    s = sum(chunk(q(x[r])) for r in ranks)
    r1 = U * sum(np.abs(chunk(q(x[r]))) for r in ranks)
    for d in range(2):
      s_d = s[d].astype(np.float32)  # node n's partial sum of slice d, then split by node
      b2 = chunk(eb(s_d)) + chunk(U * np.abs(q(s_d)))  # quantized, then summed over 2 nodes
      bound[d] += chunk(b1[d] + r1[d]) + b2
  # The partial sum's own float32 rounding moves Q2's input by at most r1; its scale moves
  # with it: eb is rounded up by 2^-16, far above that relative change.
  got = got.reshape(2, 2, -1)
  err = np.abs(got - exact)
  assert np.all(err <= bound), float((err - bound).max())
  # Not exact: both levels quantized something.
  assert np.any(err > 0)


# ---- training ----------------------------------------------------------------------------


@pytest.mark.slow
def test_zeropp_run_loss_drops_and_resumes_bit_exactly(tmp_path):
  # 2 nodes x 2 data ranks x 2 pipe stages (bytes by axis: test_hpz_... above).
  common = TINY + [
    "--policy",
    "zeropp",
    "--mesh",
    "4,1,2",
    "--ckpt-every",
    "4",
    "--eval-every",
    "100",
    "--no-hlo-wire",
  ]
  a, b = tmp_path / "a", tmp_path / "b"
  summary = train.main(common + ["--steps", "8", "--out", str(a)])
  assert summary["loss_end"] < summary["loss_start"] - 0.3, summary
  shutil.copytree(a, b)
  shutil.rmtree(b / "ckpt" / "8")
  summary = train.main(common + ["--steps", "8", "--out", str(b), "--resume"])
  assert summary["resumed_from"] == 4 and summary["steps"] == 8
  ta, tb = _restore(a, 8), _restore(b, 8)
  # The checkpoint holds the float32 master shards (flat, over node and data) and both
  # levels' error-feedback residuals.
  assert all(
    x.ndim == 1 and {"data", NODE} <= set(x.sharding.spec[0])
    for x in jax.tree.leaves(ta["opt_state"]["master"])
  )
  assert set(ta["ef"]) == {"data", NODE}
  leaves_a, leaves_b = jax.tree.leaves(ta), jax.tree.leaves(tb)
  assert len(leaves_a) == len(leaves_b) > 10
  for x, y in zip(leaves_a, leaves_b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  loss = lambda run: [
    json.loads(l).get("loss")
    for l in (run / "metrics.jsonl").read_text().splitlines()
    if json.loads(l)["step"] == 8
  ][0]
  assert loss(a) == loss(b)


# ---- the recipe option -------------------------------------------------------------------


def test_nodes_option_checked(tmp_path):
  r = Recipe.from_dict(
    {"data": {"zero": True, "nodes": 2}, NODE: {"reduce_scatter": "int8"}},
    axes=("node", "data", "tensor", "pipe"),
  )
  assert r.nodes == 2 and "nodes=2" in r.describe()
  assert r.policy.compressor(NODE, "reduce_scatter") is not None
  assert Recipe.from_specs(["data.nodes=4"]).nodes == 4
  for value, err, match in [
    ("2", TypeError, "nodes'\\] must be a positive int"),
    (True, TypeError, "must be a positive int"),
    (0, ValueError, "must be a positive int"),
  ]:
    with pytest.raises(err, match=match):
      Recipe.from_dict({"data": {"nodes": value}})
  with pytest.raises(ValueError, match="nodes applies to the 'data' axis only"):
    Recipe.from_dict({"tensor": {"nodes": 2}})
  with pytest.raises(ValueError, match="nodes must be a positive integer"):
    Recipe.from_specs(["data.nodes=two"])
  # In the trainer: the node split needs ZeRO mode and must divide the data size.
  for text, flags, match in [
    ("nodes = 2", [], "needs \\[data\\] zero = true"),
    ("zero = true\nnodes = 3", ["--mesh", "4,1,2"], "nodes = 3 must divide the data size 4"),
  ]:
    f = tmp_path / "p.toml"
    f.write_text(f"[data]\n{text}\n")
    args = train.parse_args(["--policy", str(f), "--out", str(tmp_path / "r"), *flags])
    with pytest.raises(train.SetupError, match=match):
      train.load_policy(args)
  with pytest.raises(ValueError, match="must divide the data axis size 4"):
    Parallel3D(_gpt(), make_mesh(4, 1, 2), Recipe.from_dict({"data": {"zero": True, "nodes": 3}}))

"""3D-parallel (data x tensor x pipe) loss and gradients equal the single-device model's with
compression off, for GPT-2 and Qwen2 on several meshes; with the 'data' gradient sum compressed
they stay within the bound derived from the compressor's error_bound; the full lossy policy stays
finite and sends fewer bytes on every axis."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from collectives_util import F32_EPS, f64, sum_bound
from flax import nnx
from jax import lax
from tiny_models import batch as _batch
from tiny_models import tiny_gpt as _gpt
from tiny_models import tiny_qwen as _qwen

import jcoccl
from jcoccl import compressors as jc
from jcoccl.policy import Policy
from models.parallel import AXES, Collectives, Parallel3D, make_mesh, reference_loss_and_grads
from models.recipe import Recipe


def _assert_tree_close(got, want, rtol):
  """Each leaf within rtol of the largest gradient entry (a few leaves are ~0 by symmetry:
  e.g. the key bias, which softmax cancels)."""
  scale = max(float(jnp.abs(w).max()) for w in jax.tree.leaves(want))
  for (path, w), g in zip(jax.tree_util.tree_flatten_with_path(want)[0], jax.tree.leaves(got)):
    assert g.shape == w.shape, jax.tree_util.keystr(path)
    np.testing.assert_allclose(
      np.asarray(g), np.asarray(w), rtol=rtol, atol=rtol * scale, err_msg=jax.tree_util.keystr(path)
    )


CASES = [
  ("gpt", _gpt, (2, 2, 2), 2),
  ("qwen_untied", _qwen, (2, 2, 2), 2),
  ("qwen_tied", lambda: _qwen(True, layers=4), (2, 2, 2), 4),
  ("gpt", lambda: _gpt(layers=4), (1, 2, 4), 2),
  ("qwen_untied", _qwen, (4, 2, 1), 1),
  ("gpt", _gpt, (8, 1, 1), 1),
  ("qwen_untied", _qwen, (1, 1, 2), 2),
]


_REFERENCE = {}


@pytest.mark.parametrize(
  "name,make,mesh,micro", CASES, ids=[f"{c[0]}-{'x'.join(map(str, c[2]))}-m{c[3]}" for c in CASES]
)
def test_exact_matches_single_device(name, make, mesh, micro):
  model = make()
  x, y = _batch()
  if make not in _REFERENCE:  # one model's reference serves each of its meshes
    # One program: eagerly each of the ~140 ops compiles alone. The float32 difference
    # between jit and eager is far below the 1e-5 compared.
    _REFERENCE[make] = nnx.jit(reference_loss_and_grads)(model, x, y)
  want_loss, want = _REFERENCE[make]
  if (mesh, micro) == ((2, 2, 2), 2):
    # The exact run that the lossy tests below compare against (on this mesh, with a tap
    # that only copies the 'data' sum's inputs to the host): one compile for both.
    _, loss, grads = _exact_tapped(make)
  else:
    par = Parallel3D(model, make_mesh(*mesh), Policy(), n_micro=micro)
    loss, grads = par.loss_and_grads(par.placement.shard(model), x, y)
  np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
  _assert_tree_close(grads, want, 1e-5)


def _explained(model, policy):
  """``jcoccl.explain``'s records of ``Parallel3D.loss_and_grads`` on ``model`` (2x2x2 mesh,
  2 micro-batches, ``policy``), traced, not run. A Parallel3D of its own: the tapped runs'
  counters count their traces."""
  par = Parallel3D(model, make_mesh(2, 2, 2), policy, n_micro=2)
  return jcoccl.explain(lambda *a: par.loss_and_grads(*a), par.placement.shard(model), *_batch())


def test_every_collective_went_through_jcoccl_log():
  rows = _explained(_gpt(), Policy())  # GPT, mesh 2x2x2, 2 micro-batches, compression off
  assert not [r for r in rows if r.kind == "lax"]  # no collective bypassed jcoccl
  ops = {(r.axes[0], r.op) for r in rows}
  assert ops == {
    ("data", "all_reduce"),
    ("tensor", "all_reduce"),
    ("pipe", "ppermute"),
    ("pipe", "all_reduce"),
  }


LOSSY = {
  "data": {"all_reduce": "int8", "min_bytes": 0},
  "tensor": {"all_reduce": "fp8", "min_bytes": 0},
  "pipe": {"ppermute": "int8", "all_reduce": "int8", "min_bytes": 0},
}


# -- Lossy: only the 'data' gradient all_reduce compressed, error bound derived -------------------


class _DataTap(Collectives):
  """Collectives that also copy each device's input to the 'data' gradient all_reduce to the
  host (a debug callback) into ``seen[(call, data, tensor, pipe)]``; ``call`` numbers the
  leaves given to all_reduce on 'data' in trace order, which is the order of the gradient
  leaves."""

  def __init__(self, policy: Policy):
    super().__init__(policy)
    self.seen, self.calls, self._lock = {}, 0, threading.Lock()

  def all_reduce(self, x, axis, *, exact=False):
    if axis == "data" and not exact:
      for leaf in jax.tree.leaves(x):

        def record(d, t, p, v, call=self.calls):
          with self._lock:
            self.seen[(call, int(d), int(t), int(p))] = np.asarray(v)

        self.calls += 1
        jax.debug.callback(record, *(lax.axis_index(a) for a in AXES), leaf)
    return super().all_reduce(x, axis, exact=exact)


def _tapped_loss_and_grads(model, policy):
  """``Parallel3D.loss_and_grads`` on a 2x2x2 mesh, with the local gradients it sums over 'data'."""
  par = Parallel3D(model, make_mesh(2, 2, 2), policy, n_micro=2, collectives=_DataTap)
  loss, grads = par.loss_and_grads(par.placement.shard(model), *_batch())
  jax.block_until_ready(grads)
  jax.effects_barrier()
  return par, loss, grads


_EXACT_RUNS = {}


def _exact_tapped(make):
  """The exact-policy run of ``make()``'s model, once per model (it only depends on the model)."""
  if make not in _EXACT_RUNS:
    _EXACT_RUNS[make] = _tapped_loss_and_grads(make(), Policy())
  return _EXACT_RUNS[make]


def _sync_bound(par, c, name, call, t, p):
  """Exact float64 value and error bound of synced gradient leaf ``call`` on device (*, t, p).

  The device sums its 'data' group's local gradients g_r with a one_shot all_reduce: each rank
  encodes g_r once (error <= c.error_bound(g_r), on the flattened leaf as the collective pads
  it) and every rank decodes the n payloads and folds them in float32 in rank order:
  ``collectives_util.sum_bound`` = sum_r error_bound(g_r) + (n-1) eps32 sum_r (|g_r| +
  error_bound(g_r)) + the final cast. The exact path (c = none(), bound 0) is lax.psum, within
  the same fold term. The replicated 'outer' leaves are then summed exactly over 'pipe' (psum
  of P values C_s, each within B_s of its exact value S_s): sum_s B_s + (P-1) eps32 sum_s
  (|S_s| + B_s).
  """
  n = par.sizes["data"]
  stages = range(par.sizes["pipe"]) if name.startswith("['outer']") else [p]
  exact = bound = mag = 0.0
  for s in stages:
    gs = np.stack([par.coll.seen[(call, r, t, s)] for r in range(n)])
    b, total = sum_bound(c, jnp.asarray(gs), jnp.float32), f64(gs).sum(0)
    exact, bound, mag = exact + total, bound + b, mag + np.abs(total) + b
  return exact, bound + (len(stages) - 1) * F32_EPS * mag


def _per_device(par, c, grads):
  """(leaf name, device coordinates, got, exact, bound) for every device's copy of each leaf."""
  coords = {dev: tuple(int(i) for i in idx) for idx, dev in np.ndenumerate(par.mesh.devices)}
  for call, (path, leaf) in enumerate(jax.tree_util.tree_flatten_with_path(grads)[0]):
    name = jax.tree_util.keystr(path)
    bounds = {}  # the 'data' ranks of one (tensor, pipe) position share the exact sum and bound
    for shard in sorted(leaf.addressable_shards, key=lambda s: coords[s.device]):
      _, t, p = coords[shard.device]
      if (t, p) not in bounds:
        bounds[t, p] = _sync_bound(par, c, name, call, t, p)
      exact, bound = bounds[t, p]
      got = np.asarray(shard.data, np.float64)
      assert got.shape == exact.shape, (name, got.shape, exact.shape)
      yield name, coords[shard.device], got, exact, bound


def _assert_within(got, exact, bound, what):
  err = np.abs(got - exact)
  bad = ~(err <= bound)
  if bad.any():
    i = np.unravel_index(np.argmax(np.where(bad, err - bound, -np.inf)), err.shape)
    raise AssertionError(
      f"{what}: {bad.sum()} elements out of the derived bound; worst at "
      f"{i}: err {err[i]} vs bound {bound[i]}"
    )


# One codec per model: Parallel3D hands any codec to the same one_shot all_reduce, and the
# bound is derived from the codec's own error_bound (which tests/test_compressors.py checks
# for every codec, fp8 included).
@pytest.mark.slow
@pytest.mark.parametrize(
  "make,spec", [(_gpt, "int8"), (_qwen, "hadamard(int4)")], ids=["gpt-int8", "qwen-hadamard_int4"]
)
def test_data_grad_compression_within_derived_bound(make, spec):
  """Only the 'data' gradient all_reduce is lossy (one_shot, no error feedback): every
  device's copy of every gradient leaf is within the bound derived from the compressor's
  error_bound of the exact sum of the local gradients that this very run fed to it, and within
  that bound plus the exact run's rounding of the exact 3D-parallel gradients."""
  policy = Policy.from_dict({"data": {"all_reduce": spec, "min_bytes": 0, "algorithm": "one_shot"}})
  c = policy.compressor("data", "all_reduce")
  par, loss, grads = _tapped_loss_and_grads(make(), policy)
  ex, want_loss, want = _exact_tapped(make)
  n_leaves = len(jax.tree.leaves(grads))
  assert par.coll.calls == ex.coll.calls == n_leaves
  assert len(par.coll.seen) == len(ex.coll.seen) == n_leaves * 8
  assert {(r.axes[0], r.op) for r in _explained(make(), policy) if r.named != "none"} == {
    ("data", "all_reduce")
  }
  # Nothing before the gradient sync is compressed: the loss and every device's local
  # gradients are those of the exact run, bit for bit.
  assert float(loss) == float(want_loss)
  for key, g in par.coll.seen.items():
    np.testing.assert_array_equal(g, ex.coll.seen[key], err_msg=f"local gradient {key}")
  compressed = 0
  for (name, dev, got, exact, bound), (_, _, want_g, _, want_bound) in zip(
    _per_device(par, c, grads), _per_device(ex, jc.none(), want), strict=True
  ):
    what = f"{name} on device {dev}"
    _assert_within(got, exact, bound, f"{spec}: {what}")
    _assert_within(want_g, exact, want_bound, f"exact policy: {what}")
    # Same local gradients, so the two runs differ by at most the sum of their bounds.
    _assert_within(got, want_g, bound + want_bound, f"{spec} vs exact: {what}")
    compressed += int((np.abs(got - exact) > want_bound).sum())
  assert compressed > 0, "no element differs from an exact sum: was anything compressed?"


# -- Lossy: the full policy (every axis compressed) ----------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("make", [_gpt, _qwen], ids=["gpt", "qwen"])
def test_full_lossy_policy_finite_and_fewer_bytes(make):
  """Tensor fp8, pipe int8 and data int8 together. Compressed activations feed every later
  layer, so no error bound is derived for this policy (the data-gradient test above carries
  the bound); this check needs no tolerance: the compiled train step sends fewer bytes than
  the exact one on every mesh axis, and running it gives a finite loss and a finite global
  gradient norm (which a non-finite entry in any gradient would make inf or nan)."""
  import optax

  import jcoccl

  model, tx, (x, y) = make(), optax.sgd(0.1), _batch()
  lossy = Parallel3D(model, make_mesh(2, 2, 2), Policy.from_dict(LOSSY), n_micro=2)
  exact = Parallel3D(model, lossy.mesh, Policy(), n_micro=2)
  params = lossy.placement.shard(model)
  steps = {p: p.train_step(tx, params) for p in (lossy, exact)}
  args = {p: (params, p.init_opt(tx, params), None, x, y) for p in steps}
  got, ref = (jcoccl.wire_bytes(steps[p], *args[p], mesh=p.mesh)["by_axis"] for p in steps)
  assert set(got) == set(ref) == {"data", "tensor", "pipe"}
  for axis in got:
    assert 0 < got[axis] < 0.5 * ref[axis], (axis, got, ref)
  # The step that was measured, run (jit reuses the executable wire_bytes compiled).
  _, _, _, metrics = steps[lossy](*args[lossy])
  assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["grad_norm"]))


def test_train_step_error_feedback_and_clipping():
  import optax

  model = _gpt()
  policy = Recipe.from_dict(
    {"data": {"all_reduce": "int4", "error_feedback": True, "min_bytes": 0}}
  )
  par = Parallel3D(model, make_mesh(2, 2, 2), policy, n_micro=2)
  params = par.placement.shard(model)
  tx = optax.sgd(0.1)
  opt, ef = par.init_opt(tx, params), par.grad_sync.init_ef(params)
  assert ef is not None
  step = par.train_step(tx, params, clip_norm=1e-3)
  x, y = _batch()
  before = jax.tree.map(np.asarray, params)
  params, opt, ef, m = step(params, opt, ef, x, y)
  # Clipped to norm 1e-3, SGD moves the parameters by 0.1 * 1e-3 in total.
  delta = np.sqrt(
    sum(
      np.sum((np.asarray(a) - b) ** 2)
      for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(before))
    )
  )
  np.testing.assert_allclose(delta, 1e-4, rtol=1e-3)
  assert float(m["grad_norm"]) > 1e-3
  assert any(float(jnp.abs(e).max()) > 0 for e in jax.tree.leaves(ef))


def test_bad_mesh_rejected():
  with pytest.raises(ValueError, match="'pipe' axis size 3"):
    Parallel3D(_gpt(), make_mesh(1, 1, 3), Policy())
  with pytest.raises(ValueError, match="'tensor' axis size 8"):
    Parallel3D(_gpt(), make_mesh(1, 8, 1), Policy())
  with pytest.raises(TypeError, match="GPT or models.qwen.Qwen"):
    Parallel3D(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), make_mesh(1, 1, 1), Policy())


def test_policy_lookup_and_errors(tmp_path):
  r = Recipe.from_dict(
    {"data": {"all_reduce": "hadamard(int4)", "error_feedback": True}, "*": {"ppermute": "int8"}}
  )
  p = r.policy
  assert p.compressor("data", "all_reduce") is not None
  assert p.compressor("data", "ppermute") is None  # 'data' is named: no fallback to '*'
  assert p.compressor("pipe", "ppermute") is not None
  assert p.compressor("tensor", "all_reduce") is None
  assert r.error_feedback
  f = tmp_path / "p.toml"
  f.write_text('[tensor]\nall_reduce = "fp8"\nmin_bytes = 0\n')
  t = Policy.from_toml(str(f))
  assert t.compressor("tensor", "all_reduce") is not None
  assert t.options("tensor")["min_bytes"] == 0
  with pytest.raises(ValueError, match="unknown key 'allreduce'"):
    Policy.from_dict({"data": {"allreduce": "int8"}})
  with pytest.raises(ValueError, match="cannot parse"):
    Policy.from_dict({"data": {"all_reduce": "int9"}})
  with pytest.raises(ValueError, match="axis.op=spec"):
    Policy.from_specs(["data=int8"])
  with pytest.raises(ValueError, match="op must be one of"):
    p.compressor("data", "broadcast")

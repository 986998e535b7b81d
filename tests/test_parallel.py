"""3D-parallel (data x tensor x pipe) loss and gradients equal the single-device model's with
compression off, for GPT-2 and Qwen2 on several meshes; a lossy policy stays close and finite."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jcoccl.policy import Policy
from models import gpt, qwen
from models.parallel import Parallel3D, make_mesh, reference_loss_and_grads

VOCAB = 64


def _gpt(tied_unused=None):
  return gpt.GPT(gpt.GPTConfig(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=4,
                               n_head=4), rngs=nnx.Rngs(0))


def _qwen(tie=False):
  return qwen.Qwen(qwen.QwenConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, rope_theta=5000.0,
                                   tie_word_embeddings=tie), rngs=nnx.Rngs(1))


def _batch(n=8, s=8, seed=0):
  tok = np.random.default_rng(seed).integers(0, VOCAB, (n, s + 1))
  return jnp.asarray(tok[:, :-1], jnp.int32), jnp.asarray(tok[:, 1:], jnp.int32)


def _assert_tree_close(got, want, rtol):
  """Each leaf within rtol of the largest gradient entry (a few leaves are ~0 by symmetry:
  e.g. the key bias, which softmax cancels)."""
  scale = max(float(jnp.abs(w).max()) for w in jax.tree.leaves(want))
  for (path, w), g in zip(jax.tree_util.tree_flatten_with_path(want)[0], jax.tree.leaves(got)):
    assert g.shape == w.shape, jax.tree_util.keystr(path)
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=rtol * scale,
                               err_msg=jax.tree_util.keystr(path))


CASES = [
    ("gpt", _gpt, (2, 2, 2), 2),
    ("qwen_untied", lambda: _qwen(False), (2, 2, 2), 2),
    ("qwen_tied", lambda: _qwen(True), (2, 2, 2), 4),
    ("gpt", _gpt, (1, 2, 4), 2),
    ("qwen_untied", lambda: _qwen(False), (4, 2, 1), 1),
    ("gpt", _gpt, (8, 1, 1), 1),
    ("qwen_untied", lambda: _qwen(False), (1, 1, 2), 2),
]


@pytest.mark.parametrize("name,make,mesh,micro", CASES,
                         ids=[f"{c[0]}-{'x'.join(map(str, c[2]))}-m{c[3]}" for c in CASES])
def test_exact_matches_single_device(name, make, mesh, micro):
  model = make()
  x, y = _batch()
  want_loss, want = reference_loss_and_grads(model, x, y)
  par = Parallel3D(model, make_mesh(*mesh), Policy(), n_micro=micro)
  loss, grads = par.loss_and_grads(par.shard(model), x, y)
  np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
  _assert_tree_close(grads, want, 1e-5)


def test_every_collective_went_through_jcoccl_log():
  model = _gpt()
  par = Parallel3D(model, make_mesh(2, 2, 2), Policy(), n_micro=2)
  par.loss_and_grads(par.shard(model), *_batch())
  ops = {(axis, op) for axis, op, *_ in par.coll.log}
  assert ops == {("data", "all_reduce"), ("tensor", "all_reduce"), ("pipe", "ppermute"),
                 ("pipe", "all_reduce")}


LOSSY = {"data": {"all_reduce": "int8", "min_bytes": 0},
         "tensor": {"all_reduce": "fp8", "min_bytes": 0},
         "pipe": {"ppermute": "int8", "all_reduce": "int8", "min_bytes": 0}}


@pytest.mark.parametrize("make", [_gpt, _qwen], ids=["gpt", "qwen"])
def test_lossy_policy_close_and_finite(make):
  model = make()
  x, y = _batch()
  want_loss, want = reference_loss_and_grads(model, x, y)
  par = Parallel3D(model, make_mesh(2, 2, 2), Policy.from_dict(LOSSY), n_micro=2)
  loss, grads = par.loss_and_grads(par.shard(model), x, y)
  assert np.isfinite(float(loss))
  assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))
  # 8-bit activations and gradients: a few parts in a thousand on the loss, and the
  # gradient direction is preserved.
  np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-2)
  flat = lambda t: np.concatenate([np.asarray(a).ravel() for a in jax.tree.leaves(t)])
  g, w = flat(grads), flat(want)
  cos = float(np.dot(g, w) / (np.linalg.norm(g) * np.linalg.norm(w)))
  assert cos > 0.99, cos
  got, ref = _measured_wire_by_axis(model, par, par.shard(model), x, y)
  assert set(got) == set(ref) == {"data", "tensor", "pipe"}
  for axis in got:
    assert 0 < got[axis] < 0.5 * ref[axis], (axis, got, ref)


def _measured_wire_by_axis(model, par, params, x, y):
  """Bytes per device by mesh axis on the compiled train step, and with compression off."""
  import optax
  import jcoccl
  tx = optax.sgd(0.1)
  exact = Parallel3D(model, par.mesh, Policy(), n_micro=par.n_micro)
  measure = lambda p: jcoccl.wire_bytes(p.train_step(tx, params), params,
                                        p.init_opt(tx, params), None, x, y, mesh=par.mesh)
  return measure(par)["by_axis"], measure(exact)["by_axis"]


def test_train_step_error_feedback_and_clipping():
  import optax
  model = _gpt()
  policy = Policy.from_dict({"data": {"all_reduce": "int4", "error_feedback": True,
                                      "min_bytes": 0}})
  par = Parallel3D(model, make_mesh(2, 2, 2), policy, n_micro=2)
  params = par.shard(model)
  tx = optax.sgd(0.1)
  opt, ef = par.init_opt(tx, params), par.init_ef(params)
  assert ef is not None
  step = par.train_step(tx, params, clip_norm=1e-3)
  x, y = _batch()
  before = jax.tree.map(np.asarray, params)
  params, opt, ef, m = step(params, opt, ef, x, y)
  # Clipped to norm 1e-3, SGD moves the parameters by 0.1 * 1e-3 in total.
  delta = np.sqrt(sum(np.sum((np.asarray(a) - b) ** 2)
                      for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(before))))
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
  p = Policy.from_dict({"data": {"all_reduce": "hadamard(int4)", "error_feedback": True},
                        "*": {"ppermute": "int8"}})
  assert p.compressor("data", "all_reduce") is not None
  assert p.compressor("data", "ppermute") is None  # 'data' is named: no fallback to '*'
  assert p.compressor("pipe", "ppermute") is not None
  assert p.compressor("tensor", "all_reduce") is None
  assert p.error_feedback("data") and not p.error_feedback("pipe")
  f = tmp_path / "p.toml"
  f.write_text('[tensor]\nall_reduce = "fp8"\nmin_bytes = 0\n')
  t = Policy.from_toml(str(f))
  assert t.compressor("tensor", "all_reduce") is not None
  assert t.options("tensor")["min_bytes"] == 0
  with pytest.raises(ValueError, match="unknown key 'allreduce'"):
    Policy.from_dict({"data": {"allreduce": "int8"}})
  with pytest.raises(ValueError, match="cannot parse"):
    Policy.from_dict({"data": {"all_reduce": "int7"}})
  with pytest.raises(ValueError, match="axis.op=spec"):
    Policy.from_specs(["data=int8"])
  with pytest.raises(ValueError, match="op must be one of"):
    p.compressor("data", "broadcast")

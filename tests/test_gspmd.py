"""jcoccl.value_and_grad in jit programs sharded by the compiler (mesh data 4 x model 2).

The converted program with an exact codec against the original (equal up to the order of
the data-axis sums), int8 against the exact gradient within the codec's bound (all_reduce
and FSDP reduce_scatter), error-feedback state, accumulation, bfloat16, the errors, and one
run across 2 processes x 4 devices covering both models.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import gspmd_cases as G
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jcoccl

pytestmark = pytest.mark.unoptimized

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def mesh():
  return G.make_mesh()


@pytest.fixture(scope="module")
def mlp(mesh):
  return G.mlp(mesh)


@pytest.fixture(scope="module")
def lm(mesh):
  return G.nnx_lm(mesh)


@pytest.mark.parametrize("model", ["mlp", "lm"])
def test_gspmd_exact_codec_matches_the_original(model, request):
  """compressor "none": the same loss and gradients as jax.value_and_grad's program. Not
  bitwise in general: the partitioner orders some data-axis sums differently (the MLP's w2
  differed by 2e-9 of 4e-3 here)."""
  case = request.getfixturevalue(model)
  exact, got, _ = G.exact_and(case, compressor="none")
  G.check_close(exact, got)


@pytest.mark.parametrize("model", ["mlp", "lm"])
def test_gspmd_int8_error_feedback_within_bound(model, request):
  case = request.getfixturevalue(model)
  exact, (loss, grads), state = G.exact_and(
    case, compressor="int8", algorithm="two_shot", min_bytes=0, error_feedback=True
  )
  np.testing.assert_allclose(float(loss), float(exact[0]), rtol=1e-5)
  G.check_within(exact[1], grads, G.int8_bound(case))
  params = case[1]
  for e, p in zip(jax.tree.leaves(state), jax.tree.leaves(params)):
    assert e.shape == (4, *p.shape) and e.dtype == jnp.float32
    assert e.sharding.spec[0] == ("data",) or e.sharding.spec[0] == "data"
  # The residual is what int8 lost: non-zero, and far below the gradient itself.
  res = max(float(jnp.abs(e).max()) for e in jax.tree.leaves(state))
  assert 0 < res < max(float(jnp.abs(g).max()) for g in jax.tree.leaves(exact[1]))


def test_gspmd_fsdp_reduce_scatter_within_bound(mesh):
  """Kernels sharded over 'data' too: the gradient comes back as the shard (int8
  reduce_scatter), within the bound of the exact gradient's shard; a compressed gather of
  the weights (qwZ) keeps the loss close and the master weights' layout."""
  case = G.mlp(mesh, G.MLP_FSDP_SPECS)
  exact, (loss, grads), _ = G.exact_and(case, compressor="int8", min_bytes=0, error_feedback=True)
  np.testing.assert_allclose(float(loss), float(exact[0]), rtol=1e-5)
  G.check_within(exact[1], grads, G.int8_bound(case))
  assert grads["w1"].sharding.spec == P("data", "model")
  assert grads["w2"].sharding.spec == P("model", "data")
  _, (loss_qwz, _), _ = G.exact_and(case, compressor="int8", gather_compressor="int8", min_bytes=0)
  np.testing.assert_allclose(float(loss_qwz), float(exact[0]), rtol=2e-2)


def test_gspmd_accumulation_and_aux(mlp):
  """Two micro-batches per shard, one sync: the gradient of the whole batch; aux floats
  are averaged over the shards and integer counts summed."""
  loss_fn, params, specs, (x, y) = mlp

  def with_aux(p, x, y):
    loss = loss_fn(p, x, y)
    return loss, {"loss": loss, "rows": jnp.int32(x.shape[0])}

  grad_fn = jcoccl.value_and_grad(with_aux, has_aux=True, accumulate=2, param_specs=specs)
  mesh = params["w1"].sharding.mesh
  with jax.set_mesh(mesh):
    (loss, aux), grads = jax.jit(grad_fn)(params, x, y)
  exact = jax.jit(jax.value_and_grad(loss_fn))(params, x, y)
  G.check_close(exact, (loss, grads))
  assert int(aux["rows"]) == 32  # counts add up over micro-batches and shards
  np.testing.assert_allclose(float(aux["loss"]), float(loss), rtol=1e-6)


def test_gspmd_bfloat16(mesh):
  case = G.mlp(mesh, dtype=jnp.bfloat16)
  exact, (_, grads), _ = G.exact_and(case, compressor="int8", min_bytes=0, error_feedback=True)
  for g, e in zip(jax.tree.leaves(grads), jax.tree.leaves(exact[1])):
    assert g.dtype == jnp.bfloat16
    scale = float(jnp.abs(e.astype(jnp.float32)).max())
    err = float(jnp.abs(g.astype(jnp.float32) - e.astype(jnp.float32)).max())
    assert err <= 0.05 * scale, (err, scale)


def test_gspmd_errors_name_the_argument(mlp, mesh):
  loss_fn, params, _, (x, y) = mlp
  with pytest.raises(ValueError, match=r"axes: the mesh has axes \('data', 'model'\)"):
    jcoccl.value_and_grad(loss_fn, "batch", mesh=mesh)(params, x, y)
  with pytest.raises(ValueError, match=r"batch argument 1: its first dimension \(6\)"):
    jcoccl.value_and_grad(loss_fn, mesh=mesh)(params, x[:6], y[:6])
  sideways = G.put(mesh, np.zeros((32, 64), np.float32), P(None, "data"))
  with pytest.raises(ValueError, match=r"batch argument 1 is sharded as"):
    jcoccl.value_and_grad(loss_fn, mesh=mesh)(params, sideways, y)
  with pytest.raises(TypeError, match=r"fun must return a scalar loss"):
    jcoccl.value_and_grad(lambda p, x, y: x @ p["w1"], mesh=mesh)(params, x, y)
  grad_fn = jcoccl.value_and_grad(loss_fn, compressor="int8", error_feedback=True, mesh=mesh)
  with pytest.raises(ValueError, match=r"state: error_feedback=True needs"):
    grad_fn(params, x, y)
  with pytest.raises(ValueError, match=r"mesh: no mesh is set"):
    jcoccl.value_and_grad(loss_fn)(params, x, y)
  with pytest.raises(ValueError, match=r"policy: give either"):
    jcoccl.value_and_grad(loss_fn, compressor="int8", policy=jcoccl.Policy())
  # A stochastic codec needs a key per call, which the gradient function does not take.
  for kw, arg in (
    ({"compressor": "hadamard(int4:stochastic)"}, "compressor"),
    ({"compressor": "int8", "gather_compressor": "auto:int8:stochastic"}, "gather_compressor"),
    ({"policy": jcoccl.Policy.from_dict({"data": {"all_reduce": "int4:stochastic"}})}, "policy"),
  ):
    with pytest.raises(ValueError, match=rf"{arg}: .* rounds stochastically.*takes none"):
      jcoccl.value_and_grad(loss_fn, mesh=mesh, **kw)


def test_gspmd_policy_names_the_codec(mlp, mesh):
  """A Policy's data-axis entries apply as compressor= would (same gradients bitwise)."""
  loss_fn, params, specs, (x, y) = mlp
  policy = jcoccl.Policy.from_dict(
    {"data": {"all_reduce": "int8", "min_bytes": 0, "algorithm": "two_shot"}}
  )
  by_policy = jcoccl.value_and_grad(loss_fn, policy=policy, param_specs=specs, mesh=mesh)
  by_arg = jcoccl.value_and_grad(
    loss_fn, compressor="int8", algorithm="two_shot", min_bytes=0, param_specs=specs, mesh=mesh
  )
  a, b = jax.jit(by_policy)(params, x, y), jax.jit(by_arg)(params, x, y)
  for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


@pytest.mark.slow
def test_gspmd_two_processes():
  """Both models across 2 processes x 4 devices: int8 with error feedback stays within its
  bound, and the exact codec matches the original (the MLP: the LM's conversion sums the
  same way, and its blocks hold the MLP's layout), as in one process."""
  cmd = [
    sys.executable,
    "-m",
    "jcoccl.launch",
    "-n",
    "2",
    "--devices-per-process",
    "4",
    "--",
    sys.executable,
    os.path.join(ROOT, "tests", "gspmd_worker.py"),
  ]
  r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
  for rank in (0, 1):
    oks = re.findall(rf"^\[{rank}\] ok (\S+)$", r.stdout, re.M)
    assert sorted(oks) == ["lm-int8", "mlp-int8", "mlp-none"], r.stdout[-3000:]

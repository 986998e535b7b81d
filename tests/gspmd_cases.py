"""Models and checks of the jcoccl.value_and_grad tests, shared by tests/test_gspmd.py (one
process, 8 devices) and tests/gspmd_worker.py (2 processes x 4 devices under jcoccl.launch).

Two GSPMD programs on mesh (data 4, model 2) with Auto axes: a plain-jax MLP whose kernels
are sharded over 'model' (and over 'data' too in FSDP form), and the NNX transformer of
examples/gspmd at a tiny size. Arrays are built with make_array_from_callback, so the same
code runs in one process and across several.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jcoccl
from examples.gspmd.model import ModelConfig, TransformerLM

MLP_SPECS = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None)}
MLP_FSDP_SPECS = {"w1": P("data", "model"), "b1": P("model"), "w2": P("model", "data")}


def make_mesh() -> jax.sharding.Mesh:
  return jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def put(mesh, x: np.ndarray, spec: P) -> jax.Array:
  return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: x[i])


def mlp(mesh, specs=None, dtype=jnp.float32, batch=None, hidden: int = 128) -> tuple:
  """(loss_fn, params, specs, (x, y)): a two-layer MLP regression, batch 32 (sharded as
  ``batch``, default P('data')), ``hidden`` units."""
  batch = P("data") if batch is None else batch
  specs = specs or MLP_SPECS
  rng = np.random.default_rng(0)
  host = {
    "w1": rng.normal(size=(64, hidden)).astype(np.float32) / 8,
    "b1": rng.normal(size=(hidden,)).astype(np.float32) / 8,
    "w2": rng.normal(size=(hidden, 8)).astype(np.float32) / 8,
  }
  params = {k: put(mesh, v, specs[k]).astype(dtype) for k, v in host.items()}
  x = put(mesh, rng.normal(size=(32, 64)).astype(np.float32), batch).astype(dtype)
  y = put(mesh, rng.normal(size=(32, 8)).astype(np.float32), batch)

  def loss_fn(p, x, y):
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.mean(((h @ p["w2"]).astype(jnp.float32) - y) ** 2)

  return loss_fn, params, specs, (x, y)


def nnx_lm(mesh) -> tuple:
  """(loss_fn, params, specs, (x, y)): the example's transformer, tiny, batch 8 x 16."""
  cfg = ModelConfig(vocab_size=16, d_model=16, n_layers=1, n_heads=2, seq_len=16)
  with jax.set_mesh(mesh):
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: TransformerLM(cfg, nnx.Rngs(0))))
    specs = nnx.get_partition_spec(abstract)
    params = jax.jit(lambda: nnx.split(TransformerLM(cfg, nnx.Rngs(0)))[1])()
  tokens = np.random.default_rng(1).integers(0, 16, size=(8, 17)).astype(np.int32)
  x, y = put(mesh, tokens[:, :-1], P("data")), put(mesh, tokens[:, 1:], P("data"))

  def loss_fn(p, x, y):
    logits = nnx.merge(graphdef, p)(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  return loss_fn, params, specs, (x, y)


def host(tree) -> list[np.ndarray]:
  """The leaves of ``tree`` as float64 numpy arrays (gathered across processes)."""
  from jax.experimental import multihost_utils

  leaves = jax.tree.leaves(tree)
  if jax.process_count() > 1:
    leaves = multihost_utils.process_allgather(leaves, tiled=True)
  return [np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64) for x in leaves]


# The original program's (loss, grads) by case, computed once: each case has its own loss_fn
# (made with its params and batch), which the cases' tests convert with several settings.
_EXACT: dict = {}


def exact_and(case, **kw) -> tuple:
  """(loss, grads) of the original program and of jcoccl.value_and_grad(**kw) (with its
  new error-feedback state, None without)."""
  loss_fn, params, specs, (x, y) = case
  mesh = jax.tree.leaves(params)[0].sharding.mesh
  if loss_fn not in _EXACT:
    _EXACT[loss_fn] = jax.jit(jax.value_and_grad(loss_fn))(params, x, y)
  exact = _EXACT[loss_fn]
  grad_fn = jcoccl.value_and_grad(loss_fn, "data", param_specs=specs, mesh=mesh, **kw)
  if kw.get("error_feedback"):
    (loss, grads), state = jax.jit(grad_fn)(params, x, y, state=grad_fn.init(params))
  else:
    (loss, grads), state = jax.jit(grad_fn)(params, x, y), None
  return exact, (loss, grads), state


def check_close(exact, got, rtol=1e-5, atol=1e-7) -> None:
  """A converted exact program against the original: equal up to summation order."""
  for a, b in zip(host(exact), host(got)):
    np.testing.assert_allclose(b, a, rtol=rtol, atol=atol)


def int8_bound(case, compressor: str = "int8") -> list[np.ndarray]:
  """Per leaf: a bound on |mean of the shards' int8-coded gradients - exact mean|.

  Each shard's gradient is coded once (one_shot / reduce_scatter) and, for two_shot, the
  reduced sum again. Leaves travel in buckets, so a block may mix leaves: its error is at
  most the bound of a block filled with the largest magnitude of any leaf. The shards'
  gradients are computed here with vmap.
  """
  loss_fn, params, _, (x, y) = case
  c = jcoccl.compressors.parse(compressor)
  n = 4

  def shard(a):
    return a.reshape(n, -1, *a.shape[1:])

  local = jax.jit(jax.vmap(jax.grad(loss_fn), in_axes=(None, 0, 0)))(params, shard(x), shard(y))
  grads = host(local)

  def block_bound(magnitude: float) -> float:
    return float(np.max(c.error_bound(jnp.full((256,), magnitude, jnp.float32))))

  per = sum(block_bound(max(float(np.abs(g[r]).max()) for g in grads)) for r in range(n))
  recode = block_bound(max(float(np.abs(g).sum(0).max()) for g in grads))
  return [(per + recode + n * 2.0**-23 * np.abs(g).sum(0)) / n + 1e-12 for g in grads]


def check_within(exact, got, bounds) -> None:
  for a, b, bound in zip(host(exact), host(got), bounds):
    err = np.abs(b - a)
    assert (err <= bound).all(), f"worst error {err.max()} vs bound {np.min(bound)}"

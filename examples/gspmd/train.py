"""Trains the NNX transformer LM with jax.jit on a (data, model) mesh; ``--compressor`` turns
on jcoccl's compressed data-parallel gradient sum.

    python -m examples.gspmd.train --steps 200                       # the original program
    python -m examples.gspmd.train --steps 200 --compressor int8 --ef   # with jcoccl
    python -m jcoccl.launch -n 2 --devices-per-process 4 -- \\
        python -m examples.gspmd.train --compressor int8 --ef         # 2 processes x 4

Without ``--compressor`` this is a plain GSPMD program: the partitioner inserts the gradient
all-reduce over 'data' and the tensor-parallel collectives over 'model'. The lines marked
``# jcoccl`` are the whole change that compresses the data-axis sum (docs/gspmd.md shows
them as a diff). Batches are drawn from ``(seed, step)``, so a run resumed from a checkpoint
(``--save-at``, then ``--resume``) sees the same data as an uninterrupted one.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import pathlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jcoccl
from examples.gspmd.model import ModelConfig, TransformerLM


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int = 200
  batch: int = 32
  seq_len: int = 64
  seed: int = 0
  lr: float = 3e-3
  data: int = 4
  model: int = 2
  d_model: int = 64
  n_layers: int = 2
  dtype: str = "float32"
  fsdp: bool = False
  replicas: int = 1  # > 1: HSDP, mesh (replica, fsdp = data / replicas, model), kernels over fsdp
  compressor: str | None = None  # None: the original program
  algorithm: str = "two_shot"
  error_feedback: bool = False
  gather_compressor: str | None = None
  min_bytes: int = 0  # leaves under this many bytes are summed exactly
  accumulate: int = 1
  checkpoint: str | None = None
  save_at: int | None = None
  resume: bool = False
  max_chars: int = 400_000


def batch_at(corpus: Any, cfg: TrainConfig, step: int, sharding: NamedSharding) -> tuple:
  """The global batch of ``step``: every process draws it whole and keeps its own rows."""
  x, y = corpus.batch(
    np.random.default_rng([cfg.seed, step]), "train", batch=cfg.batch, seq_len=cfg.seq_len
  )
  return tuple(
    jax.make_array_from_callback(a.shape, sharding, lambda idx, a=a: a[idx]) for a in (x, y)
  )


def fingerprint(params: Any) -> int:
  """A checksum of the parameters' bits (order-free integer sum, the same in any process).

  One jitted program for all leaves: across processes, eager per-leaf sums are separate
  programs whose collectives each process may issue in another order.
  """

  def total(tree: Any) -> jax.Array:
    return sum(
      jnp.sum(jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32))
      for x in jax.tree.leaves(tree)
    )

  return int(jax.jit(total)(params))


def _on_mesh(mesh: Any, abstract: Any) -> Any:
  """Each leaf's NamedSharding, replicated over ``mesh`` where it has none."""
  return jax.tree.map(
    lambda a: (
      a.sharding
      if isinstance(getattr(a, "sharding", None), NamedSharding)
      else NamedSharding(mesh, P())
    ),
    abstract,
  )


def _like_params(mesh: Any, params: Any, abstract: Any) -> Any:
  """Shardings for an optimizer state: a leaf whose path ends with a parameter's path (the
  moments ``mu``, ``nu``) and has its shape is sharded as that parameter, others replicated."""
  by_path = {jax.tree_util.keystr(k): p for k, p in jax.tree_util.tree_leaves_with_path(params)}

  def pick(path: Any, a: Any) -> NamedSharding:
    key = jax.tree_util.keystr(path)
    for name, p in by_path.items():
      if key.endswith(name) and p.shape == a.shape:
        return p.sharding
    return NamedSharding(mesh, P())

  return jax.tree_util.tree_map_with_path(pick, abstract)


def build(cfg: TrainConfig, corpus: Any) -> dict[str, Any]:
  mesh, axes = make_mesh(cfg)
  mcfg = ModelConfig(
    vocab_size=-(-corpus.vocab_size // 8) * 8,
    d_model=cfg.d_model,
    n_layers=cfg.n_layers,
    seq_len=cfg.seq_len,
    dtype=cfg.dtype,
    fsdp=cfg.fsdp or cfg.replicas > 1,
    fsdp_axis="fsdp" if cfg.replicas > 1 else "data",
  )
  with jax.set_mesh(mesh):
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: TransformerLM(mcfg, nnx.Rngs(0))))
    specs = nnx.get_partition_spec(abstract)
    params = jax.jit(lambda: nnx.split(TransformerLM(mcfg, nnx.Rngs(cfg.seed)))[1])()
  tx = optax.adamw(cfg.lr)
  # Every leaf on the mesh (the step count too), so that a restored state has the same
  # shardings as a fresh one and the step program is the same executable.
  # AdamW's moments are sharded as their parameters (an FSDP program's state stays sharded).
  state_shardings = _like_params(mesh, params, jax.eval_shape(tx.init, params))
  opt_state = jax.jit(tx.init, out_shardings=state_shardings)(params)

  def loss_fn(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    logits = nnx.merge(graphdef, params)(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  grad_fn = jax.value_and_grad(loss_fn)
  ef = None
  if cfg.compressor is not None:  # jcoccl
    grad_fn = jcoccl.value_and_grad(  # jcoccl
      loss_fn,
      axes,
      compressor=cfg.compressor,
      algorithm=cfg.algorithm,
      min_bytes=cfg.min_bytes,  # jcoccl
      error_feedback=cfg.error_feedback,
      param_specs=specs,
      mesh=mesh,  # jcoccl
      gather_compressor=cfg.gather_compressor,
      accumulate=cfg.accumulate,  # jcoccl
    )  # jcoccl
    ef = grad_fn.init(params)  # jcoccl

  # The outputs keep the inputs' shardings: one executable for every step, a resumed run's too.
  loss_sharding = NamedSharding(mesh, P())
  keep = (_on_mesh(mesh, params), _on_mesh(mesh, opt_state), _on_mesh(mesh, ef), loss_sharding)

  @functools.partial(jax.jit, out_shardings=keep)
  def train_step(params: Any, opt_state: Any, ef: Any, x: jax.Array, y: jax.Array) -> tuple:
    if ef is None:
      loss, grads = grad_fn(params, x, y)
    else:
      (loss, grads), ef = grad_fn(params, x, y, state=ef)  # jcoccl
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, ef, loss

  return {
    "mesh": mesh,
    "params": params,
    "opt_state": opt_state,
    "ef": ef,
    "step": train_step,
    "batch_sharding": NamedSharding(mesh, P(axes)),
  }


def make_mesh(cfg: TrainConfig) -> tuple[jax.sharding.Mesh, tuple[str, ...]]:
  """The mesh and its data axes: (data, model), or (replica, fsdp, model) for HSDP."""
  if cfg.replicas > 1:
    if cfg.data % cfg.replicas:
      raise ValueError(f"--replicas {cfg.replicas} must divide --data {cfg.data}")
    shape, names = (cfg.replicas, cfg.data // cfg.replicas, cfg.model), ("replica", "fsdp")
  else:
    shape, names = (cfg.data, cfg.model), ("data",)
  mesh = jax.make_mesh(shape, (*names, "model"), axis_types=(AxisType.Auto,) * len(shape))
  return mesh, names


def _checkpointer(cfg: TrainConfig) -> Any:
  import orbax.checkpoint as ocp

  path = pathlib.Path(cfg.checkpoint).absolute()
  return ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(create=True))


def _tree(s: dict[str, Any], step: int) -> dict[str, Any]:
  # The step goes as a replicated global array: across processes orbax saves global arrays.
  stamp = jax.make_array_from_callback(
    (), NamedSharding(s["mesh"], P()), lambda _: np.asarray(step, np.int32)
  )
  return {"params": s["params"], "opt_state": s["opt_state"], "ef": s["ef"], "step": stamp}


def train(cfg: TrainConfig, log_every: int = 20) -> dict[str, Any]:
  """Runs ``cfg.steps`` steps; returns the per-step losses, timings and a params checksum."""
  from models.data import load_corpus

  corpus = load_corpus("char", max_chars=cfg.max_chars)
  s = build(cfg, corpus)
  start = 0
  mngr = _checkpointer(cfg) if cfg.checkpoint else None
  if cfg.resume:
    import orbax.checkpoint as ocp

    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _tree(s, 0))
    t = mngr.restore(mngr.latest_step(), args=ocp.args.StandardRestore(abstract))
    s.update(params=t["params"], opt_state=t["opt_state"], ef=t["ef"])
    start = int(t["step"])
  losses, times = [], []
  for step in range(start, cfg.steps):
    x, y = batch_at(corpus, cfg, step, s["batch_sharding"])
    t0 = time.perf_counter()
    s["params"], s["opt_state"], s["ef"], loss = s["step"](
      s["params"], s["opt_state"], s["ef"], x, y
    )
    losses.append(float(loss))
    times.append(time.perf_counter() - t0)
    if step % log_every == 0 or step == cfg.steps - 1:
      print(f"step {step} loss {losses[-1]:.4f}", flush=True)
    if mngr is not None and cfg.save_at == step + 1:
      import orbax.checkpoint as ocp

      mngr.save(step + 1, args=ocp.args.StandardSave(_tree(s, step + 1)), force=True)
      mngr.wait_until_finished()
  return {
    "config": dataclasses.asdict(cfg),
    "start": start,
    "losses": losses,
    "step_s": times,
    "fingerprint": fingerprint(s["params"]),
    "ef_fingerprint": None if s["ef"] is None else fingerprint(s["ef"]),
  }


def main(argv: list[str] | None = None) -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  for f in dataclasses.fields(TrainConfig):
    flag = "--" + f.name.replace("_", "-")
    if f.type == "bool":
      ap.add_argument(flag, action="store_true")
    else:
      kind = {"int": int, "float": float, "int | None": int}.get(str(f.type), str)
      ap.add_argument(flag, type=kind, default=f.default)
  ap.add_argument("--ef", dest="error_feedback", action="store_true", help="error feedback")
  ap.add_argument("--json", help="write the losses, step times and checksum here")
  ap.add_argument("--wire", action="store_true", help="print jcoccl.wire_bytes of the step")
  args = vars(ap.parse_args(argv))
  out, wire = args.pop("json"), args.pop("wire")
  cfg = TrainConfig(**args)
  if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # One process on CPU: as many host devices as the mesh has (jcoccl.launch sets them).
    jax.config.update("jax_num_cpu_devices", cfg.data * cfg.model)
  jcoccl.distributed.initialize()
  if wire:
    print(json.dumps(wire_report(cfg)))
    return
  result = train(cfg)
  if out and jax.process_index() == 0:
    pathlib.Path(out).write_text(json.dumps(result))
  print(f"final loss {result['losses'][-1]:.6f} fingerprint {result['fingerprint']}")


def wire_report(cfg: TrainConfig) -> dict[str, Any]:
  """Bytes per device per step by mesh axis, this program against the original."""
  from models.data import load_corpus

  corpus = load_corpus("char", max_chars=cfg.max_chars)
  s = build(cfg, corpus)
  ref = build(dataclasses.replace(cfg, compressor=None), corpus)
  x, y = batch_at(corpus, cfg, 0, s["batch_sharding"])
  traced = s["step"].trace(s["params"], s["opt_state"], s["ef"], x, y)
  reference = ref["step"].trace(ref["params"], ref["opt_state"], None, x, y)
  wb = jcoccl.wire_bytes(traced, reference=reference, mesh=s["mesh"])
  axes = set(make_mesh(cfg)[1])
  # Bytes over the data axes (one of them or several together: "replica,fsdp").
  over = lambda by: sum(v for k, v in by.items() if set(k.split(",")) <= axes)
  data, ref_data = over(wb["by_axis"]), over(wb["reference_by_axis"])
  return {
    "by_axis": wb["by_axis"],
    "reference_by_axis": wb["reference_by_axis"],
    "data_ratio": data / ref_data if ref_data else None,
  }


if __name__ == "__main__":
  main()

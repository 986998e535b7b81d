"""Generate text from a run of ``python -m models.train``: what the policy's training produced.

  python -m models.sample --name gpt-small                       # runs/gpt-small
  python -m models.sample --name gpt-small --temperature 0 --length 300     # greedy
  python -m models.sample --name gpt-small --top-k 20 --seed 1
  python -m models.sample --out runs/x --mesh 2,2,2 --prompt "**ROMEO**"  # on a mesh

Reads the run's config.json (model, size, tokenizer, --max-chars, --seq-len; written by
``models.train``) and the parameters of its newest checkpoint (``--step`` picks another), on
one device (default) or on a data x tensor x pipe mesh (the exact policy: sampling sends
uncompressed activations). Each new token is drawn from the logits of a full forward pass
over the last --seq-len tokens (the context the model was trained on), right-padded to that
length so that one compiled program serves every step; causal attention makes the padding
invisible to the positions that are read. There is no KV cache: the logits are those of
``model(tokens)`` itself (tests/test_sample.py checks them against a forward pass).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import sys
import types
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jcoccl.policy import Policy
from models import data, parallel
from models.run_config import (
  build_model,
  checkpoint_steps,
  mesh_shape,
  runs_dir,
  use_host_devices,
)

PROG = "python -m models.sample"
DEFAULT_PROMPT = "**HAMLET**  \n"
# What sampling needs from a run's config.json.
CONFIG_KEYS = ("model", "size", "tokenizer", "max_chars", "seq_len")

Forward = Callable[[np.ndarray], np.ndarray]


@dataclasses.dataclass
class Sample:
  """A generated continuation.

  Attributes:
    prompt: the prompt's token ids, int32 [p].
    tokens: the generated ids, int32 [length].
    logits: float32 [length, vocab]: row i is what token i was drawn from.
    text: the decoded generated tokens.
  """

  prompt: np.ndarray
  tokens: np.ndarray
  logits: np.ndarray
  text: str = ""


def _pick_fn(temperature: float, top_k: int | None) -> Callable:
  """jitted ``pick(logits [vocab], key) -> id``: argmax at temperature 0, else a draw from
  softmax(logits / temperature) over the ``top_k`` largest logits (all when None)."""

  def pick(logits, key):
    if temperature == 0:
      return jnp.argmax(logits)
    if top_k is not None and top_k < logits.shape[-1]:
      kth = jax.lax.top_k(logits, top_k)[0][-1]
      logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits / temperature)

  return jax.jit(pick)


def generate(
  forward: Forward,
  prompt: np.ndarray,
  *,
  length: int,
  context: int,
  temperature: float = 0.0,
  top_k: int | None = None,
  seed: int = 0,
) -> Sample:
  """Extends ``prompt`` by ``length`` tokens, one full forward pass per token.

  Args:
    forward: int32 [1, context] -> float32 logits [1, context, vocab] (a causal LM).
    prompt: int32 [p], p >= 1.
    length: tokens to generate (>= 0).
    context: the window the model reads: the last ``context`` tokens, right-padded.
    temperature: 0 for greedy (argmax), else the softmax temperature.
    top_k: draw among the ``top_k`` most likely tokens (None: all).
    seed: token i uses ``fold_in(key(seed), i)``: a fixed seed gives a fixed sample.

  Returns:
    A :class:`Sample` (``text`` left empty).

  Example:
    >>> s = generate(fwd, np.array([3, 1]), length=8, context=64)
    >>> s.tokens.shape, s.logits.shape
    ((8,), (8, vocab))
  """
  prompt = np.asarray(prompt, np.int32).reshape(-1)
  if prompt.size < 1:
    raise ValueError("prompt must hold at least one token")
  pick, key = _pick_fn(float(temperature), top_k), jax.random.key(seed)
  seq, rows = list(prompt), []
  buf = np.zeros((1, context), np.int32)
  for i in range(length):
    window = seq[-context:]
    buf[0, : len(window)] = window
    row = np.asarray(forward(buf))[0, len(window) - 1]
    rows.append(row)
    seq.append(int(pick(row, jax.random.fold_in(key, i))))
  vocab = rows[0].shape[-1] if rows else 0
  return Sample(
    prompt,
    np.asarray(seq[prompt.size :], np.int32),
    np.asarray(rows, np.float32).reshape(length, vocab),
  )


# ---- runs and checkpoints -------------------------------------------------------------------


def run_dir(name: str | None, out: str | None) -> pathlib.Path:
  """``--out``, else runs/<--name> (``models.run_config.runs_dir``); the directory must
  exist."""
  if out is None and name is None:
    raise ValueError("give --name (a run under runs/) or --out (a run directory)")
  if name is not None and (not name.strip() or "/" in name or name in (".", "..")):
    raise ValueError(f"--name must be a run name without '/', got {name!r}")
  runs = runs_dir()
  path = pathlib.Path(out) if out is not None else runs / name
  if not path.is_dir():
    if out is not None:
      raise ValueError(f"--out: no run directory {path}")
    known = sorted(p.parent.name for p in runs.glob("*/ckpt"))
    raise ValueError(
      f"--name {name}: no run directory {path} (runs with checkpoints under "
      f"{runs}/: {', '.join(known) or 'none'})"
    )
  return path


def run_config(path: pathlib.Path) -> dict:
  """What ``models.train`` recorded about the run (config.json)."""
  cfg_path = path / "config.json"
  if not cfg_path.is_file():
    raise ValueError(
      f"{cfg_path} is missing (models.train writes it when a run starts); pass "
      f"--model, --size, --tokenizer, --max-chars and --seq-len to name the "
      f"run's model"
    )
  cfg = json.loads(cfg_path.read_text())
  missing = [k for k in CONFIG_KEYS if k not in cfg]
  if missing:
    raise ValueError(f"{cfg_path} lacks {missing}")
  return cfg


def load_params(path: pathlib.Path, step: int | None = None) -> tuple[dict, int]:
  """The parameters (stacked layout, numpy) of the newest checkpoint, or of ``step``.

  Raises:
    ValueError: no checkpoint, or no checkpoint at ``step`` (the message lists those there).
  """
  steps = checkpoint_steps(path)
  if not steps:
    raise ValueError(
      f"no checkpoint under {path / 'ckpt'}: train the run first "
      f"(python -m models.train --out {path})"
    )
  if step is None:
    step = steps[-1]
  elif step not in steps:
    raise ValueError(
      f"--step {step}: no checkpoint at that step under {path / 'ckpt'} "
      f"(steps {', '.join(map(str, steps))})"
    )
  import orbax.checkpoint as ocp

  mngr = ocp.CheckpointManager(
    (path / "ckpt").absolute(), item_handlers=ocp.StandardCheckpointHandler()
  )
  meta = mngr.item_metadata(step)
  meta = getattr(meta, "tree", meta)
  # ShapeDtypeStructs without a sharding restore as numpy arrays: no dependence on the
  # devices or mesh the run was trained on.
  target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), meta)
  tree = mngr.restore(step, args=ocp.args.StandardRestore(target))
  return tree["params"], step


def build(cfg: dict, vocab: int) -> nnx.Module:
  """A freshly initialised model of the run's architecture."""
  ns = types.SimpleNamespace(model=cfg["model"], size=cfg["size"], seq_len=cfg["seq_len"], seed=0)
  return build_model(ns, vocab)


def _check_shapes(model: nnx.Module, params: dict, where: pathlib.Path) -> None:
  want = jax.tree.map(
    lambda a: tuple(a.shape), jax.eval_shape(lambda: parallel.stack_params(model))
  )
  got = jax.tree.map(lambda a: tuple(np.shape(a)), params)
  if want != got:
    raise ValueError(
      f"the checkpoint under {where} does not hold this model's parameters "
      f"(config.json or the flags name another model, size or vocabulary)"
    )


def single_device_forward(model: nnx.Module, params: dict, dtype: Any = jnp.float32) -> Forward:
  """``model``'s float32 logits with ``params`` (stacked layout) on the first device,
  computed in ``dtype`` (the run's ``--dtype``)."""
  dt = parallel.compute_dtype(dtype)
  state = nnx.state(model, nnx.Param)
  low = jax.tree.map(lambda a: jnp.asarray(a).astype(dt), params)
  nnx.replace_by_pure_dict(state, parallel.unstack_params(low))
  nnx.update(model, state)
  graphdef, weights = nnx.split(model)
  f = jax.jit(lambda w, t: nnx.merge(graphdef, w)(t).astype(jnp.float32))
  return lambda tokens: f(weights, tokens)


def mesh_forward(
  model: nnx.Module, params: dict, mesh_shape: tuple[int, int, int], dtype: Any = jnp.float32
) -> Forward:
  """The same logits computed 3D-parallel on a data x tensor x pipe mesh (exact policy)."""
  mesh = parallel.make_mesh(*mesh_shape)
  par = parallel.Parallel3D(model, mesh, Policy(), n_micro=1, dtype=dtype)
  placed = jax.device_put(params, par.placement.sharding(par.specs))
  f = par.logits_fn()
  return lambda tokens: f(placed, tokens)


def host_params(params: dict) -> dict:
  """Numpy copies of global arrays that each process holds whole (every shard addressable,
  as the training mesh keeps tensor and pipe groups inside one process)."""

  def leaf(a):
    if a.is_fully_addressable:
      return np.asarray(a)
    out = np.empty(a.shape, a.dtype)
    for s in a.addressable_shards:
      out[s.index] = np.asarray(s.data)
    return out

  return jax.tree.map(leaf, params)


def encode_prompt(vocab: data.Vocab, prompt: str) -> np.ndarray:
  try:
    ids = vocab.encode(prompt)
  except ValueError as e:
    raise ValueError(f"--prompt {prompt!r}: {e}") from None
  if ids.size < 1:
    raise ValueError("--prompt must hold at least one token")
  return ids


# ---- command line ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
  p.add_argument("--name", default=None, help="run name: runs/<name> (as models.train --name)")
  p.add_argument("--out", default=None, help="the run directory (instead of --name)")
  p.add_argument("--step", type=int, default=None, help="checkpoint step (default newest)")
  p.add_argument("--prompt", default=DEFAULT_PROMPT)
  p.add_argument("--length", type=int, default=200, help="tokens to generate")
  p.add_argument(
    "--temperature",
    type=float,
    default=0.8,
    help="softmax temperature (default 0.8); 0: greedy (argmax)",
  )
  p.add_argument("--top-k", type=int, default=None, help="draw among the k likeliest tokens")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument(
    "--mesh",
    default="1,1,1",
    help="data,tensor,pipe: sample on this mesh (default 1,1,1: one device)",
  )
  p.add_argument(
    "--dtype",
    choices=("float32", "bfloat16"),
    default=None,
    help="compute dtype (default: the run's, from config.json; float32 without one)",
  )
  for key in CONFIG_KEYS:
    p.add_argument(
      "--" + key.replace("_", "-"),
      default=None,
      type=int if key in ("max_chars", "seq_len") else str,
      help="override the run's config.json (needed for runs without one)",
    )
  return p


def check_args(args: argparse.Namespace) -> None:
  """Range checks; the run itself is checked by :func:`main`."""
  if args.length < 0:
    raise ValueError(f"--length must be >= 0, got {args.length}")
  if not math.isfinite(args.temperature) or args.temperature < 0:
    raise ValueError(f"--temperature must be a finite number >= 0, got {args.temperature}")
  if args.top_k is not None and args.top_k < 1:
    raise ValueError(f"--top-k must be >= 1, got {args.top_k}")
  if not 0 <= args.seed < 2**32:
    raise ValueError(f"--seed must be in [0, 2**32), got {args.seed}")
  args.mesh_shape = mesh_shape(args.mesh, jax.device_count())


def _config(args: argparse.Namespace) -> tuple[pathlib.Path, dict]:
  path = run_dir(args.name, args.out)
  flags = {k: getattr(args, k) for k in CONFIG_KEYS if getattr(args, k) is not None}
  if len(flags) == len(CONFIG_KEYS):
    return path, flags
  return path, {**run_config(path), **flags}


def main(argv: list[str] | None = None) -> Sample:
  """Loads the run, generates, prints the prompt and its continuation; returns the sample.

  Without an accelerator and without XLA_FLAGS, asks XLA for 8 host CPU devices first
  (``models.run_config.use_host_devices``), as ``python -m models.train`` does.

  Raises:
    ValueError: a bad flag, a missing run, config or checkpoint (``cli`` prints it as
      ``error: ...``, status 2).
  """
  use_host_devices()
  args = build_parser().parse_args(argv)
  check_args(args)
  path, cfg = _config(args)
  vocab = data.load_vocab(cfg["tokenizer"], max_chars=cfg["max_chars"])
  prompt = encode_prompt(vocab, args.prompt)
  params, step = load_params(path, args.step)
  model = build(cfg, vocab.size)
  _check_shapes(model, params, path)
  dtype = args.dtype or cfg.get("dtype", "float32")
  forward = (
    single_device_forward(model, params, dtype)
    if math.prod(args.mesh_shape) == 1
    else mesh_forward(model, params, args.mesh_shape, dtype)
  )
  s = generate(
    forward,
    prompt,
    length=args.length,
    context=cfg["seq_len"],
    temperature=args.temperature,
    top_k=args.top_k,
    seed=args.seed,
  )
  s.text = vocab.decode(s.tokens)
  how = (
    "greedy"
    if args.temperature == 0
    else f"temperature {args.temperature}, top-k {args.top_k or 'all'}, seed {args.seed}"
  )
  print(f"{path} step {step}, {cfg['model']}-{cfg['size']}, {how}:", file=sys.stderr)
  print(args.prompt + s.text)
  return s


def cli(argv: list[str] | None = None) -> int:
  try:
    main(argv)
  except ValueError as e:
    print(f"{PROG}: error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(cli())

"""Train GPT-2 or Qwen2 on Shakespeare, 3D-parallel over jcoccl's compressed collectives.

  python -m models.train                                  # small GPT, 8 CPU devices 2x2x2
  python -m models.train --model qwen --mesh 4,2,1 --policy models/configs/int8.toml
  python -m models.train --compress data.all_reduce=int4 --compress data.min_bytes=0
  python -m models.train --zero                           # ZeRO: sharded AdamW state over 'data'
  python -m models.train --zero --policy zeropp           # ZeRO++: int8 weights, int4 grads, nodes
  python -m models.train --resume                         # continue runs/<name>

Every flag and the policy are checked before anything is loaded or compiled: a bad flag exits
with ``error: --flag ...`` (status 2), a bad policy file names its table and key.

Writes runs/<name>/: metrics.jsonl (one JSON object per logged step and per validation, and
one "wire" record), loss.png, summary.json, config.json (the flags that rebuild the model, for
``python -m models.sample``) and orbax checkpoints under ckpt/; the final loss line is
followed by a short sample of the trained model (fixed prompt, seed and temperature). ``--resume``
continues from the newest checkpoint that restores; damaged newer ones are named, skipped and
moved to ckpt-skipped/, and a torn last line of metrics.jsonl is dropped. Bytes on the
wire per step and device, by mesh axis, are measured on the compiled train step with
``jcoccl.wire_bytes(..., mesh=mesh)``, next to the same step compiled with the exact policy
(summary.json "wire", with its "source"); ``--no-hlo-wire`` skips them. Without an accelerator and
without XLA_FLAGS, it asks XLA for 8 host CPU devices.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys


def _want_host_devices() -> None:
  """Fakes 8 CPU devices when there is no accelerator (must run before jax starts)."""
  if "XLA_FLAGS" in os.environ or glob.glob("/dev/nvidia[0-9]*"):
    return
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"


_want_host_devices()

import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import pathlib  # noqa: E402
import shutil  # noqa: E402
import time  # noqa: E402
from typing import Any, NoReturn  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jcoccl  # noqa: E402
from jcoccl.compressors import import_codecs  # noqa: E402
from jcoccl.policy import WILDCARD  # noqa: E402
from models import data, gpt, parallel, qwen  # noqa: E402
from models.configs import models as presets  # noqa: E402
from models.recipe import Recipe  # noqa: E402

CONFIGS = pathlib.Path(__file__).parent / "configs"
PROG = "python -m models.train"


class SetupError(ValueError):
  """A bad run configuration found before training starts: the policy file, a corpus too short
  for --seq-len, checkpoints that do not restore. ``python -m models.train`` reports it as
  ``error: ...`` with exit status 2, like a bad flag."""


def build_parser() -> argparse.ArgumentParser:
  """The command line of ``python -m models.train`` (unchecked: see :func:`check_args`)."""
  p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
  p.add_argument("--model", choices=("gpt", "qwen"), default="gpt")
  p.add_argument("--size", choices=tuple(presets.GPT), default="small")
  p.add_argument("--mesh", default="2,2,2", help="data,tensor,pipe sizes (default 2,2,2)")
  p.add_argument(
    "--policy",
    default="coccl",
    help="a TOML file, or a name under models/configs (exact, coccl, int8, "
    "zeropp, lean): per-axis compressors and the [data] training switches "
    "zero, error_feedback, nodes (models/recipe.py)",
  )
  p.add_argument(
    "--compress",
    action="append",
    default=[],
    metavar="AXIS.OP=SPEC",
    help="override one entry of --policy, e.g. data.all_reduce=int4 or "
    "data.error_feedback=false (repeatable)",
  )
  p.add_argument(
    "--codec",
    action="append",
    default=[],
    metavar="MODULE|PLUGIN",
    help="bring in a codec of your own before the policy is read: a module that calls "
    "jcoccl.compressors.register, or a native plugin library (.so) (repeatable; "
    "docs/custom_compressors.md)",
  )
  p.add_argument(
    "--zero",
    action="store_true",
    help="ZeRO data parallelism (--policy's [data] zero = true): reduce_scatter gradients, "
    "AdamW state sharded over 'data', all_gather parameters",
  )
  p.add_argument(
    "--steps",
    type=int,
    default=300,
    help="train until this step (0: build everything, train nothing)",
  )
  p.add_argument(
    "--batch",
    type=int,
    default=16,
    help="global batch (sequences), a multiple of data size x --micro",
  )
  p.add_argument("--seq-len", type=int, default=64)
  p.add_argument("--micro", type=int, default=2, help="pipeline micro-batches")
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--warmup", type=int, default=30)
  p.add_argument("--weight-decay", type=float, default=0.1)
  p.add_argument("--clip", type=float, default=1.0, help="global gradient norm clip (> 0)")
  p.add_argument("--tokenizer", choices=data.TOKENIZERS, default="char")
  p.add_argument("--max-chars", type=int, default=None, help="use only this much text")
  p.add_argument("--eval-every", type=int, default=50)
  p.add_argument("--eval-batches", type=int, default=4)
  p.add_argument("--ckpt-every", type=int, default=100)
  p.add_argument("--log-every", type=int, default=10)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--name", default=None, help="run name (default <model>-<size>)")
  p.add_argument("--out", default=None, help="output dir (default runs/<name>)")
  p.add_argument(
    "--resume", action="store_true", help="continue from the newest checkpoint that restores"
  )
  p.add_argument(
    "--no-hlo-wire",
    action="store_true",
    help="skip measuring bytes on the wire (saves two compiles; none are reported)",
  )
  p.add_argument("--no-progress", action="store_true")
  p.add_argument(
    "--sample-tokens",
    type=int,
    default=48,
    help="length of the sample printed after the final loss (0: none; more: "
    "python -m models.sample)",
  )
  return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  """Parses and checks the command line (:func:`check_args`) before anything is loaded.

  A bad flag exits with status 2 and ``error: --flag ...`` on stderr, as argparse does.
  """
  p = build_parser()
  args = p.parse_args(argv)
  try:
    check_args(args, jax.device_count())
  except ValueError as e:
    p.error(str(e))
  return args


# Flags (by dest) and their smallest accepted value.
_AT_LEAST = {
  "steps": 0,
  "batch": 1,
  "seq_len": 1,
  "micro": 1,
  "warmup": 0,
  "eval_every": 1,
  "eval_batches": 1,
  "ckpt_every": 1,
  "log_every": 1,
  "seed": 0,
  "sample_tokens": 0,
}


def _flag(dest: str) -> str:
  return "--" + dest.replace("_", "-")


def check_args(args: argparse.Namespace, n_devices: int) -> None:
  """Checks every flag and fills the derived fields (``mesh_shape``, ``name``, ``out``,
  ``policy_path``).

  Args:
    args: the parsed command line.
    n_devices: devices available for the mesh.

  Raises:
    ValueError: the first bad flag, named as on the command line (``--batch 3 must be ...``).
  """
  for dest, low in _AT_LEAST.items():
    if getattr(args, dest) < low:
      raise ValueError(f"{_flag(dest)} must be >= {low}, got {getattr(args, dest)}")
  if args.seed >= 2**32:
    raise ValueError(f"--seed must be < 2**32, got {args.seed}")
  if args.max_chars is not None and args.max_chars < 1:
    raise ValueError(f"--max-chars must be >= 1, got {args.max_chars}")
  for dest, positive in (("lr", True), ("weight_decay", False), ("clip", True)):
    v = getattr(args, dest)
    if not math.isfinite(v) or v < 0 or (positive and v == 0):
      raise ValueError(
        f"{_flag(dest)} must be a finite number {'>' if positive else '>='} 0, got {v}"
      )
  args.mesh_shape = _mesh_shape(args.mesh, n_devices)
  _check_mesh_fits(args)
  _check_output(args)
  args.policy_path = policy_path(args.policy)
  try:
    args.codec = import_codecs(args.codec)
  except ValueError as e:
    raise ValueError(f"--codec: {e}") from None
  for spec in args.compress:
    try:
      Recipe.from_specs([spec], axes=parallel.POLICY_AXES)
    except ValueError as e:
      raise ValueError(f"--compress {spec!r}: {e}") from None


def _mesh_shape(text: str, n_devices: int) -> tuple[int, int, int]:
  try:
    shape = tuple(int(v) for v in text.split(","))
  except ValueError:
    shape = ()
  if len(shape) != 3 or min(shape) < 1:
    raise ValueError(f"--mesh must be three positive integers data,tensor,pipe, got {text!r}")
  if math.prod(shape) > n_devices:
    raise ValueError(f"--mesh {text} needs {math.prod(shape)} devices; {n_devices} are available")
  return shape


def _model_config(args: argparse.Namespace, vocab: int) -> tuple[type, Any]:
  """(model class, config) of --model/--size; GPT's positions cover --seq-len."""
  if args.model == "gpt":
    kw = dict(presets.GPT[args.size])
    kw["n_positions"] = max(kw["n_positions"], args.seq_len)
    return gpt.GPT, gpt.GPTConfig(vocab_size=vocab, **kw)
  return qwen.Qwen, qwen.QwenConfig(vocab_size=vocab, **presets.QWEN[args.size])


def _check_mesh_fits(args: argparse.Namespace) -> None:
  """The mesh divides the model (layers over 'pipe', heads over 'tensor') and the batch."""
  data, tensor, pipe = args.mesh_shape
  cls, cfg = _model_config(args, vocab=1)
  fam = parallel._FAMILIES[cls]
  what = f"--model {args.model} --size {args.size}"
  layers = getattr(cfg, fam.layers_field)
  if layers % pipe:
    raise ValueError(
      f"--mesh {args.mesh}: the pipe size {pipe} must divide the {layers} layers of {what}"
    )
  if any(n % tensor for n in fam.heads(cfg)):
    raise ValueError(
      f"--mesh {args.mesh}: the tensor size {tensor} must divide the head "
      f"counts and MLP width {fam.heads(cfg)} of {what}"
    )
  if args.batch % (data * args.micro):
    raise ValueError(
      f"--batch {args.batch} must be a multiple of the data size {data} "
      f"(--mesh) x --micro {args.micro} = {data * args.micro}"
    )
  if args.zero and data == 1:
    raise ValueError(
      f"--zero shards over the data axis, which needs a size > 1 (--mesh {args.mesh})"
    )


def _check_output(args: argparse.Namespace) -> None:
  """--name and --out; a fresh run must not land on an earlier run's checkpoints."""
  if args.name is not None and (
    not args.name.strip() or "/" in args.name or args.name in (".", "..")
  ):
    raise ValueError(f"--name must be a non-empty name without '/', got {args.name!r}")
  args.name = args.name or f"{args.model}-{args.size}"
  args.out = pathlib.Path(args.out or pathlib.Path("runs") / args.name)
  if args.out.exists() and not args.out.is_dir():
    raise ValueError(f"--out {args.out} is a file, not a directory")
  steps = checkpoint_steps(args.out)
  if args.resume and not steps:
    raise ValueError(f"--resume: no checkpoint under {args.out / 'ckpt'}")
  if not args.resume and steps:
    raise ValueError(
      f"--out {args.out} holds checkpoints of an earlier run (steps "
      f"{', '.join(map(str, steps))}): pass --resume to continue it, or choose "
      f"another --out or --name"
    )


def checkpoint_steps(out: pathlib.Path) -> list[int]:
  """The steps of the checkpoint directories under ``out/ckpt`` (restorable or not)."""
  ckpt = out / "ckpt"
  if not ckpt.is_dir():
    return []
  return sorted(int(d.name) for d in ckpt.iterdir() if d.is_dir() and d.name.isdigit())


def policy_path(name: str) -> pathlib.Path:
  """--policy: a TOML file, or the name of one under models/configs."""
  path = pathlib.Path(name)
  if not path.suffix and (CONFIGS / f"{name}.toml").exists():
    path = CONFIGS / f"{name}.toml"
  if not path.is_file():
    names = sorted(p.stem for p in CONFIGS.glob("*.toml"))
    raise ValueError(f"--policy must be a TOML file or one of {names}, got {name!r}")
  return path


def load_policy(args: argparse.Namespace) -> Recipe:
  """--policy (a recipe: the jcoccl.Policy and the training switches, models.recipe) with
  --compress overrides and --zero on top, every entry checked.

  An override of an axis that the file leaves to ``"*"`` starts from the ``"*"`` entry, so
  ``--compress data.all_reduce=int4`` changes that one op and keeps the rest.

  Raises:
    SetupError: the policy file is bad; the message names the file, table and key
      (``p.toml: [tensor] zero: ...``).
    ValueError: a bad --compress value (``parse_args`` reports those as flag errors).
  """
  path = getattr(args, "policy_path", None) or policy_path(args.policy)
  try:
    base = Recipe.from_toml(str(path), axes=parallel.POLICY_AXES)
  except (ValueError, TypeError, OSError) as e:
    raise SetupError(str(e)) from e
  table = {axis: dict(entry) for axis, entry in base.source.items()}
  for spec in args.compress:
    for axis, entries in Recipe.from_specs([spec], axes=parallel.POLICY_AXES).source.items():
      _axis_entry(table, axis).update(entries)
  if args.zero:
    _axis_entry(table, "data")["zero"] = True
  recipe = Recipe.from_dict(table, axes=parallel.POLICY_AXES)
  _check_nodes(recipe, args, path)
  return recipe


def _check_nodes(recipe: Recipe, args: argparse.Namespace, path: pathlib.Path) -> None:
  """ZeRO++'s ``[data] nodes`` needs ZeRO mode and must divide the mesh's data size."""
  nodes, data = recipe.nodes, getattr(args, "mesh_shape", (0,))[0]
  if nodes == 1 or not data:
    return
  if not recipe.zero:
    raise SetupError(
      f"{path}: [data] nodes = {nodes} splits ZeRO's data level; it needs "
      f"[data] zero = true (or --zero)"
    )
  if data % nodes:
    raise SetupError(
      f"{path}: [data] nodes = {nodes} must divide the data size {data} of --mesh {args.mesh}"
    )


def _axis_entry(table: dict, axis: str) -> dict:
  """``table[axis]``, created from the ``"*"`` entry the axis used while it was not named."""
  if axis not in table:
    table[axis] = dict(table.get(WILDCARD, {})) if axis != WILDCARD else {}
  return table[axis]


def check_corpus(args: argparse.Namespace, corpus: data.Corpus) -> None:
  """Both splits hold a --seq-len window and its next token with room to sample."""
  need = args.seq_len + 2
  for split in ("train", "val"):
    n = len(getattr(corpus, split))
    if n < need:
      raise SetupError(
        f"--seq-len {args.seq_len} needs at least {need} tokens in the {split} "
        f"split, which has {n} (--max-chars {args.max_chars}, --tokenizer "
        f"{args.tokenizer}): raise --max-chars or lower --seq-len"
      )


def build_model(args: argparse.Namespace, vocab: int) -> nnx.Module:
  cls, cfg = _model_config(args, vocab)
  return cls(cfg, rngs=nnx.Rngs(args.seed))


def lr_schedule(args: argparse.Namespace) -> optax.Schedule:
  """Linear warmup from lr/warmup (so the first step already moves) to lr, then cosine to 10%."""
  warmup = min(args.warmup, max(args.steps - 1, 1))
  return optax.warmup_cosine_decay_schedule(
    args.lr / max(warmup, 1), args.lr, warmup, max(args.steps, 2), end_value=args.lr * 0.1
  )


def make_optimizer(args: argparse.Namespace) -> optax.GradientTransformation:
  """AdamW over :func:`lr_schedule` (clipping is done globally, in parallel)."""
  return optax.adamw(lr_schedule(args), b1=0.9, b2=0.95, weight_decay=args.weight_decay)


@dataclasses.dataclass
class State:
  params: Any
  opt_state: Any
  ef: Any
  step: int = 0

  def tree(self) -> dict:
    # The step is a global array replicated over the parameters' mesh: across processes,
    # orbax saves only global arrays.
    mesh = jax.tree.leaves(self.params)[0].sharding.mesh
    step = jax.make_array_from_callback(
      (), jax.NamedSharding(mesh, jax.P()), lambda _: np.asarray(self.step, np.int32)
    )
    return {"params": self.params, "opt_state": self.opt_state, "ef": self.ef, "step": step}


def _checkpointer(out: pathlib.Path):
  import orbax.checkpoint as ocp

  return ocp.CheckpointManager(
    (out / "ckpt").absolute(), options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True)
  )


def save(mngr, state: State) -> None:
  import orbax.checkpoint as ocp

  mngr.save(state.step, args=ocp.args.StandardSave(state.tree()), force=True)
  mngr.wait_until_finished()


def restore(mngr, state: State, out: pathlib.Path) -> State:
  """The newest checkpoint that restores onto ``state``'s shapes and shardings.

  A checkpoint that does not restore (truncated or corrupt files, another model's shapes) is
  skipped with a message naming its step and the reason, and moved to ``out/ckpt-skipped/``
  (kept for inspection) so that the resumed run can save that step again.

  Raises:
    SetupError: no checkpoint restores; the message lists each step and its reason.
  """
  import orbax.checkpoint as ocp

  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state.tree())
  skipped = []
  for step in sorted(mngr.all_steps(), reverse=True):
    try:
      t = mngr.restore(step, args=ocp.args.StandardRestore(abstract))
      if int(t["step"]) != step:
        raise ValueError(f"it holds step {int(t['step'])}")
    except Exception as e:
      skipped.append((step, _reason(e)))
      print(f"--resume: skipping the checkpoint at step {step}: {skipped[-1][1]}", file=sys.stderr)
      continue
    _set_aside(mngr, [s for s, _ in skipped], out)
    return State(t["params"], t["opt_state"], t["ef"], step)
  why = "; ".join(f"step {s}: {r}" for s, r in skipped) or "there are none"
  raise SetupError(f"--resume: no checkpoint under {mngr.directory} restores ({why})")


def _reason(e: BaseException) -> str:
  lines = str(e).strip().splitlines()
  text = f"{type(e).__name__}: {lines[0] if lines else ''}"
  return text if len(text) <= 300 else text[:297] + "..."


def _set_aside(mngr, steps: list[int], out: pathlib.Path) -> None:
  """Moves the checkpoints of ``steps`` to ``out/ckpt-skipped/<step>``."""
  for step in steps:
    dest = out / "ckpt-skipped" / str(step)
    n = 0
    while dest.exists():
      n += 1
      dest = out / "ckpt-skipped" / f"{step}.{n}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(pathlib.Path(str(mngr.directory)) / str(step)), dest)
    print(f"--resume: moved the checkpoint of step {step} to {dest}", file=sys.stderr)
  if steps:
    mngr.reload()


def batch_at(
  corpus: data.Corpus, args, par: parallel.Parallel3D, split: str, step: int, i: int = 0
) -> tuple[jax.Array, jax.Array]:
  """The global batch for (split, step), placed on ``par``'s batch sharding.

  A function of the seed only, so a resumed run sees the same, and so does a run over any
  number of processes: each draws the whole batch's window starts (cheap) and reads the
  token windows of its own rows only.
  """
  rng = np.random.default_rng([args.seed, step, i, 0 if split == "train" else 1])
  starts = corpus.starts(rng, split, batch=args.batch, seq_len=args.seq_len)
  return par.make_batch(args.batch, lambda rows: corpus.windows(split, starts[rows], args.seq_len))


NO_WIRE = {"source": None, "note": "bytes on the wire not measured (--no-hlo-wire)"}
WIRE_SOURCE = (
  "measured: jcoccl.wire_bytes(..., mesh=mesh) on the compiled train step; "
  "uncompressed = the same step compiled with the exact policy (no compression)"
)


def wire_report(
  par: parallel.Parallel3D,
  exact: parallel.Parallel3D,
  tx: optax.GradientTransformation,
  step_fn,
  state: State,
  x,
  clip: float | None,
) -> dict:
  """Bytes each device sends per train step, by mesh axis, read from the compiled HLO.

  The step is measured as compiled; the uncompressed reference compiles the same step once
  more with ``exact`` (the same model and mesh under the exact policy: about 3 s on CPU for
  the default run), so both columns count what XLA actually sends, including the algorithms
  jcoccl picks (one_shot = all_gather of payloads, two_shot = all_to_all + all_gather).

  Returns:
    {"source", "by_axis": {axes: {"compressed", "uncompressed", "crosses_processes"}},
    "total": {...}, "across_processes": {...}, "inside_process": {...}, "by_op": {op: bytes},
    "reference_by_op": {op: bytes}}; axes are mesh axis names joined by commas, "?" for
    groups that match no mesh axes. "across_processes" sums the axes whose device groups
    span several processes (the bytes that go over the network between hosts; "?" counts
    there whenever there are several processes), "inside_process" the others.
  """
  abstract = lambda t: jax.tree.map(
    lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), t
  )
  p, o, xs = abstract(state.params), abstract(state.opt_state), abstract(x)
  got = jcoccl.wire_bytes(step_fn, p, o, abstract(state.ef), xs, xs, mesh=par.mesh)
  ref_step = exact.train_step(tx, state.params, clip_norm=clip)
  ref = jcoccl.wire_bytes(ref_step, p, o, None, xs, xs, mesh=exact.mesh)
  axes = sorted(set(got["by_axis"]) | set(ref["by_axis"]), key=_axis_order)
  by_axis = {
    a: {
      "compressed": got["by_axis"].get(a, 0.0),
      "uncompressed": ref["by_axis"].get(a, 0.0),
      "crosses_processes": _crosses(par.mesh, a),
    }
    for a in axes
  }
  return {
    "source": WIRE_SOURCE,
    "by_axis": by_axis,
    "total": {"compressed": got["total"], "uncompressed": ref["total"]},
    **_process_split(by_axis),
    "by_op": got["by_op"],
    "reference_by_op": ref["by_op"],
  }


def _crosses(mesh, key: str) -> bool:
  if key == "?":
    return jax.process_count() > 1
  return parallel.crosses_processes(mesh, tuple(key.split(",")))


def _process_split(by_axis: dict) -> dict:
  """Bytes of the axes that cross processes and of those that stay inside one."""
  out = {}
  for name, crossing in (("across_processes", True), ("inside_process", False)):
    rows = [r for r in by_axis.values() if r["crosses_processes"] == crossing]
    out[name] = {k: float(sum(r[k] for r in rows)) for k in ("compressed", "uncompressed")}
  return out


def _axis_order(key: str) -> tuple:
  names = key.split(",")
  order = parallel.POLICY_AXES
  return (len(names), [order.index(n) if n in order else 99 for n in names])


def evaluate(par, eval_fn, state: State, corpus, args) -> float:
  losses = []
  for i in range(args.eval_batches):
    x, y = batch_at(corpus, args, par, "val", state.step, i)
    losses.append(float(eval_fn(state.params, x, y)))
  return float(np.mean(losses))


def plot(records: list[dict], path: pathlib.Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  tr = [(r["step"], r["loss"]) for r in records if "loss" in r]
  va = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
  fig, ax = plt.subplots(figsize=(6, 4))
  if tr:
    ax.plot(*zip(*tr), label="train")
  if va:
    ax.plot(*zip(*va), "o-", label="validation")
  ax.set_xlabel("step")
  ax.set_ylabel("cross entropy (nats/token)")
  if tr or va:
    ax.legend()
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def read_records(path: pathlib.Path) -> list[dict]:
  """The records of metrics.jsonl.

  A torn last line (a run killed while writing it) is dropped with a note; any other line
  that is not a record is an error.

  Raises:
    SetupError: a line before the last is not a JSON object with an integer "step".
  """
  if not path.exists():
    return []
  lines = path.read_bytes().decode("utf-8", errors="replace").splitlines()
  numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
  records = []
  for k, (lineno, line) in enumerate(numbered):
    rec = _record(line)
    if rec is not None:
      records.append(rec)
    elif k == len(numbered) - 1:
      print(
        f"--resume: dropping the torn last line {lineno} of {path}: {line[:60]!r}", file=sys.stderr
      )
    else:
      raise SetupError(f"{path}: line {lineno} is not a metrics record: {line[:80]!r}")
  return records


def _record(line: str) -> dict | None:
  try:
    rec = json.loads(line)
  except ValueError:
    return None
  ok = isinstance(rec, dict) and type(rec.get("step")) is int
  return rec if ok else None


def lead() -> bool:
  """Whether this is process 0, the one that writes metrics, the plot and the summary."""
  return jax.process_index() == 0


def main(argv: list[str] | None = None) -> dict:
  """Runs training; returns the summary dict (also written to summary.json).

  Flags are checked first (a bad one exits with status 2), then the policy (SetupError naming
  the file and key), before the corpus is loaded or anything compiled.

  Under ``python -m jcoccl.launch`` or a cluster launcher (see
  :func:`jcoccl.distributed.initialize`) every process runs this same function: they join
  one runtime, share one mesh ('data' across processes) and checkpoint together; process 0
  writes metrics.jsonl, loss.png and summary.json.
  """
  multi = jcoccl.distributed.initialize()
  args = parse_args(argv)
  recipe = load_policy(args)
  corpus = data.load_corpus(args.tokenizer, max_chars=args.max_chars)
  check_corpus(args, corpus)
  model = build_model(args, corpus.vocab_size)
  mesh = parallel.make_mesh(*args.mesh_shape)
  par = parallel.Parallel3D(model, mesh, recipe, n_micro=args.micro)
  tx = make_optimizer(args)
  params = par.shard(model)
  state = State(params, par.init_opt(tx, params), par.init_ef(params))
  # The uncompressed reference for the wire-bytes report: same model, mesh and ZeRO mode
  # (the same optimizer-state layout and node split), exact policy.
  ref = Recipe(zero=True, nodes=recipe.nodes) if recipe.zero else Recipe()
  exact = None if args.no_hlo_wire else parallel.Parallel3D(model, mesh, ref, n_micro=args.micro)
  args.out.mkdir(parents=True, exist_ok=True)
  if lead():
    write_config(args)
  mngr = _checkpointer(args.out)
  metrics_path = args.out / "metrics.jsonl"
  if args.resume:
    state = restore(mngr, state, args.out)
    if state.step > args.steps:
      raise SetupError(
        f"--steps {args.steps} is below step {state.step} of the checkpoint "
        f"to resume; pass --steps {state.step} or more"
      )
  records = _start_metrics(metrics_path, state.step if args.resume else None)
  if not multi:
    return _train(args, par, exact, tx, state, corpus, mngr, records, metrics_path, recipe)
  try:
    return _train(args, par, exact, tx, state, corpus, mngr, records, metrics_path, recipe)
  except jax.errors.JaxRuntimeError as e:
    _lost_peer(e)


# The flags recorded in config.json: what rebuilds the model and its data (models.sample).
CONFIG_FLAGS = (
  "model",
  "size",
  "tokenizer",
  "max_chars",
  "seq_len",
  "mesh",
  "policy",
  "compress",
  "codec",
  "zero",
  "steps",
  "batch",
  "micro",
  "lr",
  "seed",
)


def write_config(args: argparse.Namespace) -> None:
  """``out/config.json``: the run's flags that name its model, vocabulary and training."""
  cfg = {k: getattr(args, k) for k in CONFIG_FLAGS}
  cfg["policy_path"] = str(args.policy_path) if getattr(args, "policy_path", None) else None
  (args.out / "config.json").write_text(json.dumps(cfg, indent=1))


def _start_metrics(path: pathlib.Path, resumed_at: int | None) -> list[dict]:
  """Process 0: the records kept from before ``resumed_at`` (none for a fresh run), written
  back to ``path``. Other processes keep no records."""
  if not lead():
    return []
  records = [] if resumed_at is None else [r for r in read_records(path) if r["step"] <= resumed_at]
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return records


_PEER_LOST = re.compile(
  r"gloo|connection reset|connection closed|heartbeat|another task|"
  r"unavailable|socket closed|broken pipe",
  re.IGNORECASE,
)


def _lost_peer(e: Exception) -> NoReturn:
  """Ends this process at once after a collective failed in a multi-process run.

  A process that died leaves the others' next collective failing ("Gloo ... Connection
  reset by peer"); one clear line and ``os._exit`` avoid the traceback and the coordination
  service's abort at interpreter exit. Checkpoints on disk stay valid for ``--resume``.
  """
  first = next((l.strip() for l in str(e).splitlines() if l.strip()), type(e).__name__)
  who = (
    "a peer process failed"
    if _PEER_LOST.search(str(e))
    else (f"process {jax.process_index()} failed")
  )
  sys.stdout.flush()
  print(f"models.train: {who}: {first}; resume with --resume", file=sys.stderr, flush=True)
  os._exit(1)


def cli(argv: list[str] | None = None) -> int:
  """``python -m models.train``: :func:`main`, with a SetupError reported like a bad flag
  (``error: ...``, exit status 2, no traceback)."""
  try:
    main(argv)
  except SetupError as e:
    print(f"{PROG}: error: {e}", file=sys.stderr)
    return 2
  return 0


def _train(args, par, exact, tx, state, corpus, mngr, records, metrics_path, recipe) -> dict:
  step_fn = par.train_step(tx, state.params, clip_norm=args.clip)
  eval_fn = jax.jit(lambda p, x, y: par.loss_and_grads(p, x, y)[0])
  start_step, n_params = state.step, sum(a.size for a in jax.tree.leaves(state.params))
  say(
    f"{args.model}-{args.size}: {n_params / 1e6:.2f}M params, vocab {corpus.vocab_size} "
    f"({args.tokenizer}), mesh data x tensor x pipe = {args.mesh} over "
    f"{jax.process_count()} process(es), policy:\n  " + recipe.describe().replace("\n", "\n  ")
  )
  from tqdm import tqdm

  bar = tqdm(
    range(start_step, args.steps),
    initial=start_step,
    total=args.steps,
    disable=args.no_progress or not lead(),
    desc="train",
  )
  tokens_per_step = args.batch * args.seq_len
  wire, t_steady, n_steady, lr = None, 0.0, 0, lr_schedule(args)
  with open(metrics_path if lead() else os.devnull, "a") as log:
    for step in bar:
      x, y = batch_at(corpus, args, par, "train", step)
      t0 = time.perf_counter()
      state.params, state.opt_state, state.ef, m = step_fn(
        state.params, state.opt_state, state.ef, x, y
      )
      loss = float(m["loss"])
      dt = time.perf_counter() - t0
      if wire is None:
        wire = (
          NO_WIRE if exact is None else wire_report(par, exact, tx, step_fn, state, x, args.clip)
        )
        log.write(json.dumps({"step": step + 1, "wire": wire}) + "\n")
      else:
        t_steady, n_steady = t_steady + dt, n_steady + 1
      state.step = step + 1
      rec = {
        "step": state.step,
        "loss": loss,
        "grad_norm": float(m["grad_norm"]),
        "lr": float(lr(step)),
        "step_s": dt,
      }
      if not np.isfinite(loss):
        raise FloatingPointError(f"loss became {loss} at step {state.step}")
      if state.step % args.eval_every == 0 or state.step == args.steps:
        rec["val_loss"] = evaluate(par, eval_fn, state, corpus, args)
      if state.step % args.log_every == 0 or "val_loss" in rec or step == start_step:
        log.write(json.dumps(rec) + "\n")
        log.flush()
        records.append(rec)
      bar.set_postfix(loss=f"{loss:.3f}")
      if state.step % args.ckpt_every == 0 or state.step == args.steps:
        save(mngr, state)
  bar.close()
  tps = tokens_per_step * n_steady / t_steady if n_steady else None
  return _finish(args, state, records, wire or NO_WIRE, tps, start_step, corpus)


def print_wire(wire: dict) -> None:
  """The by-axis table of :func:`wire_report` (or why there is none)."""
  if not wire.get("source"):
    print(wire.get("note", "bytes on the wire not measured"))
    return
  print(f"bytes on the wire per step per device, by mesh axis ({wire['source']}):")
  rows = [
    (a, r, " (across processes)" if r.get("crosses_processes") else "")
    for a, r in wire["by_axis"].items()
  ] + [("total", wire["total"], "")]
  if "across_processes" in wire and jax.process_count() > 1:
    rows += [
      ("across", wire["across_processes"], " (between processes: the network)"),
      ("inside", wire["inside_process"], " (inside each process)"),
    ]
  for axis, row, note in rows:
    ratio = row["compressed"] / row["uncompressed"] if row["uncompressed"] else float("nan")
    print(
      f"  {axis:12s} compressed {row['compressed'] / 1e3:10.1f} kB   uncompressed "
      f"{row['uncompressed'] / 1e3:10.1f} kB   ratio {ratio:.3f}{note}"
    )


def say(text: str) -> None:
  """Prints on process 0 only (every process computes the same numbers)."""
  if lead():
    print(text, flush=True)


def _num(v: float | None) -> str:
  return "n/a" if v is None else f"{v:.4f}"


# The end-of-run sample: a fixed prompt, seed and temperature, so that runs under different
# policies can be read side by side (greedy decoding of small char models mostly loops).
SAMPLE_TEMPERATURE, SAMPLE_SEED = 0.8, 0


def final_sample(args: argparse.Namespace, params: dict, corpus: data.Corpus) -> str:
  """A short continuation of a fixed prompt by the trained parameters (one device, fixed
  seed and temperature :data:`SAMPLE_TEMPERATURE`)."""
  from models import sample

  try:
    prompt = corpus.encode(sample.DEFAULT_PROMPT)
  except ValueError:  # a --max-chars corpus too short to hold the prompt's characters
    prompt = corpus.val[:8]
  model = build_model(args, corpus.vocab_size)
  fwd = sample.single_device_forward(model, sample.host_params(params))
  s = sample.generate(
    fwd,
    prompt,
    length=args.sample_tokens,
    context=args.seq_len,
    temperature=SAMPLE_TEMPERATURE,
    seed=SAMPLE_SEED,
  )
  return corpus.decode(prompt) + corpus.decode(s.tokens)


def _finish(args, state, records, wire, tps, start_step, corpus) -> dict:
  if not lead():
    return {
      "steps": state.step,
      "resumed_from": start_step if args.resume else None,
      "wire": wire,
      "tokens_per_s": tps,
    }
  plot(records, args.out / "loss.png")
  losses = [r["loss"] for r in records if "loss" in r]
  vals = [r["val_loss"] for r in records if "val_loss" in r]
  summary = {
    "steps": state.step,
    "resumed_from": start_step if args.resume else None,
    "loss_start": losses[0] if losses else None,
    "loss_end": losses[-1] if losses else None,
    "val_loss_end": vals[-1] if vals else None,
    "tokens_per_s": tps,
    "wire": wire,
    "sample": None,
  }
  if args.sample_tokens and state.step > start_step:
    summary["sample"] = final_sample(args, state.params, corpus)
  (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
  if state.step == start_step:
    print(f"\nno steps run: at step {state.step}, --steps {args.steps}")
  else:
    print(
      f"\nloss {_num(summary['loss_start'])} -> {_num(summary['loss_end'])}"
      + (f" (val {vals[-1]:.4f})" if vals else "")
      + f" over steps {start_step}.."
      f"{state.step}, "
      + (f"{tps:,.0f} tokens/s (steady state)" if tps else "no steady-state steps timed")
    )
    if summary["sample"] is not None:
      print(
        f"sample ({args.sample_tokens} tokens, temperature {SAMPLE_TEMPERATURE}, seed "
        f"{SAMPLE_SEED}; more: python -m models.sample --out {args.out}):\n  "
        + summary["sample"].replace("\n", "\n  ")
      )
  print_wire(wire)
  print(f"outputs in {args.out}/ (metrics.jsonl, loss.png, summary.json, config.json, ckpt/)")
  return summary


if __name__ == "__main__":
  sys.exit(cli())
